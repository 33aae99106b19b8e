"""Load a GGUF file's weights kept quantized, and decide whether to (``model.quantization``).

`choose_quantization` is the one place that decides: ``gguf`` keeps the file's quantized
blocks when every tensor can stay so (each 2-D weight of a type `pkgd_kernels.quant_layout`
reads, norms and biases in float; an MoE router is dequantized) and the C kernels for them load,
on CPU without tensor parallelism; ``auto`` (the default) when, besides, a measurement on this
host finds them faster than the float path (`pkgd.runner.loader.quant_choice`); otherwise, and
for ``none``, the runner loads the dequantized float weights
(`pkgd.model_files.resolve.ensure_float_weights`). The choice and its reason are logged.

`load_quantized_model` builds the model, swaps its linears, MoE MLPs, LM head and embedding for
the layers of `pkgd.runner.layers.quantized`, and feeds the GGUF tensors through the model's own
``load_weights`` (HF names, llama.cpp's Q/K row permutation undone on the rows of blocks, as
the float conversion does on floats), read from the memory-mapped file. Packing those blocks
into the kernels' layout is most of the loading's time, so the packed weights are stored in
``model.cache_dir`` after the first load and read from there by later ones
(`pkgd.runner.loader.packed_cache`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from torch import nn

from pkgd.model_files.gguf_convert import (
    CONFIG_TENSORS,
    hf_name,
    moe_hf_names,
    norm_shift,
    permutes_qk,
    read_gguf_tensors,
    unpermute_qk,
)
from pkgd.runner.layers.moe import MoELayer
from pkgd.runner.layers.quantized import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedLMHead,
    QuantizedMoE,
    packed_layers,
)
from pkgd.runner.loader.dtype import MeasurementCache
from pkgd.runner.loader.packed_cache import PackedWeightsCache
from pkgd.runner.loader.quant_choice import choose_auto, layer_weights, measure_quantized_speedup
from pkgd.runner.models import get_model_class
from pkgd.runner.models.config import ArchConfig
from pkgd_kernels.quant_layout import BLOCK, GROUP_ROWS, QTYPE_NAMES, supports

logger = structlog.get_logger(__name__)

_FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
# Parts of fused projections: every part but the last of a fused weight starts a 16-row group.
_FUSED_PARTS = ("q_proj", "k_proj", "gate_proj", "ffn_gate_exps")


@dataclasses.dataclass(frozen=True)
class QuantizationChoice:
    """``quantized``: whether the GGUF blocks are kept; ``reason``: why (logged);
    ``tensor_types``: type name -> tensor count of the file (empty for a non-GGUF source);
    ``figures``: the measurement ``auto`` decided by (`pkgd.runner.loader.quant_choice`),
    empty when none ran."""

    quantized: bool
    reason: str
    tensor_types: dict[str, int]
    figures: dict[str, float] = dataclasses.field(default_factory=dict)


class GGUFWeights:
    """A GGUF file's tensors by HF name (memory-mapped; nothing read until iterated).

    Raises (from the constructor):
        ModelSourceError: not a readable GGUF of a supported architecture.
    """

    def __init__(self, path: Path, cfg: ArchConfig) -> None:
        self.path = path
        self.cfg = cfg
        tensors, arch = read_gguf_tensors(path)
        self._permute = permutes_qk(arch)
        # An MoE router under its HF name; stacked experts under their GGUF name, with the HF
        # names of the experts they hold (`__iter__` yields one tensor per expert).
        self._experts: dict[str, list[str]] = {}
        self._routers: set[str] = set()
        self.tensors: dict[str, Any] = {}
        self._unknown: list[str] = []
        self._norm_shift = norm_shift(arch)
        for t in (t for t in tensors if t.name not in CONFIG_TENSORS):  # those are read into the config
            moe = moe_hf_names(t.name, cfg.raw)
            if moe is not None and t.name.split(".")[2] == "ffn_gate_inp":
                self._routers.add(moe[0])
                self.tensors[moe[0]] = t
            elif moe is not None:
                self._experts[t.name] = moe
                self.tensors[t.name] = t
            else:
                name = hf_name(t.name, arch)
                self.tensors[name or t.name] = t
                if name is None:
                    self._unknown.append(t.name)

    def qtype(self, name: str) -> int:
        """GGML type id of tensor ``name`` (HF name)."""
        return int(self.tensors[name].tensor_type)

    def num_items(self) -> int:
        """How many ``(name, tensor)`` pairs `__iter__` yields (stacked experts one per expert)."""
        return len(self.tensors) + sum(len(names) - 1 for names in self._experts.values())

    def tensor_types(self) -> dict[str, int]:
        return dict(collections.Counter(_type_name(int(t.tensor_type)) for t in self.tensors.values()))

    def problems(self) -> list[str]:
        """Why the file cannot run quantized (empty when it can)."""
        out = [f"{name} has no counterpart in the model" for name in self._unknown]
        for name, t in self.tensors.items():
            qt, shape = int(t.tensor_type), [int(d) for d in reversed(t.shape)]
            if name in self._routers:
                continue  # dequantized to float32 whatever its type
            if len(shape) == 1:
                if qt not in _FLOAT_TYPES:
                    out.append(f"{t.name} (1-D) is {_type_name(qt)}")
            elif qt not in QTYPE_NAMES:
                out.append(f"{t.name} is {_type_name(qt)}, a type the quantized kernels do not read")
            elif not supports(qt, shape[-1]):
                out.append(f"{t.name} has {shape[-1]} inputs per row, not a multiple of {BLOCK[qt]}")
            elif name.rsplit(".", 2)[-2] in _FUSED_PARTS and shape[-2] % GROUP_ROWS:
                out.append(f"{t.name} has {shape[-2]} rows, not a multiple of {GROUP_ROWS} (a fused projection's part)")
            elif name.rsplit(".", 2)[-2] in ("qkv_proj", "gate_up_proj") and any(
                n % GROUP_ROWS for n in self._parts(name)
            ):
                out.append(f"{t.name} splits into parts of {self._parts(name)} rows, not multiples of {GROUP_ROWS}")
        return out

    def _parts(self, name: str) -> list[int]:
        """Rows of each part of a fused tensor stored whole (Phi-3's qkv_proj, gate_up_proj)."""
        c = self.cfg
        if name.endswith("qkv_proj.weight"):
            return [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim]
        return [c.intermediate_size]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.items()

    def items(self, rows_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, tensor)``: float32 for float tensors, the uint8 rows of blocks
        ``[rows, row_bytes]`` for quantized ones (a copy, so the mapping can close); with
        ``rows_only``, empty uint8 ``[rows, 0]`` in their place (nothing read: for layers whose
        packed weights came from the cache; not ``meta`` tensors, whose ops import
        torch._dynamo, ~2 s)."""
        from gguf.quants import dequantize

        c = self.cfg
        for name, t in self.tensors.items():
            qt = int(t.tensor_type)
            if qt in QTYPE_NAMES and name not in self._routers and rows_only:
                rows = int(t.shape[1]) if len(t.shape) > 1 else 1  # GGUF lists dims innermost first
                for expert_name in self._experts.get(name, [name]):
                    yield expert_name, torch.empty((rows, 0), dtype=torch.uint8)
                continue
            if qt in QTYPE_NAMES and name not in self._routers:
                a = np.asarray(t.data)
            else:
                a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if name in self._experts:  # [E, rows, ...]: each expert's rows
                for expert_name, rows in zip(self._experts[name], a):
                    yield expert_name, torch.from_numpy(np.array(rows, copy=True))
                continue
            if self._permute and ".q_proj." in name:
                a = unpermute_qk(a, c.num_attention_heads)
            elif self._permute and ".k_proj." in name:
                a = unpermute_qk(a, c.num_key_value_heads)
            elif self._norm_shift and name.endswith("norm.weight"):
                a = a - np.float32(self._norm_shift)
            yield name, torch.from_numpy(np.array(a, copy=True))

    def close(self) -> None:
        """Drop the file mapping (its pages stop counting towards the process's memory)."""
        self.tensors = {}


def _type_name(qt: int) -> str:
    if qt in _FLOAT_TYPES:
        return _FLOAT_TYPES[qt]
    if qt in QTYPE_NAMES:
        return QTYPE_NAMES[qt]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(qt).name
    except ValueError:
        return f"type {qt}"


def choose_quantization(
    requested: str,
    gguf_path: Path | None,
    cfg: ArchConfig,
    *,
    device: torch.device,
    tp_size: int,
    kernels: Any,
    dtype: str = "auto",
    pooling: bool = False,
    float_dtype: Callable[[], torch.dtype] | None = None,
    cache: MeasurementCache | None = None,
    measure: Callable[..., dict[str, float]] | None = None,
) -> tuple[QuantizationChoice, GGUFWeights | None]:
    """Whether to keep ``gguf_path``'s weights quantized (module docstring), and the opened
    file when so.

    Args:
        requested: ``model.quantization``: ``gguf`` keeps the blocks wherever the kernels can
            run them; ``auto`` also needs them measured faster than the float path
            (`pkgd.runner.loader.quant_choice`); ``none`` never keeps them.
        dtype: ``model.dtype`` (the kernels take float32 activations, so a 16-bit one asked
            for dequantizes).
        pooling: ``model.runner`` is pooling (float weights).
        float_dtype: what the dequantized weights would run in (called only when ``auto``
            measures; default float32).
        cache: where ``auto``'s figures are looked up and stored; None measures every time.
        measure: the measurement (tests pass a fake); default `measure_quantized_speedup`.

    Raises:
        ModelSourceError: a GGUF that cannot be read.
        ValueError: an unknown ``requested``.
    """
    if requested not in ("auto", "gguf", "none"):
        raise ValueError(f"model.quantization {requested!r} is not one of auto, gguf, none")
    if requested == "none":
        return QuantizationChoice(False, "model.quantization is none", {}), None
    if gguf_path is None:
        return QuantizationChoice(False, "the model is not a GGUF file", {}), None
    weights = GGUFWeights(gguf_path, cfg)
    types = weights.tensor_types()
    reason = None
    if device.type != "cpu":
        reason = f"the quantized kernels run on CPU, not {device.type}"
    elif tp_size > 1:
        reason = "tensor parallelism runs float weights"
    elif dtype not in ("auto", "float32"):
        reason = f"model.dtype is {dtype}; the quantized kernels take float32 activations"
    elif pooling:
        reason = "the pooling runner loads float weights"
    elif kernels is None:
        reason = "the C kernels are unavailable"
    elif problems := weights.problems():
        reason = f"{len(problems)} tensors cannot stay quantized, e.g. {problems[0]}"
    else:
        from pkgd_kernels.cpu import CpuKernelsUnavailable

        try:
            kernels.quant  # noqa: B018 - builds and loads the library
        except CpuKernelsUnavailable as e:
            reason = f"the quantized kernels are unavailable ({e})"
    if reason is not None:
        weights.close()
        return QuantizationChoice(False, reason, types), None
    layers = layer_weights(weights.tensors, cfg.num_hidden_layers) if requested == "auto" else []
    if not layers:
        why = "model.quantization is gguf" if requested == "gguf" else "no layer linears to measure"
        return QuantizationChoice(True, f"kernels for every tensor type of {gguf_path.name} ({why})", types), weights
    resolved = float_dtype() if float_dtype is not None else torch.float32
    keep, reason, figures = choose_auto(layers, resolved, kernels, cache, measure or measure_quantized_speedup)
    del layers  # views of the file's mapping, which `close` drops
    if not keep:
        weights.close()
        return QuantizationChoice(False, reason, types, figures), None
    return QuantizationChoice(True, reason, types, figures), weights


def load_quantized_model(
    cfg: ArchConfig,
    weights: GGUFWeights,
    *,
    kernels: Any,
    progress: Any = None,
    cache: PackedWeightsCache | None = None,
) -> nn.Module:
    """Build ``cfg.architecture`` (float32 activations) with quantized layers and load the
    GGUF's tensors into them. ``progress`` is told one step per tensor, then one for the
    post-loading processing (and one for storing the packed weights when that runs).

    With ``cache``, the packed weights stored by an earlier load of the same file are read
    from it (`pkgd.runner.loader.packed_cache`) and only the float tensors are read from the
    GGUF (the quantized ones pass as shapes, checked against the layers); otherwise every
    weight is packed from the GGUF's blocks and the result stored for the next load. Logged
    as ``packed_weights`` (``action``: ``read``, or ``packed`` with the reason).

    Raises:
        UnsupportedArchitectureError: the architecture is not registered.
        ValueError: tensors that do not fit the architecture.
    """
    model = get_model_class(cfg.architecture)(cfg, dtype=torch.float32, kernels=kernels)
    _swap_layers(model, weights, kernels)
    layers = packed_layers(model)
    cached, why = (False, "no cache") if cache is None else _preload(layers, cache, weights, cfg)
    store = cache is not None and not cached
    tensors: Iterator[tuple[str, torch.Tensor]] = weights.items(rows_only=cached)
    if progress is not None:
        progress.set_total(weights.num_items() + 1 + store)
        tensors = _counted(tensors, progress)
    with torch.no_grad():
        model.load_weights(tensors)
        weights.close()
        for module in reversed(list(model.modules())):
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
    if progress is not None:
        progress.advance()
    logger.info("packed_weights", action="read" if cached else "packed", reason=why, layers=len(layers))
    if store:
        assert cache is not None
        cache.store(weights.path, cfg.architecture, cfg.raw, {name: m.packed for name, m in layers.items()})
        if progress is not None:
            progress.advance()
    return model.eval()


def _preload(
    layers: dict[str, Any], cache: PackedWeightsCache, weights: GGUFWeights, cfg: ArchConfig
) -> tuple[bool, str]:
    """Set every packed layer's weight from ``cache``; whether it did, else why not (and no
    layer set)."""
    stored, why = cache.load(weights.path, cfg.architecture, cfg.raw)
    if stored is None:
        return False, why
    if missing := sorted(set(layers) - set(stored)):
        return False, f"does not fit the model: {len(missing)} layers not stored, e.g. {missing[0]}"
    try:
        for name, layer in layers.items():
            layer.preload(stored[name])
    except ValueError as e:
        for layer in layers.values():  # back to empty: the weights are packed from the GGUF instead
            layer.clear()
        return False, f"does not fit the model: {name}: {e}"
    return True, "stored by an earlier load"


def _counted(tensors: Iterator[tuple[str, torch.Tensor]], progress: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for item in tensors:
        yield item
        progress.advance()


def _swap_layers(model: Any, weights: GGUFWeights, kernels: Any) -> None:
    """Replace the float linears, LM head and embedding (placeholders never written, so never
    resident) by quantized ones of the file's types."""
    cfg = model.cfg
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = QuantizedLinear.replacing(
            attn.qkv_proj, _part_types(weights, p + "self_attn.", ["q_proj", "k_proj", "v_proj"], "qkv_proj")
        )
        attn.o_proj = QuantizedLinear.replacing(attn.o_proj, [weights.qtype(p + "self_attn.o_proj.weight")])
        if isinstance(mlp, MoELayer):
            parts = ("gate", "up", "down")
            layer.mlp = QuantizedMoE(mlp, {x: weights.qtype(f"blk.{i}.ffn_{x}_exps.weight") for x in parts}, kernels)
            continue
        mlp.gate_up_proj = QuantizedLinear.replacing(
            mlp.gate_up_proj, _part_types(weights, p + "mlp.", ["gate_proj", "up_proj"], "gate_up_proj")
        )
        mlp.down_proj = QuantizedLinear.replacing(mlp.down_proj, [weights.qtype(p + "mlp.down_proj.weight")])
    table = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    model.lm_head = QuantizedLMHead(
        cfg.vocab_size, cfg.hidden_size, weights.qtype(table), tied=cfg.tie_word_embeddings, kernels=kernels
    )
    if cfg.tie_word_embeddings:
        model.embed_tokens.tied_rows = model.lm_head.embedding_rows
    else:
        model.embed_tokens = QuantizedEmbedding(
            cfg.vocab_size, cfg.hidden_size, weights.qtype("model.embed_tokens.weight"), kernels=kernels
        )


def _part_types(weights: GGUFWeights, prefix: str, parts: list[str], fused: str) -> list[int]:
    """GGML types of a fused linear's parts: each part's own, or the fused tensor's (Phi-3
    stores ``qkv_proj`` and ``gate_up_proj`` whole) for every part."""
    whole = f"{prefix}{fused}.weight"
    if whole in weights.tensors:
        return [weights.qtype(whole)] * len(parts)
    return [weights.qtype(f"{prefix}{part}.weight") for part in parts]
