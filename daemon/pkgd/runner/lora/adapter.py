"""Reading and checking a LoRA adapter in the PEFT format (Hu et al., 2021; Hugging Face PEFT).

A directory with ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``, optional ``rank_pattern``) and
``adapter_model.safetensors`` holding, per targeted projection,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight [r, in]`` and
``...lora_B.weight [out, r]``. The update of a projection is ``W x + s * B (A x)`` with
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA, Kalajdzievski, 2023).

`load_adapter` turns it into one `LinearDelta` per (layer, fused linear of the model):
``qkv_proj`` from q/k/v (or an adapter's own fused ``qkv_proj``), ``o_proj``, ``gate_up_proj``
from gate/up (or fused ``gate_up_proj``), ``down_proj``. Separate parts are stacked along the
rank (``A = [A_q; A_k; A_v]``) with a block-diagonal ``B``, so a fused linear takes one
shrink and one expand. Everything is checked before anything is used: the files, the rank
against ``max_lora_rank``, every tensor name, each target against the model's projections,
and every shape against the base layer (an adapter trained on another model fails there,
naming the tensor). Errors are `LoRAAdapterError` (a ``ValueError``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF projection name -> (the model's fused linear, part index; None = the whole fused linear)
PROJECTIONS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", None),
}

_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """What an adapter must match of one fused linear of the model (full, unsharded sizes):
    ``in_features``, ``part_sizes`` (output rows of each part: q/k/v, gate/up, or one)."""

    in_features: int
    part_sizes: tuple[int, ...]


@dataclasses.dataclass
class LinearDelta:
    """One adapter's update of one fused linear, full (unsharded) and in the model's row
    layout: ``a [R, in]`` and ``b [out_total, R]`` float32, the scaling folded into ``b``."""

    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class LoRAAdapter:
    """A loaded, checked adapter: ``rank`` (its largest), ``deltas[(layer, linear)]``."""

    name: str
    int_id: int
    path: str
    rank: int
    deltas: dict[tuple[int, str], LinearDelta]

    @property
    def num_bytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size() for d in self.deltas.values())


def read_config(path: Path, name: str) -> dict:
    """``adapter_config.json`` of ``path`` (a dict). Raises `LoRAAdapterError` for a missing
    directory or file, bad JSON, or a PEFT type other than LORA / DoRA / LoRA bias."""
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / file).is_file():
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} is missing in {path}")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases")):
        if cfg.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {what} ({key}: true) is not supported")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: modules_to_save {cfg['modules_to_save']} (fully trained modules) is not supported"
        )
    if cfg.get("alpha_pattern"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: alpha_pattern (per-module lora_alpha) is not supported")
    return cfg


def check_targets(cfg: dict, name: str, targets: set[str]) -> None:
    """Refuse ``target_modules`` naming a module the model has no adapter slot for
    (``targets``: HF projection names). A regex string (PEFT's other form) is checked
    through the tensors instead."""
    wanted = cfg.get("target_modules")
    if isinstance(wanted, list):
        unknown = sorted(set(wanted) - targets)
        if unknown:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: target module {unknown[0]!r} is not one this model takes adapters on "
                f"(supported: {', '.join(sorted(targets))})"
            )


def load_adapter(
    path: str,
    name: str,
    int_id: int,
    *,
    shapes: dict[tuple[int, str], LinearShape],
    max_rank: int,
    row_layout: Callable[[str, torch.Tensor], torch.Tensor],
) -> LoRAAdapter:
    """Read, check and fuse an adapter (module docstring).

    Args:
        shapes: ``(layer, linear) -> LinearShape`` of every linear that takes adapters.
        max_rank: ``lora.max_lora_rank``.
        row_layout: ``(hf_name, tensor [out, r]) -> tensor`` putting a projection's rows in
            the model's layout (the Llama family's adjacent-pair RoPE order of q/k rows);
            ``hf_name`` as ``self_attn.q_proj.weight``.

    Raises:
        LoRAAdapterError: missing files, bad config, rank above ``max_rank``, an unknown
            tensor or target, a layer or shape the model does not have.
    """
    from safetensors import safe_open

    root = Path(path)
    cfg = read_config(root, name)
    ranks = [cfg.get("r", 0), *(cfg.get("rank_pattern") or {}).values()]
    if max(int(r) for r in ranks) > max_rank:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: rank {max(int(r) for r in ranks)} is greater than lora.max_lora_rank {max_rank}"
        )
    check_targets(cfg, name, {p for p in PROJECTIONS if any(k[1] == PROJECTIONS[p][0] for k in shapes)})
    try:
        with safe_open(str(root / WEIGHTS_FILE), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {WEIGHTS_FILE}: {exc}") from None
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _TENSOR.match(key)
        if m is None or m.group(3) not in PROJECTIONS:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: tensor {key!r} targets nothing this model takes adapters on"
            )
        layer, group, proj, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        pairs.setdefault((layer, group, proj), {})[ab] = t
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B tensors")
    rank_pattern = cfg.get("rank_pattern") or {}
    parts: dict[tuple[int, str], list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
    top_rank = 0
    for (layer, group, proj), ab in sorted(pairs.items()):
        where = f"layer {layer} {group}.{proj}"
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"].float(), ab["B"].float()
        linear, part = PROJECTIONS[proj]
        shape = shapes.get((layer, linear))
        if shape is None:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {where}: the model has no such layer or projection taking adapters "
                "(an adapter for another model?)"
            )
        r = a.shape[0]
        if r > max_rank:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: rank {r} ({where}) is greater than lora.max_lora_rank {max_rank}"
            )
        out = shape.part_sizes[part] if part is not None else sum(shape.part_sizes)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, shape.in_features) or tuple(b.shape) != (out, r):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {where}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the "
                f"model's projection ({shape.in_features} inputs, {out} outputs; expected [{r}, {shape.in_features}] "
                f"/ [{out}, {r}]): an adapter for another model?"
            )
        alpha = float(cfg.get("lora_alpha", 8))
        configured_r = int(_pattern_rank(rank_pattern, f"layers.{layer}.{group}.{proj}", cfg.get("r", r)))
        scaling = alpha / math.sqrt(configured_r) if cfg.get("use_rslora") else alpha / configured_r
        parts.setdefault((layer, linear), []).append((part, a, b * scaling))
        top_rank = max(top_rank, r)
    deltas = {key: _fuse(key[1], got, shapes[key], row_layout, name) for key, got in parts.items()}
    return LoRAAdapter(name, int_id, path, top_rank, deltas)


def _pattern_rank(pattern: dict, module: str, default: int) -> int:
    """PEFT's ``rank_pattern``: the rank of the first key that ``module`` ends with."""
    for key, r in pattern.items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return int(r)
    return int(default)


def _fuse(
    linear: str,
    got: list[tuple[int | None, torch.Tensor, torch.Tensor]],
    shape: LinearShape,
    row_layout: Callable[[str, torch.Tensor], torch.Tensor],
    name: str,
) -> LinearDelta:
    """The parts of one fused linear as one ``(A [R, in], B [out_total, R])``."""
    if any(p is None for p, _, _ in got) and len(got) > 1:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {linear} is targeted both fused and by parts")
    sizes = shape.part_sizes
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    a = torch.cat([a for _, a, _ in got])
    b = torch.zeros(sum(sizes), a.shape[0])
    col = 0
    for part, pa, pb in got:
        r = pa.shape[0]
        if part is None:
            b[:, col : col + r] = pb
        else:
            b[offsets[part] : offsets[part] + sizes[part], col : col + r] = pb
        col += r
    hf_names = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    group = "self_attn" if linear in ("qkv_proj", "o_proj") else "mlp"
    for i, hf in enumerate(hf_names.get(linear, (linear,))):
        rows = slice(offsets[i], offsets[i] + sizes[i])
        b[rows] = row_layout(f"{group}.{hf}.weight", b[rows])
    return LinearDelta(a.contiguous(), b.contiguous())
