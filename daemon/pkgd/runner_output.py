"""`ModelRunnerOutput`: what one `ModelRunner.execute_model` step returns to the scheduler."""

from __future__ import annotations

import dataclasses

from pkgd.logprobs import TokenLogprobs


@dataclasses.dataclass
class ModelRunnerOutput:
    """Per scheduled request, in ``req_ids`` order.

    ``sampled_token_ids[i]`` is ``[token]`` when request i finished its scheduled prefill or
    decode this step, ``[]`` while a chunked prefill is still partial; a speculating request
    gets its accepted proposed tokens followed by one sampled token. ``logprobs[i]`` is set
    when the request asked for ``logprobs`` (one entry per sampled token).
    ``prompt_logprobs[req_id]`` holds the prompt positions computed this step.
    ``pooler_output[req_id]`` is a pooling request's pooled vector (little-endian float32
    bytes), set on the step that computed the last of its prompt; such a request has no
    sampled tokens.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = dataclasses.field(default_factory=dict)
    pooler_output: dict[str, bytes] = dataclasses.field(default_factory=dict)
