"""``pkgd run-batch -i requests.jsonl -o results.jsonl``: an OpenAI batch file on the offline engine.

Input: one JSON object per line, OpenAI's batch format ``{"custom_id", "method": "POST",
"url": "/v1/completions" | "/v1/chat/completions", "body": {...}}``. Every valid request runs
in one continuous batch on an in-process engine (`LLM`). Output: one line per input line, in
input order, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``
where ``body`` is the completion / chat completion object the HTTP API would return. A bad
line (malformed JSON, unsupported URL, invalid field, prompt too long) gets status 400 and an
OpenAI-shaped error, and the rest of the batch still runs. ``-i``/``-o`` accept ``-`` for
stdin/stdout.

Each body is validated by the same request models as the HTTP API (`pkgd.api.protocol`), so
structured outputs (``response_format``, ``structured_outputs``, ``guided_*``) and a forced
``tool_choice`` work as they do over HTTP, and a field the API would refuse is refused here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

import msgspec

from pkgd.cli.base import CLISubcommand
from pkgd.sampling_params import SamplingParams

DESCRIPTION = """\
Run a file of OpenAI batch requests on an in-process engine (as vllm run-batch). Each input
line is {"custom_id", "method": "POST", "url": "/v1/completions" or "/v1/chat/completions",
"body": {...}}; all valid lines run in one continuous batch. Each output line, in input
order, is {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"},
the body being what the HTTP API would answer. A bad line gets status 400 and an
OpenAI-shaped error; the other lines still run. Configuration flags and overrides (--model,
--max-num-seqs 64) choose the engine as for pkgd serve."""

EXAMPLES = """\
examples:
  pkgd run-batch -i requests.jsonl -o results.jsonl
  cat requests.jsonl | pkgd run-batch -i - -o - --max-model-len 4096 > results.jsonl"""

# OpenAI body field -> SamplingParams field (same meaning), plus vLLM's extra fields.
_COMMON = {
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "prompt_logprobs": "prompt_logprobs",
}


class BadRequest(ValueError):
    """A line that cannot run; becomes a 400 with this message."""


def sampling_params_from_body(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """`SamplingParams` of an OpenAI completions / chat completions body; raises `BadRequest`."""
    kw: dict[str, Any] = {dst: body[src] for src, dst in _COMMON.items() if body.get(src) is not None}
    stop = body.get("stop")
    if stop is not None:
        kw["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("logit_bias"):
        kw["logit_bias"] = {int(k): float(v) for k, v in body["logit_bias"].items()}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens", 16)
    kw["max_tokens"] = max_tokens
    if chat:
        if body.get("logprobs"):
            kw["logprobs"] = int(body.get("top_logprobs") or 0)
    elif body.get("logprobs") is not None:
        kw["logprobs"] = int(body["logprobs"])
    try:
        params = SamplingParams(**kw)
        params.verify()
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from None
    return params


def _completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompt):
            return list(prompt)
    raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists")


class _Item:
    """One input line: its ids, what it asks, and the engine requests built for it."""

    def __init__(self, line_no: int, custom_id: str | None) -> None:
        self.line_no = line_no
        self.custom_id = custom_id
        self.request_id = f"batch-{uuid.uuid4().hex}"
        self.response_id: str | None = None  # the body's request_id (vLLM's field), else from request_id
        self.request: Any = None  # the body as the API's request model validated it
        self.error: str | None = None
        self.url = ""
        self.body: dict[str, Any] = {}
        self.processed: list[Any] = []
        self.constraint: Any = None  # pkgd.api.structured.Constraint


def _prepare(llm: Any, model_name: str, line_no: int, line: str) -> _Item:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        item = _Item(line_no, None)
        item.error = f"line {line_no}: malformed JSON: {exc}"
        return item
    item = _Item(line_no, obj.get("custom_id") if isinstance(obj, dict) else None)
    try:
        if not isinstance(obj, dict) or not isinstance(obj.get("body"), dict):
            raise BadRequest("each line needs an object with 'custom_id', 'url' and a 'body' object")
        item.url, item.body = obj.get("url", ""), obj["body"]
        if item.body.get("model") not in (None, model_name):
            raise BadRequest(f"the model {item.body['model']!r} does not exist; this batch runs {model_name!r}")
        if item.body.get("stream"):  # as OpenAI's and vLLM's batch APIs: a result is one body
            raise BadRequest("stream: true is not supported in a batch (each result line holds one whole response)")
        proc = llm.input_processor
        if item.url in ("/v1/completions", "/v1/chat/completions"):
            item.request, item.constraint = _constraint(item.body, chat=item.url == "/v1/chat/completions")
            item.response_id = item.request.request_id
        if item.url == "/v1/completions":
            params = _constrained(sampling_params_from_body(item.body, chat=False), item.constraint)
            keep = item.request.truncate_prompt_tokens
            item.processed = [
                proc.process(
                    f"{item.request_id}-{i}",
                    p,
                    params,
                    add_special_tokens=item.request.add_special_tokens,
                    truncate_prompt_tokens=keep,
                )
                for i, p in enumerate(_completion_prompts(item.body))
            ]
        elif item.url == "/v1/chat/completions":
            from pkgd.api.errors import APIError
            from pkgd.api.serving_chat import template_args

            params = _constrained(sampling_params_from_body(item.body, chat=True), item.constraint)
            req = item.request
            try:
                template = template_args(req)
            except APIError as exc:
                raise BadRequest(exc.message) from None
            item.processed = [
                proc.process_chat(
                    item.request_id,
                    params=params,
                    add_special_tokens=req.add_special_tokens,
                    truncate_prompt_tokens=req.truncate_prompt_tokens,
                    **template,
                )
            ]
        else:
            raise BadRequest(f"unsupported url {item.url!r}; supported: /v1/completions, /v1/chat/completions")
    except ValueError as exc:
        item.error = str(exc)
        item.processed = []
    return item


def _constraint(body: dict[str, Any], *, chat: bool) -> tuple[Any, Any]:
    """The body as the API's request model validates it, and its structured-output
    constraint (checked like the API checks it); raises `BadRequest` with the field and the
    reason."""
    import pydantic

    from pkgd.api.protocol import ChatCompletionRequest, CompletionRequest
    from pkgd.api.structured import request_constraint
    from pkgd.frontend.structured_outputs import check

    try:
        req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise BadRequest(
            f"{where + ': ' if where else ''}{str(err.get('msg', 'invalid value')).removeprefix('Value error, ')}"
        ) from None
    constraint = request_constraint(req)
    if constraint is not None:
        check(constraint.params, constraint.field)
    return req, constraint


def _constrained(params: SamplingParams, constraint: Any) -> SamplingParams:
    return params if constraint is None else msgspec.structs.replace(params, structured_outputs=constraint.params)


def _completion_logprobs(c: Any) -> dict[str, Any] | None:
    """Legacy completions ``logprobs``: per token its text, logprob and the candidates (the
    sampled token and the top ``logprobs``, as vLLM reports them)."""
    if c.logprobs is None:
        return None
    tokens, token_lps, tops = [], [], []
    for tid, entry in zip(c.token_ids, c.logprobs, strict=False):
        tokens.append(entry[tid].decoded_token)
        token_lps.append(max(entry[tid].logprob, -9999.0))  # JSON has no -inf (masked tokens)
        tops.append({v.decoded_token: max(v.logprob, -9999.0) for v in entry.values()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": None}


def _token_info(lp: Any) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": max(lp.logprob, -9999.0), "bytes": list(text.encode())}


def _chat_logprobs(c: Any, top_k: int) -> dict[str, Any] | None:
    """Chat ``logprobs.content``: per token its info and the ``top_logprobs`` most likely."""
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs, strict=False):
        ranked = sorted(entry.values(), key=lambda v: v.rank if v.rank is not None else 0)[:top_k]
        content.append({**_token_info(entry[tid]), "top_logprobs": [_token_info(v) for v in ranked]})
    return {"content": content}


def _forced_calls(item: _Item, c: Any, choice: dict[str, Any]) -> None:
    """A forced tool choice's output as ``tool_calls`` (as the chat route answers it)."""
    from pkgd.api.structured import tool_calls_of

    calls = tool_calls_of(item.constraint, c.text)[: None if item.body.get("parallel_tool_calls", True) else 1]
    if calls:
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
        if item.constraint.tool_mode == "required" and c.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"


def _response_body(item: _Item, outputs: list[Any], model_name: str) -> dict[str, Any]:
    chat = item.url == "/v1/chat/completions"
    choices: list[dict[str, Any]] = []
    prompt_tokens, completion_tokens = 0, 0
    echo = bool(item.body.get("echo")) and not chat
    for ro in outputs:
        prompt_tokens += len(ro.prompt_token_ids)
        for c in ro.outputs:
            completion_tokens += len(c.token_ids)
            choice: dict[str, Any] = {
                "index": len(choices),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
                if item.constraint is not None and item.constraint.tool_mode:
                    _forced_calls(item, c, choice)
                choice["logprobs"] = _chat_logprobs(c, int(item.body.get("top_logprobs") or 0))
            else:
                choice["text"] = (ro.prompt or "") + c.text if echo else c.text
                choice["logprobs"] = _completion_logprobs(c)
                if item.body.get("prompt_logprobs") is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(ro)
            choices.append(choice)
    body: dict[str, Any] = {
        "id": ("chatcmpl-" if chat else "cmpl-") + (item.response_id or item.request_id.removeprefix("batch-")),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if chat and item.body.get("prompt_logprobs") is not None and outputs:
        body["prompt_logprobs"] = _prompt_logprobs(outputs[0])
    return body


def _prompt_logprobs(ro: Any) -> list[Any]:
    """``ro``'s prompt logprobs as the HTTP API answers them (`prompt_logprobs_json`)."""
    from pkgd.api.serving_completion import prompt_logprobs_json

    return [None if d is None else {k: v.model_dump() for k, v in d.items()} for d in prompt_logprobs_json(ro)]


def _result_line(item: _Item, body: dict[str, Any] | None) -> dict[str, Any]:
    if item.error is not None:
        response = {
            "status_code": 400,
            "request_id": item.request_id,
            "body": {"error": {"message": item.error, "type": "BadRequestError", "param": None, "code": 400}},
        }
        error = {"code": "invalid_request", "message": item.error}
    else:
        response, error = {"status_code": 200, "request_id": item.request_id, "body": body}, None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id, "response": response, "error": error}


def process_batch(llm: Any, lines: list[str], *, use_tqdm: bool = False) -> list[dict[str, Any]]:
    """Run the batch lines on ``llm``; one result object per non-blank line, in order."""
    model_name = llm.engine.model_name
    items = [_prepare(llm, model_name, i, line) for i, line in enumerate(lines, 1) if line.strip()]
    flat = [p for it in items for p in it.processed]
    done = llm.run_processed(flat, use_tqdm=use_tqdm)
    outputs = dict(zip((p.request_id for p in flat), done, strict=True))
    return [
        _result_line(
            it, None if it.error else _response_body(it, [outputs[p.request_id] for p in it.processed], model_name)
        )
        for it in items
    ]


def run_batch(args: argparse.Namespace) -> int:
    from pkgd.cli.bench import offline_llm

    with sys.stdin if args.input_file == "-" else open(args.input_file, encoding="utf-8") as f:
        lines = f.readlines()
    llm = offline_llm(args)
    results = process_batch(llm, lines, use_tqdm=not args.no_progress)
    llm.shutdown()
    out = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")
    try:
        for r in results:
            out.write(json.dumps(r, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    bad = sum(1 for r in results if r["error"])
    print(f"pkgd run-batch: {len(results) - bad} requests done, {bad} failed -> {args.output_file}", file=sys.stderr)
    return 0


class RunBatchSubcommand(CLISubcommand):
    """``pkgd run-batch``."""

    name = "run-batch"
    help = "run a JSONL file of OpenAI requests offline"

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser:
        p = subparsers.add_parser(self.name, help=self.help, description=DESCRIPTION, epilog=EXAMPLES)
        p.add_argument("-i", "--input-file", required=True, help="batch requests, JSONL ('-' = stdin)")
        p.add_argument("-o", "--output-file", required=True, help="results, JSONL ('-' = stdout)")
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="KEY=VALUE",
            help="config keys when run as 'python -m pkgd.cli.run_batch' (under 'pkgd', "
            "--model, --max-num-seqs and other config flags are composed with every layer)",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        return p

    def cmd(self, args: argparse.Namespace) -> int:
        return run_batch(args)


def cmd_init() -> list[RunBatchSubcommand]:
    return [RunBatchSubcommand()]


def main(argv: list[str] | None = None) -> int:
    """``python -m pkgd.cli.run_batch -i … -o …`` (the same as ``pkgd run-batch``)."""
    from pkgd.cli.parser import ArgumentParser

    parser = ArgumentParser(prog="pkgd")
    subparsers = parser.add_subparsers(dest="command", required=True)
    (cmd,) = cmd_init()
    cmd.subparser_init(subparsers)
    return cmd.cmd(parser.parse_command_line(["run-batch", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
