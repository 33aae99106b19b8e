"""`RequestOutput` / `CompletionOutput`: what `LLM.generate` returns and `AsyncLLM` yields;
`PoolingRequestOutput` / `EmbeddingRequestOutput`: what `LLM.encode` / `LLM.embed` return.

Same shape and names as vLLM's ``vllm.outputs`` so user code ports unchanged. Torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import Any


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
    # OpenAI Predicted Outputs: proposed prediction tokens accepted / rejected so far
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

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


@dataclasses.dataclass
class PoolingOutput:
    """The pooled vector of a pooling request: ``data`` is float32 ``[D]`` (a
    ``torch.Tensor`` from the offline `LLM`, a ``numpy.ndarray`` in the torch-free API
    server), ``D`` the hidden size or the request's ``dimensions``."""

    data: Any


@dataclasses.dataclass
class PoolingRequestOutput:
    """What `LLM.encode` returns (vLLM's ``PoolingRequestOutput``)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclasses.dataclass
class EmbeddingOutput:
    """One embedding as a list of floats (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        data = pooling_output.data
        if getattr(data, "ndim", 1) != 1:
            raise ValueError("the pooled data is not a 1-D embedding vector")
        return EmbeddingOutput(data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns (vLLM's ``EmbeddingRequestOutput``): ``outputs.embedding``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            request_id=request_output.request_id,
            outputs=EmbeddingOutput.from_base(request_output.outputs),
            prompt_token_ids=request_output.prompt_token_ids,
            finished=request_output.finished,
            num_cached_tokens=request_output.num_cached_tokens,
        )


@dataclasses.dataclass
class ClassificationOutput:
    """A sequence classifier's label probabilities (vLLM's ``ClassificationOutput``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    """What `LLM.classify` returns (vLLM's ``ClassificationRequestOutput``): ``outputs.probs``."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclasses.dataclass
class ScoringOutput:
    """The relevance score of one text pair (vLLM's ``ScoringOutput``)."""

    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns, one per pair (vLLM's ``ScoringRequestOutput``): ``outputs.score``.
    ``prompt_token_ids``: the pair's prompt (a cross-encoder), or the second text's (a bi-encoder)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
