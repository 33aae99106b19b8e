"""`RequestOutput` / `CompletionOutput`: what `LLM.generate` returns and `AsyncLLM` yields.

Same shape and names as vLLM's ``vllm.outputs`` so user code ports unchanged. Torch-free.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """One candidate token's log-probability (natural log) and its rank (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (sampled token first, then the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position; the first is None (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is ``"stop"`` (EOS, stop token or stop string), ``"length"``
    (max_tokens or max_model_len), ``"abort"`` or None while running; ``stop_reason`` is the
    stop string or stop token id that ended it, None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far.

    With ``output_kind=DELTA`` the completions carry only the new text and tokens.
    ``num_cached_tokens`` counts prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] | None = None
