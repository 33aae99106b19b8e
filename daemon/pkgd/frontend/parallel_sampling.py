"""`ParentRequest`: one client request with ``n > 1`` completions (vLLM v1's
``parallel_sampling.py``), torch-free.

The engine runs ``n`` independent child requests sharing the prompt (the prefix cache makes
the shared prompt cheap). The parent merges their completions under the client's id:

* ``CUMULATIVE``: each output holds the latest state of every completion seen so far;
* ``DELTA``: each output holds the one completion that advanced (its ``index`` says which);
* ``FINAL_ONLY``: one output with all ``n`` completions once every child finished.

``finished`` is True on the output that completes the last child.
"""

from __future__ import annotations

from typing import Any, Protocol

from pkgd.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from pkgd.sampling_params import RequestOutputKind


class ChildState(Protocol):
    """What the parent reads of a child's state (`output_processor.RequestState`)."""

    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    num_cached_tokens: int
    metrics: dict[str, Any]


class ParentRequest:
    """Aggregates ``n`` child completions of request ``request_id``."""

    def __init__(self, request_id: str, n: int, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.n = n
        self.output_kind = output_kind
        self.completions: list[CompletionOutput | None] = [None] * n
        self.num_finished = 0
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n

    def add_completion(self, child: ChildState, completion: CompletionOutput) -> RequestOutput | None:
        """Record a child's completion; returns the client-facing output, if any is due."""
        if completion.finished():
            self.num_finished += 1
        self.num_cached_tokens = max(self.num_cached_tokens, child.num_cached_tokens)
        if self.output_kind == RequestOutputKind.DELTA:
            outputs = [completion]
        else:
            self.completions[completion.index] = completion
            if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
                return None
            outputs = [c for c in self.completions if c is not None]
        return RequestOutput(
            request_id=self.request_id,
            prompt=child.prompt,
            prompt_token_ids=child.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=child.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dict(child.metrics),
        )
