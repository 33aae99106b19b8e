"""``vllm_engine.proto`` messages ↔ pkgd's request and output types, for `pkgd.api.grpc_servicer`.

Pure functions (no I/O, no event loop), so each mapping is tested on its own. The proto is
`smg-grpc-proto`'s ``vllm.grpc.engine`` package, the wire protocol of vLLM's ``--grpc``
frontend and of the routers in front of it (the Shepherd Model Gateway): the router
tokenizes, sends token ids, and detokenizes what comes back, so the token ids, finish
reasons and logprobs here are the whole answer.

proto3 scalars have no "unset": a ``top_p``, ``top_k`` or ``repetition_penalty`` of 0 (a
value no client means: it would keep no token, or scale every logit by zero) is read as
unset, as vLLM's servicer reads it; ``temperature``, ``max_tokens``, ``logprobs``,
``prompt_logprobs``, ``seed`` and ``truncate_prompt_tokens`` are proto3 ``optional`` and
unset means unset. Unset sampling fields come from ``model.generation``, then
``model.generation_config``'s file, then vLLM's defaults (the HTTP API's precedence).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from pkgd.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pkgd.config.sections import FrontendLimits, GenerationDefaults
    from pkgd.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs


class RequestFieldError(ValueError):
    """A request field pkgd cannot honour; the message starts with the field's proto name.
    The servicer answers INVALID_ARGUMENT."""


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _f32(value: float) -> float:
    """A proto ``float`` (32-bit) as the decimal the client wrote: 0.1 arrives as
    0.10000000149011612; seven significant digits give 0.1 back."""
    return float(f"{value:.7g}")


def prompt_input(request: pb.GenerateRequest | pb.EmbedRequest, max_input_chars: int) -> list[int] | str:
    """The prompt: its token ids (``tokenized``), or a ``text`` prompt for the servicer to
    tokenize with the served tokenizer (as vLLM's servicer does, special tokens added).

    Raises `RequestFieldError` for a request carrying what pkgd does not serve (multimodal
    inputs, disaggregated prefill), an empty prompt, or text over ``max_input_chars``.
    """
    if isinstance(request, pb.GenerateRequest):
        for name in ("mm_inputs", "media_refs", "kv_transfer_params"):
            if request.HasField(name):
                raise RequestFieldError(f"{name}: {_UNSUPPORTED[name]}")
        if request.extra_mm_inputs:
            raise RequestFieldError(f"extra_mm_inputs: {_UNSUPPORTED['mm_inputs']}")
        if request.HasField("kv_transfer_params_json"):
            raise RequestFieldError(f"kv_transfer_params_json: {_UNSUPPORTED['kv_transfer_params']}")
        if request.WhichOneof("input") == "text":
            if not request.text:
                raise RequestFieldError("text: the prompt is empty")
            if len(request.text) > max_input_chars:
                raise RequestFieldError(
                    f"text: {len(request.text)} characters, more than frontend.limits.max_input_chars "
                    f"({max_input_chars})"
                )
            return request.text
    if not request.HasField("tokenized") or not request.tokenized.input_ids:
        raise RequestFieldError("tokenized.input_ids: the prompt is empty")
    return list(request.tokenized.input_ids)


def truncate(ids: list[int], params: pb.SamplingParams, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens`` applied: keep the last k ids (-1: the last
    ``max_model_len``, as vLLM). Raises `RequestFieldError` for another value below 1."""
    if not params.HasField("truncate_prompt_tokens"):
        return ids
    k = params.truncate_prompt_tokens
    if k == -1:
        k = max_model_len
    if k < 1:
        raise RequestFieldError(f"sampling_params.truncate_prompt_tokens: must be -1 or at least 1, got {k}")
    return ids[-k:]


_UNSUPPORTED = {
    "mm_inputs": "pkgd serves text-only models (no multimodal inputs)",
    "media_refs": "pkgd serves text-only models (no multimodal inputs)",
    "kv_transfer_params": "pkgd has no disaggregated prefill / KV-cache transfer",
}


def constraint(params: pb.SamplingParams) -> StructuredOutputsParams | None:
    """The ``constraint`` oneof as a `StructuredOutputsParams` (None: free output).

    Raises `RequestFieldError` for ``structural_tag`` (pkgd's engine has no structural tags)
    and for a JSON schema that is not a JSON object.
    """
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        try:
            schema = json.loads(params.json_schema)
        except ValueError as exc:
            raise RequestFieldError(f"sampling_params.json_schema: not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise RequestFieldError("sampling_params.json_schema: a JSON schema must be a JSON object")
        return StructuredOutputsParams(json=schema)
    if kind == "regex":
        return StructuredOutputsParams(regex=params.regex)
    if kind == "grammar":
        return StructuredOutputsParams(grammar=params.grammar)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True) if params.json_object else None
    if kind == "choice":
        if not params.choice.choices:
            raise RequestFieldError("sampling_params.choice: give at least one choice")
        return StructuredOutputsParams(choice=list(params.choice.choices))
    raise RequestFieldError(
        "sampling_params.structural_tag: pkgd has no structural-tag constraints; use json_schema, regex, "
        "grammar, choice or json_object"
    )


def sampling_params(
    params: pb.SamplingParams,
    *,
    stream: bool,
    limits: FrontendLimits,
    generation: GenerationDefaults,
    file_defaults: Mapping[str, Any],
) -> SamplingParams:
    """pkgd's `SamplingParams` for a Generate request (module docstring for unset fields).

    Streams ask for deltas (each chunk carries the new tokens, as vLLM's servicer sends
    them), a unary answer for the final output only. Text is detokenized only when stop
    strings need it: the router detokenizes. Raises `RequestFieldError` for a value over
    ``frontend.limits`` or that `SamplingParams.verify` refuses (constraint: `constraint`).
    """
    _check_limits(params, limits)
    gen = generation
    stop = list(params.stop)
    out = SamplingParams(
        n=params.n or 1,
        temperature=_first(
            _f32(params.temperature) if params.HasField("temperature") else None,
            gen.temperature,
            file_defaults.get("temperature"),
            1.0,
        ),
        top_p=_first(_f32(params.top_p) or None, gen.top_p, file_defaults.get("top_p"), 1.0),
        top_k=_first(params.top_k or None, gen.top_k, file_defaults.get("top_k"), 0),
        min_p=_f32(params.min_p),
        presence_penalty=_f32(params.presence_penalty),
        frequency_penalty=_f32(params.frequency_penalty),
        repetition_penalty=_first(
            _f32(params.repetition_penalty) or None,
            gen.repetition_penalty,
            file_defaults.get("repetition_penalty"),
            1.0,
        ),
        seed=params.seed if params.HasField("seed") else None,
        stop=stop,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        max_tokens=_first(
            params.max_tokens if params.HasField("max_tokens") else None,
            gen.max_tokens,
            file_defaults.get("max_tokens"),
            None,
        ),
        min_tokens=params.min_tokens,
        logprobs=_logprobs(params, "logprobs", limits.max_logprobs),
        prompt_logprobs=_logprobs(params, "prompt_logprobs", limits.max_logprobs),
        logit_bias={k: _f32(v) for k, v in params.logit_bias.items()} or None,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        detokenize=bool(stop),
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=constraint(params),
    )
    try:
        out.verify(max_logprobs=limits.max_logprobs)
    except ValueError as exc:
        raise RequestFieldError(f"sampling_params.{exc}") from None
    return out


def _logprobs(params: pb.SamplingParams, name: str, max_logprobs: int) -> int | None:
    """``logprobs`` / ``prompt_logprobs``: -1 asks for all, which is ``max_logprobs`` here
    (the config's cap on what a request may ask for)."""
    if not params.HasField(name):
        return None
    value = getattr(params, name)
    if value == -1:
        return max_logprobs
    if value > max_logprobs:
        raise RequestFieldError(
            f"sampling_params.{name}: {value}, more than frontend.limits.max_logprobs allows ({max_logprobs})"
        )
    return value


def _check_limits(params: pb.SamplingParams, limits: FrontendLimits) -> None:
    counts = (
        ("n", params.n, limits.max_n, "max_n"),
        ("stop", len(params.stop), limits.max_stop_strings, "max_stop_strings"),
        ("stop_token_ids", len(params.stop_token_ids), limits.max_stop_token_ids, "max_stop_token_ids"),
        ("logit_bias", len(params.logit_bias), limits.max_logit_bias, "max_logit_bias"),
    )
    for field, value, cap, key in counts:
        if value > cap:
            raise RequestFieldError(f"sampling_params.{field}: {value}, more than frontend.limits.{key} ({cap})")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise RequestFieldError(
            f"sampling_params.stop: a stop string of {longest} characters, more than "
            f"frontend.limits.max_stop_string_chars ({limits.max_stop_string_chars})"
        )


# ---- outputs --------------------------------------------------------------------------------


def chunk(output: RequestOutput, completion: CompletionOutput, *, first: bool) -> pb.GenerateResponse:
    """A stream chunk: the completion's new tokens (a delta), their logprobs, and on the
    completion's first chunk the prompt's logprobs."""
    return pb.GenerateResponse(
        chunk=pb.GenerateStreamChunk(
            token_ids=completion.token_ids,
            prompt_tokens=len(output.prompt_token_ids),
            completion_tokens=len(completion.token_ids),
            cached_tokens=output.num_cached_tokens,
            output_logprobs=output_logprobs(completion.token_ids, completion.logprobs),
            input_logprobs=input_logprobs(output.prompt_token_ids, output.prompt_logprobs) if first else None,
            index=completion.index,
        )
    )


def complete(
    output: RequestOutput, completion: CompletionOutput, *, finish_reason: str | None = None
) -> pb.GenerateResponse:
    """The end of one completion. Streamed, ``output_ids`` is the last delta (the router has
    the rest from the chunks); unary, all of them. ``matched_stop`` says which stop token id
    or stop string ended it (unset for EOS and length)."""
    stop: dict[str, Any] = {}
    if isinstance(completion.stop_reason, int):
        stop["matched_token_id"] = completion.stop_reason
    elif isinstance(completion.stop_reason, str):
        stop["matched_stop_str"] = completion.stop_reason
    return pb.GenerateResponse(
        complete=pb.GenerateComplete(
            output_ids=completion.token_ids,
            finish_reason=finish_reason or completion.finish_reason or "stop",
            prompt_tokens=len(output.prompt_token_ids),
            completion_tokens=len(completion.token_ids),
            cached_tokens=output.num_cached_tokens,
            output_logprobs=output_logprobs(completion.token_ids, completion.logprobs),
            input_logprobs=input_logprobs(output.prompt_token_ids, output.prompt_logprobs),
            index=completion.index,
            **stop,
        )
    )


def _top(entry: Mapping[int, Any] | None) -> pb.TopLogProbs:
    """The candidates of one position, most likely first (pkgd's dicts hold the sampled token
    first, then the top-k by rank: re-sorted by rank here, the sampled token where it ranks)."""
    top = pb.TopLogProbs()
    if entry:
        for tid, lp in sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 0):
            top.token_ids.append(tid)
            top.values.append(lp.logprob)
    return top


def output_logprobs(token_ids: list[int], logprobs: SampleLogprobs | None) -> pb.OutputLogProbs | None:
    """Per generated token: its logprob and the position's candidates (None without logprobs)."""
    if not logprobs:
        return None
    out = pb.OutputLogProbs()
    for tid, entry in zip(token_ids, logprobs, strict=False):
        lp = entry.get(tid)
        out.token_ids.append(tid)
        out.token_logprobs.append(lp.logprob if lp is not None else float("-inf"))
        out.top_logprobs.append(_top(entry))
    return out


def input_logprobs(prompt_ids: list[int], logprobs: PromptLogprobs | None) -> pb.InputLogProbs | None:
    """Per prompt token: its logprob (unset for the first, which nothing predicts) and the
    position's candidates (None without prompt logprobs)."""
    if not logprobs:
        return None
    out = pb.InputLogProbs()
    for tid, entry in zip(prompt_ids, logprobs, strict=False):
        value = pb.InputTokenLogProb()
        if entry is not None and tid in entry:
            value.value = entry[tid].logprob
        out.token_logprobs.append(value)
        out.token_ids.append(tid)
        out.top_logprobs.append(_top(entry))
    return out
