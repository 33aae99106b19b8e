"""``pkgd launch render``: the prompt a chat request becomes, without an engine.

vLLM's ``vllm launch`` holds its components as sub-subcommands; its ``render`` component is
the preprocessing half of the server (chat template, tokenization) with no model weights.
pkgd's renders one request and exits: it reads an OpenAI chat-completions body (a JSON file,
or ``-`` for stdin; or ``--message ROLE:TEXT``), validates it as ``/v1/chat/completions``
does, applies the served model's chat template (``model.chat_template`` or the tokenizer's)
with the request's ``tools``, ``add_generation_prompt``, ``continue_final_message`` and
``chat_template_kwargs``, and prints the prompt text, or with ``--json`` the text, its token
ids and their count. Only the tokenizer is loaded (a GGUF model is converted once, as for
serving); the configuration is composed from every layer, so ``pkgd launch render MODEL
--chat-template FILE`` shows what ``pkgd serve`` would send to the engine.

    pkgd launch render --message "user:What is the capital of France?"
    echo '{"messages": [{"role": "user", "content": "Hi"}], "tools": [...]}' | pkgd launch render --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from pkgd.cli.base import CLISubcommand


def render(config: Any, body: dict[str, Any], *, tokenizer: Any = None) -> dict[str, Any]:
    """The prompt of chat request ``body`` under ``config``'s model: ``{"prompt": text,
    "prompt_token_ids": [...], "num_tokens": n}``.

    Raises:
        ValueError: the body is not a valid chat-completions request, or the template fails
            (the message is the one the server would answer with a 400).
    """
    from pydantic import ValidationError

    from pkgd.api.protocol import ChatCompletionRequest
    from pkgd.frontend.async_llm import load_frontend_tokenizer
    from pkgd.frontend.input_processor import InputProcessor

    body = {"model": None, **body}
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"not a chat completions request: {where}: {first['msg']}") from None
    tok = tokenizer if tokenizer is not None else load_frontend_tokenizer(config)
    processor = InputProcessor(tok, max_model_len=config.model.max_model_len or 1 << 30)
    messages = [m.template_dict() for m in request.messages]
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    text = processor.render_chat(
        messages,
        tools=tools,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    ids = processor.tokenize(text, add_special_tokens=False)
    return {"prompt": text, "prompt_token_ids": ids, "num_tokens": len(ids)}


def _body(args: argparse.Namespace) -> dict[str, Any]:
    if args.message:
        messages = []
        for item in args.message:
            role, sep, content = item.partition(":")
            if not sep:
                raise ValueError(f"--message {item!r}: expected ROLE:TEXT (e.g. user:Hello)")
            messages.append({"role": role, "content": content})
        return {"messages": messages}
    try:
        text = sys.stdin.read() if args.request == "-" else Path(args.request).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the request {args.request!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the request {args.request!r} is not UTF-8 text") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the request is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("the request must be a JSON object (a chat completions body)")
    return body


RENDER_DESCRIPTION = """\
Print the prompt a chat request becomes, without an engine (vllm launch render): reads an
OpenAI chat-completions body (a JSON file, - for stdin, or --message ROLE:TEXT), validates it
as /v1/chat/completions does, applies the served model's chat template with the request's
tools, add_generation_prompt, continue_final_message and chat_template_kwargs, and prints the
prompt text (--json: the text, its token ids and their count). Only the tokenizer is loaded;
the configuration is composed from every layer, as for pkgd serve."""

RENDER_EXAMPLES = """\
examples:
  pkgd launch render --message "user:What is the capital of France?"
  echo '{"messages": [{"role": "user", "content": "Hi"}]}' | pkgd launch render --json"""


class LaunchSubcommand(CLISubcommand):
    """``pkgd launch COMPONENT``; one component so far: ``render``."""

    name = "launch"
    help = "launch render: print the prompt a chat request becomes, without an engine"

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(
            self.name, help=self.help, description="Launch one component of pkgd on its own."
        )
        components = parser.add_subparsers(dest="launch_component", required=True, metavar="{render}")
        r = components.add_parser(
            "render",
            help="print the prompt a chat request becomes (chat template, tokens)",
            description=RENDER_DESCRIPTION,
            epilog=RENDER_EXAMPLES,
        )
        r.add_argument(
            "model_tag",
            nargs="?",
            metavar="MODEL",
            help="model whose tokenizer and template to use (sets model.source)",
        )
        r.add_argument(
            "--request", default="-", metavar="FILE", help="chat completions request body as JSON; - = stdin"
        )
        r.add_argument(
            "--message", action="append", metavar="ROLE:TEXT", help="a message instead of --request (repeatable)"
        )
        r.add_argument("--json", action="store_true", help="print the prompt, its token ids and their count as JSON")
        return parser

    def validate(self, args: argparse.Namespace) -> None:
        from pkgd.config.compose import compose

        request = args.compose_request
        if args.model_tag:
            request = dataclasses.replace(request, flags=(*request.flags, "--model", args.model_tag))
        args.composed = compose(request)

    def cmd(self, args: argparse.Namespace) -> int:
        from pkgd.frontend.tokenizer import TokenizerError
        from pkgd.model_files.errors import ModelSourceError

        try:
            out = render(args.composed.config, _body(args))
        except (ValueError, ModelSourceError, TokenizerError) as exc:
            print(f"pkgd launch render: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(out, ensure_ascii=False))
        else:
            sys.stdout.write(out["prompt"] if out["prompt"].endswith("\n") else out["prompt"] + "\n")
        return 0


def cmd_init() -> list[CLISubcommand]:
    return [LaunchSubcommand()]
