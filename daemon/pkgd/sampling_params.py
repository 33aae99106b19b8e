"""`SamplingParams`: how one request is sampled and when it stops (vLLM's names and meanings).

A msgspec struct so it crosses the IPC boundary as msgpack without conversion. Torch-free:
API servers build it from the OpenAI request. `verify()` is the single validity check; the API
maps its `ValueError` to a 400.
"""

from __future__ import annotations

import enum
import json
from typing import Any

import msgspec


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` carries (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # one output when the request finishes


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
        json: a JSON schema (dict or its JSON text) the output must validate against.
        regex: a regular expression the whole output must match (xgrammar's dialect: no
            lookaround, backreferences or group flags).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF style, ``root ::= ...``) the output must match.
        json_object: any JSON object (OpenAI's ``response_format: json_object``).

    and, for ``json``/``json_object``: ``disable_any_whitespace`` makes the output compact
    (no whitespace between tokens beyond the separators ``", "`` and ``": "``); for ``json``:
    ``json_strict`` (default) allows no object property or array item the schema does not
    list (xgrammar's strict mode, OpenAI's ``strict: true``), False applies JSON Schema's own
    rules (``additionalProperties`` allowed unless the schema says otherwise).
    The engine compiles each distinct constraint once (`key`) and masks every token that
    cannot continue a match; a request whose constraint is complete stops with ``"stop"``.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    json_strict: bool = True

    def kind(self) -> str:
        """Which constraint is set: ``json``, ``regex``, ``choice``, ``grammar`` or
        ``json_object``. Raises `ValueError` when none or more than one is."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object"
                + (f"; got {', '.join(given)}" if given else "")
            )
        return given[0]

    def key(self) -> tuple[str, str, bool, bool]:
        """The compile-cache key: (kind, the constraint as text, compact whitespace, strict).
        Property order in a schema is kept (it orders the generated object's keys)."""
        kind = self.kind()
        value: Any = getattr(self, kind)
        if kind == "json":
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(value, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, self.disable_any_whitespace, self.json_strict

    def verify(self) -> None:
        """Check the shape (the constraint itself is checked by the frontend's validator and
        compiled by the engine); raises `ValueError` naming the field."""
        kind = self.kind()
        if kind == "choice" and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if kind in ("regex", "grammar") and not getattr(self, kind):
            raise ValueError(f"structured_outputs.{kind} must not be empty")
        if kind == "json" and isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None


def build_grammar(xgr: Any, so: StructuredOutputsParams) -> Any:
    """The ``xgrammar.Grammar`` of a constraint (no tokenizer needed; about a millisecond).

    The one definition of what each constraint means, used by the frontend's validator and
    by the engine's compiler. ``xgr`` is the xgrammar module (the engine's full import, or
    the torch-free subset API servers load). Raises what xgrammar raises for a bad
    constraint (``RuntimeError`` with the reason, see `constraint_error`).
    """
    kind, text, compact, strict = so.key()
    ws = {"any_whitespace": not compact}
    if kind == "json":
        return xgr.Grammar.from_json_schema(text, strict_mode=strict, **ws)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **ws)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(
            "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice or ())
        )
    return xgr.Grammar.from_ebnf(text)


def constraint_error(exc: BaseException) -> str:
    """xgrammar's error message without its ``[time] file.cc:line:`` prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ".cc:" in text:
        _head, _, rest = text.partition(".cc:")
        rest = rest.partition(": ")[2]
        text = rest.strip() or text
    return text.splitlines()[0] if text else type(exc).__name__


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling and stopping parameters of one request.

    Attributes:
        n: completions per prompt; the frontend fans out ``n`` child requests.
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus mass in (0, 1]. top_k: keep the k most likely tokens; 0 or -1 = off.
        min_p: drop tokens with probability below ``min_p`` × the top probability.
        presence_penalty, frequency_penalty: OpenAI's additive penalties on generated tokens,
            in [-2, 2]. repetition_penalty: CTRL's multiplicative penalty (Keskar et al., 2019)
            on prompt and generated tokens, > 0, 1 = none.
        seed: per-request seed; the same seed gives the same tokens whatever the batch.
        stop: strings that end the request; excluded from the text unless
            ``include_stop_str_in_output``. Checked by the frontend's detokenizer.
        stop_token_ids: token ids that end the request (besides EOS unless ``ignore_eos``).
        max_tokens: most tokens to generate; None = until ``max_model_len``.
        min_tokens: EOS and stop tokens are suppressed until this many tokens exist.
        logprobs: number of top logprobs per generated token (the sampled one is always
            included); None = none. prompt_logprobs: the same for prompt tokens.
        logit_bias: token id -> additive bias in [-100, 100] (OpenAI's ``logit_bias``).
        allowed_token_ids: only these tokens may be sampled (every other logit -inf); None =
            all.
        bad_words: words never to generate (vLLM's); the frontend tokenizes each, alone and
            after a space, into ``bad_words_token_ids``. The sampler masks the last token of
            such a sequence when the tokens before it end the output so far (a one-token
            word is always masked).
        output_kind: cumulative, delta (streaming) or final-only outputs.
        structured_outputs: a constraint on the output (`StructuredOutputsParams`), None = free.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < 1e-5 or self.top_k == 1

    def verify(self, *, max_logprobs: int = 20, vocab_size: int | None = None) -> None:
        """Check ranges; raises `ValueError` naming the field, the value and the range.

        With ``vocab_size``, token ids (``stop_token_ids``, ``logit_bias`` keys,
        ``allowed_token_ids``, ``bad_words_token_ids``) must be below it and ``top_k`` at most
        it (the input processor turns a larger ``top_k``, which keeps every token, into 0
        before this check).
        """
        checks = [
            ("n", self.n >= 1, "at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "in [0, 2]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1, 0 (off) or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "in (0, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "at least 1"),
            ("min_tokens", self.min_tokens >= 0, "at least 0"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"at most max_tokens ({self.max_tokens})",
            ),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= max_logprobs, f"in [0, {max_logprobs}]"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= max_logprobs,
                f"in [0, {max_logprobs}]",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("allowed_token_ids", self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "non-empty"),
            ("bad_words", all(isinstance(s, str) and s.strip() for s in self.bad_words), "non-blank strings"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias[{tok}] must be in [-100, 100], got {bias}")
        if self.structured_outputs is not None:
            self.structured_outputs.verify()
        if vocab_size is not None:
            self._verify_token_ids(vocab_size)

    def _verify_token_ids(self, vocab_size: int) -> None:
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab_size} (or 0 for off), got {self.top_k}")
        named = (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("bad_words", [t for ids in self.bad_words_token_ids for t in ids]),
        )
        for name, ids in named:
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name} holds token id {bad}, out of range [0, {vocab_size})")


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """Parameters of `LLM.beam_search` (offline only, as in vLLM).

    ``length_penalty`` divides a beam's cumulative logprob by ``len ** length_penalty``
    when ranking finished beams (Wu et al., 2016, GNMT). A beam whose generated text contains
    one of ``stop`` is finished there (``finish_reason`` "stop", ``stop_reason`` the string);
    its text ends before the stop string unless ``include_stop_str_in_output``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    stop: list[str] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
