"""`ArchConfig`: the fields of an HF ``config.json`` the model families read (torch-free).

Read as plain JSON rather than through transformers' config classes, so a model directory is
interpreted the same way whatever transformers version is installed. Both spellings of the
RoPE settings are accepted: transformers 4's ``rope_theta`` + ``rope_scaling`` and
transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    """Architecture hyper-parameters (sizes in elements; ``max_position_embeddings`` in tokens)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    checkpoint_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any] = dataclasses.field(repr=False, compare=False, default_factory=dict)
    # Sliding-window attention: the window in tokens (0 = none) and, when only some layers
    # use it, each layer's type ("sliding_attention" or "full_attention"; None = every layer).
    sliding_window: int = 0
    layer_types: tuple[str, ...] | None = None

    @property
    def rot_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def window_of(self, layer_idx: int) -> int:
        """The sliding window of layer ``layer_idx`` in tokens (0 = it attends to every key)."""
        if self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return 0


def load_arch_config(model_dir: Path, overrides: dict[str, Any] | None = None) -> ArchConfig:
    """Parse ``model_dir/config.json`` (and ``generation_config.json`` for EOS ids), with the
    top-level fields of ``overrides`` (``model.hf_overrides``) replacing the file's.

    Raises:
        ValueError: a field is missing or the file is not JSON; the message names the file.
    """
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read model config ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the model config is not a JSON object")
    raw = {**raw, **(overrides or {})}
    gen = _read_optional_json(model_dir / "generation_config.json")
    try:
        return arch_config_from_dict(raw, gen)
    except KeyError as e:
        raise ValueError(f"{path}: missing field {e.args[0]!r}") from e


def arch_config_from_dict(raw: dict[str, Any], gen: dict[str, Any] | None = None) -> ArchConfig:
    archs = raw.get("architectures") or []
    if not archs:
        raise KeyError("architectures")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    rope = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or None
    if rope and rope.get("rope_type", "default") != "default":
        scaling = rope
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    model_type = raw.get("model_type", "")
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    eos = (gen or {}).get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    # Qwen2/3 write a window and switch it off with use_sliding_window: false.
    window = int(raw.get("sliding_window") or 0) if raw.get("use_sliding_window", True) else 0
    layer_types = raw.get("layer_types")
    return ArchConfig(
        architecture=str(archs[0]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        vocab_size=int(raw["vocab_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no such key.
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        checkpoint_dtype=str(dtype) if dtype else None,
        bos_token_id=_opt_int((gen or {}).get("bos_token_id", raw.get("bos_token_id"))),
        eos_token_ids=eos_ids,
        raw=raw,
        sliding_window=window,
        layer_types=tuple(layer_types) if layer_types else None,
    )


def _opt_int(v: Any) -> int | None:
    if isinstance(v, list):
        v = v[0] if v else None
    return int(v) if v is not None else None


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
