"""A pooling request's engine output -> `PoolingRequestOutput` (frontend side, torch-free),
and what scoring and classification make of those outputs (`activate`, `cosine`).

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


def activate(logits: np.ndarray) -> np.ndarray:
    """vLLM's classifier activation on float32 ``logits [L]``: sigmoid for one output, softmax
    (max-shifted, in float64) for more; float32 ``[L]``."""
    x = np.asarray(logits, dtype=np.float64)
    if x.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def cosine(u: np.ndarray, v: np.ndarray) -> float:
    """Cosine similarity of two vectors ``[D]`` (float64 arithmetic; 0 for a zero vector)."""
    a, b = np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64)
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / denom) if denom > 0 else 0.0


def pair_index(num_first: int, num_second: int) -> list[int]:
    """For each text of the second side of a score request, the index of the first-side text
    it pairs with: all 0 when the first side is one text, else pairwise.

    Raises:
        ValueError: an empty side, or a first side neither one text nor as long as the second.
    """
    if num_second == 0:
        raise ValueError("the second side must not be empty")
    if num_first not in (1, num_second):
        raise ValueError(
            f"the first side has {num_first} texts and the second {num_second}: give one first text, or as many "
            "as the second (scored pairwise)"
        )
    return [0] * num_second if num_first == 1 else list(range(num_second))
