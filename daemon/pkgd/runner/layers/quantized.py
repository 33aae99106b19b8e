"""Layers on GGUF quantized weights kept quantized (``model.quantization: auto`` on a GGUF file).

Drop-ins for the float layers of `pkgd.runner.layers.linear` / `.embedding` with the same
loading interface (``load_part`` / ``load`` of the full tensor, here a GGUF tensor's rows of
blocks: uint8 ``[out, row_bytes]``, rows already permuted as the model wants them), holding a
`pkgd_kernels.quant_layout.QuantWeight` instead of a float matrix:

* `QuantizedLinear`: a fused column projection (Q/K/V, gate/up: one part per GGUF tensor, each
  of its own type) or a row projection (o_proj, down_proj); ``forward`` is
  ``pkgd_kernels.quant_linear`` (int8 activations; its C form for every batch size: a decode
  step reads ~4.5-6.5 bits a weight, a prefill step runs int8 dot products);
* `QuantizedLMHead`: the LM head, whose table also serves a tied embedding's lookups
  (``pkgd_kernels.quant_gather``); `QuantizedEmbedding`: an untied embedding;
* `QuantizedMoE`: an MoE MLP (`pkgd.runner.layers.moe`) whose experts are each a gate/up and a
  down `QuantizedLinear` (the router stays float32): tokens sorted by expert, each expert that
  any token chose run once on its contiguous run of tokens.

They are tensor-parallel size 1 only (the runner keeps the float path for TP). The packed bytes
are a uint8 parameter (``qdata``), so the runner's huge-page pass covers them;
``num_weights`` counts the matrix's elements. A weight packed earlier (the loader's
packed-weights cache, `pkgd.runner.loader.packed_cache`) is set with ``preload``; the loading
then delivers each part as its rows only (uint8 ``[rows, 0]``), which are checked and dropped.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

import pkgd_kernels as pk
from pkgd.runner.layers.moe import MoELayer
from pkgd_kernels.quant_layout import QuantWeight, pack_gguf_rows, packed_segments


class _Packed(nn.Module):
    """Holds one `QuantWeight` built from the parts `_take` receives (packed once all are in)."""

    def __init__(self, in_features: int, part_sizes: list[int], part_qtypes: list[int], kernels) -> None:
        super().__init__()
        if len(part_sizes) != len(part_qtypes):
            raise ValueError("one GGUF type per part")
        self.kernels = kernels
        self.in_features, self.out_features = in_features, sum(part_sizes)
        self.part_sizes, self.part_qtypes = list(part_sizes), list(part_qtypes)
        self.qweight: QuantWeight | None = None
        self.qdata: nn.Parameter | None = None
        self._parts: dict[int, torch.Tensor] = {}
        self._preloaded = False  # `preload` set the weight; the parts still to arrive are rows only

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features

    @property
    def packed(self) -> QuantWeight:
        """The packed weight. Raises ValueError before every part is loaded."""
        if self.qweight is None:
            raise ValueError(
                f"quantized weight incomplete: parts {sorted(self._parts)} of {len(self.part_sizes)} loaded"
            )
        return self.qweight

    def preload(self, weight: QuantWeight) -> None:
        """Hold ``weight``, packed earlier from this layer's parts (its ``data`` is used as is,
        e.g. a view of the cache file's data); the loading then passes each part's rows only.

        Raises:
            ValueError: ``weight`` is not of this layer's shape, types and segments.
            RuntimeError: a weight is held already.
        """
        if self.qweight is not None or self._parts:
            raise RuntimeError("weights are already (being) loaded")
        expected = packed_segments(list(zip(self.part_qtypes, self.part_sizes)), self.in_features)
        if (weight.n, weight.k, weight.segments) != (self.out_features, self.in_features, expected) or (
            weight.data.dtype != torch.uint8 or weight.nbytes != sum(s.nbytes for s in expected)
        ):
            raise ValueError(
                f"packed weight [{weight.n}, {weight.k}] {weight.qtype_names()} ({weight.nbytes} bytes) does not "
                f"fit a layer [{self.out_features}, {self.in_features}] of parts {self.part_sizes} "
                f"({sum(s.nbytes for s in expected)} bytes)"
            )
        self.qweight, self._preloaded = weight, True
        self.qdata = nn.Parameter(weight.data, requires_grad=False)

    def clear(self) -> None:
        """Drop the weight and any parts received: the state before loading."""
        self.qweight, self.qdata, self._preloaded = None, None, False
        self._parts.clear()

    def _take(self, index: int, raw: torch.Tensor, what: str) -> None:
        if self.qweight is not None and not self._preloaded:
            raise RuntimeError(f"{what}: weights are already packed")
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[0] != self.part_sizes[index]:
            raise ValueError(
                f"{what}: expected the GGUF rows uint8 [{self.part_sizes[index]}, row bytes], got "
                f"{raw.dtype} {tuple(raw.shape)}"
            )
        if self._preloaded:  # the bytes are in `qweight` already: the part only confirms its rows
            self._parts[index] = raw
            if len(self._parts) == len(self.part_sizes):
                self._preloaded = False
                self._parts.clear()
            return
        self._parts[index] = raw
        if len(self._parts) == len(self.part_sizes):
            parts = [(self.part_qtypes[i], self._parts[i]) for i in range(len(self.part_sizes))]
            self.qweight = pack_gguf_rows(parts, self.in_features)
            self.qdata = nn.Parameter(self.qweight.data, requires_grad=False)
            self._parts.clear()

    def process_weights_after_loading(self) -> None:
        _ = self.packed  # raises ValueError when a part is missing
        if self._preloaded:
            raise ValueError(
                f"quantized weight preloaded, but only parts {sorted(self._parts)} of {len(self.part_sizes)} "
                "in the checkpoint"
            )

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = pk.quant_linear(x if x.dtype == torch.float32 else x.float(), self.packed, bias, kernels=self.kernels)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


class QuantizedLinear(_Packed):
    """``y = x @ [W_0 | W_1 | ...]^T (+ b)`` on quantized parts. ``part_sizes``: output rows of
    each part; ``part_qtypes``: their GGML types. Input ``[T, in]``, output ``[T, out]`` in the
    input's dtype (computed in float32)."""

    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        part_qtypes: list[int],
        *,
        bias: bool,
        dtype: torch.dtype = torch.float32,
        kernels=None,
    ) -> None:
        super().__init__(in_features, part_sizes, part_qtypes, kernels)
        self.bias = (
            nn.Parameter(torch.zeros(self.out_features, dtype=torch.float32), requires_grad=False) if bias else None
        )
        self.gemv_weight = None  # no float packing (the fused decode step reads `qweight`)
        self.lora: Any = None  # `pkgd.runner.lora.layers.LinearSlots`: adapters over the quantized output

    @classmethod
    def replacing(cls, layer: Any, part_qtypes: list[int]) -> QuantizedLinear:
        """A quantized layer of ``layer``'s shape (a `MergedColumnParallelLinear` or
        `RowParallelLinear`, TP size 1)."""
        if getattr(layer, "tp", None) is not None and layer.tp.size != 1:
            raise ValueError("quantized weights are for tensor-parallel size 1")
        sizes = getattr(layer, "part_sizes", [layer.out_features])
        return cls(layer.in_features, sizes, part_qtypes, bias=layer.bias is not None, kernels=layer.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)

    def load_part(self, index: int, tensor: torch.Tensor, kind: str = "weight") -> None:
        """Part ``index``'s GGUF rows (``kind="weight"``), or its float ``bias [out_i]``."""
        if kind == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a layer built without one")
            start = sum(self.part_sizes[:index])
            if tensor.shape != (self.part_sizes[index],):
                raise ValueError(
                    f"part {index} bias: checkpoint shape {tuple(tensor.shape)} does not match "
                    f"({self.part_sizes[index]},)"
                )
            self.bias[start : start + self.part_sizes[index]].copy_(tensor)
            return
        self._take(index, tensor, f"part {index} weight")

    def load(self, tensor: torch.Tensor, kind: str = "weight") -> None:
        """A single-part layer's GGUF rows or bias (`RowParallelLinear`'s interface)."""
        self.load_part(0, tensor, kind)


class QuantizedLMHead(_Packed):
    """``h [N, H] -> logits [N, V]`` float32 on a quantized ``[V, H]`` table; `embedding_rows`
    serves a tied embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, qtype: int, *, tied: bool = False, kernels=None) -> None:
        super().__init__(hidden_size, [vocab_size], [qtype], kernels)
        self.tied = tied
        self.local = vocab_size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self._linear(h, None).float()

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``) of the table, float32 ``[T, H]``."""
        return pk.quant_gather(self.packed, ids, kernels=self.kernels)

    def load(self, tensor: torch.Tensor) -> None:
        """The table's GGUF rows (``token_embd`` when tied, else ``output``)."""
        self._take(0, tensor, "lm_head")


class QuantizedEmbedding(_Packed):
    """Token ids ``[T]`` (int64) -> float32 ``[T, H]`` rows of a quantized ``[V, H]`` table."""

    def __init__(self, vocab_size: int, hidden_size: int, qtype: int, *, kernels=None) -> None:
        super().__init__(hidden_size, [vocab_size], [qtype], kernels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return pk.quant_gather(self.packed, ids, kernels=self.kernels)

    def load(self, tensor: torch.Tensor) -> None:
        self._take(0, tensor, "embedding")


class QuantizedMoE(MoELayer):
    """An MoE MLP on quantized experts (`MoELayer`'s interface; tensor-parallel size 1).

    Args:
        moe: the float layer it replaces (a `pkgd.runner.layers.moe.FusedMoE`: sizes, routing).
        qtypes: the GGML type of each expert part ("gate", "up", "down"), one per stacked tensor.

    ``forward(h [T, H] float32) -> [T, H] float32``: `MoELayer.route` on the float32 router, the
    ``T * k`` (token, slot) pairs stable-sorted by expert, then for each expert with pairs one
    ``down(silu(gate(x)) * up(x))`` on its run (``pkgd_kernels.quant_linear``), weighted and
    scatter-added back into token order. A loop over the experts hit, never over tokens.
    """

    def __init__(self, moe: Any, qtypes: dict[str, int], kernels=None) -> None:
        if moe.tp.size != 1:
            raise ValueError("quantized weights are for tensor-parallel size 1")
        hidden, inter = moe.w13.shape[2], moe.intermediate_size
        super().__init__(moe.num_experts, moe.top_k, hidden, renormalize=moe.renormalize, dtype=torch.float32)
        self.kernels = kernels
        self.num_local_experts, self.first_expert, self.intermediate_size = moe.num_experts, 0, inter
        self.gate_up = nn.ModuleList(
            QuantizedLinear(hidden, [inter, inter], [qtypes["gate"], qtypes["up"]], bias=False, kernels=kernels)
            for _ in range(moe.num_experts)
        )
        self.down = nn.ModuleList(
            QuantizedLinear(inter, [hidden], [qtypes["down"]], bias=False, kernels=kernels)
            for _ in range(moe.num_experts)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(h)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        pairs = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = pairs[start : start + n]
                tok = rows // k
                act = pk.silu_and_mul(self.gate_up[e](h[tok]), kernels=self.kernels)
                y = self.down[e](act)
                out.index_add_(0, tok, y.float() * weights.reshape(-1)[rows, None])
            start += n
        return out.to(h.dtype)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """One expert's GGUF rows of blocks: ``part`` "gate" / "up" (``[I, row bytes]``) or "down"."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside [0, {self.num_experts})")
        if part == "down":
            cast(QuantizedLinear, self.down[expert]).load(tensor)
        elif part in ("gate", "up"):
            cast(QuantizedLinear, self.gate_up[expert]).load_part(0 if part == "gate" else 1, tensor)
        else:
            raise ValueError(f"unknown expert part {part!r}")


def packed_layers(model: nn.Module) -> dict[str, _Packed]:
    """The layers of ``model`` that hold a `QuantWeight`, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, _Packed)}
