"""`SamplingParams`: how one request is sampled and when it stops (vLLM's names and meanings).

A msgspec struct so it crosses the IPC boundary as msgpack without conversion. Torch-free:
API servers build it from the OpenAI request. `verify()` is the single validity check; the API
maps its `ValueError` to a 400.
"""

from __future__ import annotations

import enum

import msgspec


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` carries (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # one output when the request finishes


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
        output_kind: cumulative, delta (streaming) or final-only outputs.
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < 1e-5 or self.top_k == 1

    def verify(self, *, max_logprobs: int = 20, vocab_size: int | None = None) -> None:
        """Check ranges; raises `ValueError` naming the field, the value and the range.

        With ``vocab_size``, token ids (``stop_token_ids``, ``logit_bias`` keys) must be
        below it and ``top_k`` at most it (the input processor turns a larger ``top_k``, which
        keeps every token, into 0 before this check).
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
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias[{tok}] must be in [-100, 100], got {bias}")
        if vocab_size is not None:
            self._verify_token_ids(vocab_size)

    def _verify_token_ids(self, vocab_size: int) -> None:
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab_size} (or 0 for off), got {self.top_k}")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or ()))):
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
