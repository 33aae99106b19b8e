"""A pooling request's engine output -> `PoolingRequestOutput` (frontend side, torch-free).

The engine sends the pooled vector as little-endian float32 bytes
(`pkgd.ipc.messages.EngineCoreOutput.pooling_output`); here it becomes a read-only
``numpy.ndarray`` over those same bytes, so the API server's base64 encoding is the bytes
themselves and its float encoding one ``tolist``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pkgd.outputs import PoolingOutput, PoolingRequestOutput

if TYPE_CHECKING:
    from pkgd.frontend.input_processor import ProcessedRequest
    from pkgd.ipc.messages import EngineCoreOutput


def pooling_request_output(processed: ProcessedRequest, out: EngineCoreOutput) -> PoolingRequestOutput:
    """The client-facing output of pooling request ``processed`` from its one engine output.

    Raises:
        ValueError: the output carries no vector, or bytes that are not whole float32s.
    """
    raw = out.pooling_output
    if raw is None or len(raw) % 4:
        raise ValueError(f"request {processed.request_id!r}: the engine sent no float32 vector")
    return PoolingRequestOutput(
        request_id=processed.request_id,
        outputs=PoolingOutput(np.frombuffer(raw, dtype="<f4")),
        prompt_token_ids=processed.prompt_token_ids,
        finished=True,
        num_cached_tokens=out.num_cached_tokens,
    )
