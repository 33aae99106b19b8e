"""``model.quantization: auto`` on a GGUF file: keep its quantized blocks when a measurement on
this host finds them faster than the float weights the file would otherwise run as.

`measure_quantized_speedup` times the file's own decoder-layer linears (their blocks through
``pkgd_kernels.quant_linear``, and their dequantized copies in the float dtype ``model.dtype``
resolves to, through the float path's packed GEMMs and C GEMV) at the batch sizes the
scheduler builds (`pkgd.runner.loader.dtype.BATCH_SIZES` rows) and for one decode row over
enough layers to read the quantized weights from memory rather than the last-level cache, as
a decode step reads them. `decide` keeps the blocks when decode is at least
`QUANT_MIN_SPEEDUP` times faster and the batched GEMMs are not slower by more than that
factor (a server spends its steps in both: one stream's latency is the decode GEMV's, many
streams' throughput the batched GEMMs'). The LM head and MoE experts are left out of the
measurement: the first would need a float copy of the vocabulary table, the second a copy
per expert; both run the same kernels as the layers measured.

Accuracy does not enter the start-up decision: the quantized path differs from the
dequantized one only by rounding each linear's input to int8 per block, as llama.cpp's CPU
matmuls do, and ``benchmarks/perplexity.py`` / ``benchmarks/peers`` measure what that costs
(docs/kernels.md gives the figures).

The figures are kept under ``model.cache_dir``'s ``quantization-choice/`` (one JSON file per
CPU, torch version, kernel library, float dtype and layer shapes and types), so every later
start of the same file decides the same way without measuring.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pkgd.runner.loader.dtype import (
    BATCH_SIZES,
    DECODE_READ_CACHE_MULTIPLE,
    MeasurementCache,
    float_linear_call,
    last_level_cache_bytes,
    run_all,
    time_pairs,
)
from pkgd_kernels.quant_layout import QTYPE_NAMES, QuantWeight, dequantize, pack_gguf_rows, supports

QUANT_MIN_SPEEDUP = 1.1
"""The quantized decode GEMV must beat the float one by this factor, and the batched GEMMs may
be slower by no more than it: a smaller difference is within a shared host's noise."""

MEASUREMENT_VERSION = 1
"""Part of a cached measurement's key: raise it when `measure_quantized_speedup` changes."""

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's 2-D quantized linears of a GGUF file: ``(name, qtype, in_features,
    raw)`` with ``raw`` the file's uint8 rows of blocks ``[out, row_bytes]`` (a read-only view
    of the memory-mapped file, copied only when measured)."""

    index: int
    linears: list[tuple[str, int, int, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(raw.nbytes for *_, raw in self.linears)


def layer_weights(tensors: dict[str, Any], layers: int) -> list[LayerWeights]:
    """The decoder layers' linears the kernels read, from a `GGUFWeights`' ``tensors`` (HF
    names): ``model.layers.<i>.{self_attn,mlp}.<proj>.weight`` of a quantized type the
    kernels take for its row length; layers without any are left out."""
    out = []
    for i in range(layers):
        linears = []
        for name, t in tensors.items():
            parts = name.split(".")
            if len(parts) != 6 or parts[:3] != ["model", "layers", str(i)] or parts[4] not in _LINEARS:
                continue
            qt, k = int(t.tensor_type), int(t.shape[0])  # GGUF shapes run innermost first
            if qt in QTYPE_NAMES and supports(qt, k):
                linears.append((name, qt, k, np.asarray(t.data)))
        if linears:
            out.append(LayerWeights(i, linears))
    return out


def decode_layers(layer_bytes: int, layers: int, cache_bytes: int | None = None) -> int:
    """How many layers the decode measurement reads in turn: enough quantized bytes to exceed
    `DECODE_READ_CACHE_MULTIPLE` x the last-level cache, at most ``layers``, at least 1."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    return max(1, min(layers, -(-DECODE_READ_CACHE_MULTIPLE * cache // max(1, layer_bytes))))


def measure_quantized_speedup(
    layers: list[LayerWeights], float_dtype: torch.dtype, kernels: Any, *, repeat: int = 5, threads: int = 1
) -> dict[str, float]:
    """Time the quantized linears of ``layers`` against their dequantized ``float_dtype``
    copies (module docstring), on ``threads`` torch threads (restored after; one by default,
    as `pkgd.runner.loader.dtype.measure_bf16_speedup` and for its reason).

    Args:
        layers: from `layer_weights`; the first is timed at `BATCH_SIZES` rows, the first
            `decode_layers` of them for one row.
        float_dtype: what the dequantized weights would run in (float32 or bfloat16).
        kernels: the loaded `pkgd_kernels.cpu.CpuKernels` (quantized kernels and float GEMV).

    Returns:
        ``{"batched_quant_ms", "batched_float_ms", "batched_speedup", "decode_quant_ms",
        "decode_float_ms", "decode_speedup", "decode_layers"}``: milliseconds for one layer,
        speedups as float time / quantized time (above 1: the quantized form is faster).

    Raises:
        ValueError: no layers given.
    """
    if not layers:
        raise ValueError("no quantized decoder-layer linears to measure")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(layers, float_dtype, kernels, repeat)
    finally:
        torch.set_num_threads(before)


def _measure(layers: list[LayerWeights], float_dtype: torch.dtype, kernels: Any, repeat: int) -> dict[str, float]:
    import pkgd_kernels as pk

    g = torch.Generator().manual_seed(0)
    alive: list[torch.Tensor] = []
    count = decode_layers(layers[0].nbytes, len(layers))
    forms: list[list[tuple[QuantWeight, torch.Tensor]]] = []
    for layer in layers[:count]:
        forms.append([])
        for _, qt, k, raw in layer.linears:
            q = pack_gguf_rows([(qt, torch.from_numpy(np.array(raw, copy=True)))], k)
            forms[-1].append((q, dequantize(q).to(float_dtype)))

    def pair(x: torch.Tensor, q: QuantWeight, w: torch.Tensor) -> list[Callable[[], object]]:
        quant = functools.partial(pk.quant_linear, x.float(), q, None, kernels=kernels)
        return [quant, float_linear_call(x.to(float_dtype), w, kernels, alive)]

    batched = [pair(torch.randn(m, q.k, generator=g), q, w) for q, w in forms[0] for m in BATCH_SIZES]
    decode = [pair(torch.randn(1, q.k, generator=g), q, w) for layer in forms for q, w in layer]
    passes = [[functools.partial(run_all, [p[i] for p in decode]) for i in (0, 1)]]
    out: dict[str, float] = {}
    for kind, pairs, per in (("batched", batched, 1), ("decode", passes, count)):
        quant, dense = time_pairs(pairs, repeat)
        out[f"{kind}_quant_ms"] = round(quant * 1e3 / per, 3)
        out[f"{kind}_float_ms"] = round(dense * 1e3 / per, 3)
        out[f"{kind}_speedup"] = round(dense / quant, 3)
    out["decode_layers"] = count
    return out


def decide(figures: dict[str, float]) -> bool:
    """Whether to keep the blocks, from `measure_quantized_speedup`'s figures (module docstring)."""
    return figures["decode_speedup"] >= QUANT_MIN_SPEEDUP and figures["batched_speedup"] >= 1 / QUANT_MIN_SPEEDUP


def measurement_key(layers: list[LayerWeights], float_dtype: torch.dtype, kernels: Any) -> str:
    """The cache key of a measurement: what its figures depend on (module docstring)."""
    ident = {
        "quant_version": MEASUREMENT_VERSION,
        "dtype": str(float_dtype),
        "layers": len(layers),
        "linears": [[QTYPE_NAMES[qt], k, raw.shape[0]] for _, qt, k, raw in layers[0].linears],
        "kernels": None if kernels is None else [Path(kernels.path).name, kernels.bf16_impl],
    }
    return MeasurementCache.digest(ident)


def choose_auto(
    layers: list[LayerWeights],
    float_dtype: torch.dtype,
    kernels: Any,
    cache: MeasurementCache | None,
    measure: Callable[..., dict[str, float]] = measure_quantized_speedup,
) -> tuple[bool, str, dict[str, float]]:
    """``(keep quantized, reason, figures)`` for ``auto``: the figures from ``cache`` when it
    holds this key, else measured (``measure(layers, float_dtype, kernels)``) and stored."""
    key = measurement_key(layers, float_dtype, kernels)
    figures = cache.load(key) if cache is not None else None
    source = f"cached {cache.path(key)}" if figures is not None and cache is not None else "measured now"
    if figures is None:
        figures = measure(layers, float_dtype, kernels)
        if cache is not None:
            cache.store(key, figures)
    name = str(float_dtype).removeprefix("torch.")
    verdict = "faster" if decide(figures) else "not faster enough"
    reason = (
        f"quantized measured {verdict} than {name} (decode {figures['decode_speedup']:.2f}x, batched "
        f"{figures['batched_speedup']:.2f}x; {source})"
    )
    return decide(figures), reason, figures
