"""Pooling: a pooling request's hidden states -> one vector (vLLM's embedding ``Pooler``).

A pooling request is a prompt the scheduler prefills like any other (chunked, batched with
other requests); the runner never samples for it. The hidden states it pools are the model's
output after the final norm (what transformers' ``AutoModel`` returns as
``last_hidden_state``), one row per prompt token:

* ``last``: the last prompt token's row (decoder embedding models, e.g. Qwen3-Embedding);
* ``mean``: the average of every prompt row, accumulated in float32 over the chunks of a
  chunked prefill;
* ``cls``: the first prompt token's row.

A sequence classifier (`pkgd.runner.models.classifier`) then applies its score head: the
output is its float32 logits. Otherwise, Matryoshka truncation to ``dimensions`` (Kusupati et
al., 2022) and, when asked, L2 normalisation (in that order, as vLLM). The vector leaves the
runner as little-endian float32 bytes: it crosses the wire as is, and the API server base64-encodes those same bytes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pkgd.pooling_params import PoolingParams

POOLING_TYPES = ("last", "mean", "cls")

# sentence-transformers' 1_Pooling/config.json keys -> pkgd's pooling types.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def resolve_pooling_type(configured: str, model_dir: Path) -> str:
    """``model.pooler.pooling_type`` with ``auto`` resolved: the mode the model directory's
    sentence-transformers ``1_Pooling/config.json`` switches on, else ``last``.

    Raises:
        ValueError: the sentence-transformers config asks for a pooling pkgd lacks (e.g.
            max pooling), or cannot be read; the message names the file.
    """
    if configured != "auto":
        return configured
    path = Path(model_dir) / "1_Pooling" / "config.json"
    if not path.is_file():
        return "last"
    try:
        st = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the sentence-transformers pooling config ({e})") from e
    chosen = [kind for key, kind in _ST_MODES.items() if st.get(key)]
    others = [k for k, v in st.items() if k.startswith("pooling_mode") and v and k not in _ST_MODES]
    if len(chosen) != 1 or others:
        raise ValueError(
            f"{path}: pooling {sorted(k for k, v in st.items() if k.startswith('pooling_mode') and v)} is not "
            f"supported; set model.pooler.pooling_type to one of {', '.join(POOLING_TYPES)}"
        )
    return chosen[0]


def matryoshka_of(configured: bool | None, raw_config: dict[str, Any]) -> tuple[bool, list[int] | None]:
    """``(accepts dimensions, the only dimensions accepted or None)`` from
    ``model.pooler.matryoshka`` and the model's ``config.json`` (``is_matryoshka``,
    ``matryoshka_dimensions``: the fields vLLM reads)."""
    dims = raw_config.get("matryoshka_dimensions")
    dims = [int(d) for d in dims] if isinstance(dims, list) and dims else None
    if configured is not None:
        return configured, dims
    return bool(raw_config.get("is_matryoshka")) or dims is not None, dims


@dataclasses.dataclass
class PoolingSpan:
    """Rows ``[row_start, row_end)`` of a step's hidden states belong to pooling request
    ``state``, prompt positions ``[pos_start, pos_start + rows)``; ``finishes`` when they
    reach the end of its prompt."""

    state: Any  # pkgd.runner.input_batch.RequestState
    row_start: int
    row_end: int
    pos_start: int
    finishes: bool


class Pooler:
    """Pools the spans of one step (module docstring).

    Args:
        pooling_type: one of `POOLING_TYPES`.
        normalize: the default when a request's ``normalize`` is None.
    """

    def __init__(self, pooling_type: str, *, normalize: bool) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type {pooling_type!r} is not one of {POOLING_TYPES}")
        self.pooling_type = pooling_type
        self.normalize = normalize

    def __call__(
        self,
        hidden: torch.Tensor,
        spans: list[PoolingSpan],
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, bytes]:
        """``hidden [T, H]`` (any float dtype) -> ``{req_id: float32 bytes}`` for the spans
        that finish this step; partial spans (chunked prefill) only accumulate. ``head``: a
        sequence classifier's (``[H] -> [num_labels]`` float32 logits), applied to the pooled
        vector instead of truncation and normalisation."""
        out: dict[str, bytes] = {}
        for span in spans:
            vec = self._accumulate(hidden, span)
            if span.finishes:
                # a finishing span has its vector; pooling spans are only made for pooling requests
                assert vec is not None and span.state.pooling_params is not None
                if head is not None:
                    out[span.state.req_id] = _le_bytes(head(vec))
                else:
                    out[span.state.req_id] = self.finish(vec, span.state.pooling_params)
        return out

    def _accumulate(self, hidden: torch.Tensor, span: PoolingSpan) -> torch.Tensor | None:
        st = span.state
        if self.pooling_type == "last":
            return hidden[span.row_end - 1].float() if span.finishes else None
        if self.pooling_type == "cls":
            if span.pos_start == 0:
                st.pool_acc = hidden[span.row_start].float().clone()
            return st.pool_acc
        part = hidden[span.row_start : span.row_end].float().sum(dim=0)
        st.pool_acc = part if st.pool_acc is None else st.pool_acc + part
        if not span.finishes:
            return None
        return st.pool_acc / len(st.token_ids)

    def finish(self, vec: torch.Tensor, params: PoolingParams) -> bytes:
        """Truncate to ``params.dimensions``, normalise if asked: float32 ``[D]`` as bytes."""
        if params.dimensions is not None:
            vec = vec[: params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            vec = F.normalize(vec, p=2.0, dim=0)
        return _le_bytes(vec)


def _le_bytes(vec: torch.Tensor) -> bytes:
    return vec.to(device="cpu", dtype=torch.float32).numpy().astype("<f4", copy=False).tobytes()
