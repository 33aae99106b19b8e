"""What pkgd does with each field of vLLM's chat and completion requests: the one source of
``docs/request-fields.md`` (``python -m pkgd.api.request_fields > docs/request-fields.md``;
a test keeps it current) and of the reasons logged for ignored fields.

Every field is one of:

* ``honoured``: it changes the output as in vLLM (notes say where pkgd differs);
* ``ignored``: an OpenAI field that does not change the output; accepted, and logged once per
  API-server process as ignored (`pkgd.api.serving.log_ignored_fields`);
* ``refused``: a 400 naming the field. pkgd's request models do not declare these, so the
  unknown-field check (`pkgd.api.protocol.KnownFieldsModel`) refuses them; a few are declared
  and refused for some values only (the note says which).

The rows list vLLM's ``ChatCompletionRequest`` and ``CompletionRequest`` fields and the OpenAI
fields vLLM tolerates; a test fails when a field of pkgd's request models has no row, or a row
says a field is honoured or ignored that the models do not declare.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Literal

Status = Literal["honoured", "ignored", "refused"]
Endpoint = Literal["chat", "completion", "both"]


@dataclasses.dataclass(frozen=True)
class FieldRow:
    """One request field. ``example``: a value a refused (or ignored) field is sent with in
    the tests, which must answer 400 (or 200)."""

    name: str
    endpoint: Endpoint
    status: Status
    note: str
    example: Any = None


def _h(name: str, note: str, endpoint: Endpoint = "both") -> FieldRow:
    return FieldRow(name, endpoint, "honoured", note)


def _i(name: str, note: str, example: Any, endpoint: Endpoint = "both") -> FieldRow:
    return FieldRow(name, endpoint, "ignored", note, example)


def _r(name: str, note: str, example: Any, endpoint: Endpoint = "both") -> FieldRow:
    return FieldRow(name, endpoint, "refused", note, example)


ROWS: tuple[FieldRow, ...] = (
    # ---- OpenAI's fields, both endpoints
    _h("model", "the served name or one of model.aliases; a 404 for another"),
    _h("n", "at most frontend.limits.max_n"),
    _h("stream", ""),
    _h("stream_options", "include_usage; continuous_usage_stats (vLLM's) puts usage on every chunk"),
    _h("temperature", "unset: model.generation, then generation_config.json, then 1.0"),
    _h("top_p", ""),
    _h("stop", "strings, matched on the text before special tokens are skipped (a special token's text stops)"),
    _h("presence_penalty", ""),
    _h("frequency_penalty", ""),
    _h("logit_bias", "token id -> bias in [-100, 100]"),
    _h("seed", "per-request generator; see docs/reproducibility.md for what repeats exactly"),
    _h("max_tokens", "completions: 0 only with echo (scores the prompt)"),
    _h("echo", "completions: the prompt before the text; chat: the last assistant message before the answer"),
    _i("user", "OpenAI's end-user id; put on the request's log lines", "user-1"),
    _i("store", "OpenAI stores completions for its dashboard; pkgd keeps nothing", True),
    _i("metadata", "tags for OpenAI's stored completions", {"k": "v"}),
    _i("service_tier", "OpenAI's processing tier; pkgd has one", "auto"),
    _i("modalities", 'only ["text"]; any other value is a 400 naming the field', ["text"]),
    _h(
        "prediction",
        "Predicted Outputs: the content is the speculative proposal (docs/speculative-decoding.md); "
        "usage.completion_tokens_details counts accepted and rejected prediction tokens",
    ),
    # ---- completions only
    _h("prompt", "text, token ids, or a batch of either", "completion"),
    _h("logprobs", "top logprobs per generated token (0..frontend.limits.max_logprobs)", "completion"),
    _h("best_of", "only equal to n (a 400 otherwise)", "completion"),
    _h("add_special_tokens", "the tokenizer's BOS etc.; chat: on top of the template's (default false)"),
    _r("suffix", "insertion (fill-in-the-middle) is not served", "x", "completion"),
    _r("prompt_embeds", "prompts are text or token ids", "AAAA", "completion"),
    _r("response_format", "use structured_outputs or guided_* on completions", {"type": "json_object"}, "completion"),
    # ---- chat only
    _h("messages", "text content parts; images and audio are refused", "chat"),
    _h("max_completion_tokens", "", "chat"),
    _h("logprobs", "with top_logprobs", "chat"),
    _h("top_logprobs", "0..frontend.limits.max_logprobs", "chat"),
    _h("tools", "", "chat"),
    _h("tool_choice", "auto (needs frontend.enable_auto_tool_choice), none, required, a named function", "chat"),
    _h("parallel_tool_calls", "false: at most one call", "chat"),
    _h("response_format", "text, json_object, json_schema", "chat"),
    _h("reasoning_effort", "passed to the chat template as the reasoning_effort kwarg (as vLLM)", "chat"),
    _h("add_generation_prompt", "", "chat"),
    _h("continue_final_message", "", "chat"),
    _h("documents", "passed to the chat template (retrieval-augmented templates)", "chat"),
    _h("chat_template_kwargs", "extra template kwargs; they win over reasoning_effort", "chat"),
    _r("include_reasoning", "reasoning is always returned apart (frontend.reasoning_parser)", False, "chat"),
    _r("chat_template", "a per-request template; set model.chat_template", "{{ messages }}", "chat"),
    _r("mm_processor_kwargs", "pkgd serves text models", {"x": 1}, "chat"),
    _r("structural_tag", "use structured_outputs", "{}", "chat"),
    _r("audio", "pkgd generates text only", {"voice": "alloy", "format": "wav"}, "chat"),
    _r("web_search_options", "pkgd has no web search", {}, "chat"),
    # ---- vLLM's sampling extras, both endpoints
    _h("top_k", "0 or -1: off"),
    _h("min_p", ""),
    _h("repetition_penalty", ""),
    _h("stop_token_ids", ""),
    _h("include_stop_str_in_output", ""),
    _h("ignore_eos", ""),
    _h("min_tokens", ""),
    _h("skip_special_tokens", ""),
    _h("spaces_between_special_tokens", "accepted as vLLM; the tokenizer's decoder places the spaces"),
    _h("truncate_prompt_tokens", "keeps the last N prompt tokens (-1: max_model_len); above max_model_len a 400"),
    _h(
        "prompt_logprobs",
        "per prompt position (the first null); the request takes no prefix-cache hit; a 400 with stream",
    ),
    _h("allowed_token_ids", "every other token masked"),
    _h("bad_words", "the last token of a bad word masked when the tokens before it end the output (vLLM's rule)"),
    _h("priority", "lower first under scheduler.policy: priority (arrival order under fcfs)"),
    _h("request_id", "the response id is <prefix>-<request_id>; a 400 while one with that id is in flight"),
    _h("structured_outputs", "json, regex, choice, grammar, json_object"),
    _h("guided_json", "as structured_outputs.json"),
    _h("guided_regex", "as structured_outputs.regex"),
    _h("guided_choice", "as structured_outputs.choice"),
    _h("guided_grammar", "as structured_outputs.grammar"),
    _h("use_beam_search", "false only; beam search is offline (LLM.beam_search)"),
    _r("length_penalty", "for beam search, which is offline only", 0.5),
    _r("guided_decoding_backend", "xgrammar is the one backend", "outlines"),
    _r("guided_whitespace_pattern", "use structured_outputs.disable_any_whitespace", "[ ]?"),
    _r("logits_processors", "no user code runs in the engine", ["m.P"]),
    _r("return_tokens_as_token_ids", "tokens are returned as text", True),
    _r("return_token_ids", "not served", True),
    _r("cache_salt", "the prefix cache has no per-tenant salt", "salt"),
    _r("kv_transfer_params", "no disaggregated prefill", {}),
    _r("vllm_xargs", "no custom extensions", {"x": 1}),
)


def rows_for(endpoint: Literal["chat", "completion"]) -> dict[str, FieldRow]:
    """The rows that apply to ``endpoint``, by field name."""
    return {r.name: r for r in ROWS if r.endpoint in (endpoint, "both")}


def ignored_reason(name: str) -> str:
    """The note of ignored field ``name`` (for the log line); KeyError for another."""
    return next(r.note for r in ROWS if r.name == name and r.status == "ignored")


def markdown() -> str:
    """``docs/request-fields.md``."""
    lines = [
        "# Request fields of /v1/chat/completions and /v1/completions",
        "",
        "Every field of vLLM's `ChatCompletionRequest` and `CompletionRequest`, and the OpenAI fields",
        "vLLM tolerates, with what pkgd does with it: **honoured** (changes the output as in vLLM),",
        "**ignored** (does not change the output; accepted and logged once per API server as",
        "`request_field_ignored`), **refused** (a 400 naming the field). Any other field is a 400",
        "naming it too, so nothing a client asks for is silently dropped.",
        "",
        "Generated from `pkgd.api.request_fields`: `python -m pkgd.api.request_fields >",
        "docs/request-fields.md`; a test keeps it current and fails when a field of pkgd's request",
        "models has no row.",
        "",
        "| field | endpoint | pkgd | note |",
        "|---|---|---|---|",
    ]
    for r in sorted(ROWS, key=lambda r: (r.name, r.endpoint)):
        lines.append(f"| `{r.name}` | {r.endpoint} | {r.status} | {r.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
