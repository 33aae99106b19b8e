"""Rotary position embedding (RoPE, Su et al., 2021) and its scaling variants.

Frequencies follow transformers' ``modeling_rope_utils`` so logits match it to float32
rounding: ``inv_freq[i] = 1 / theta ** (2i / rot_dim)`` computed in float32, then per
``rope_type``:

* ``default``: unchanged.
* ``linear``: ``inv_freq / factor`` (position interpolation, Chen et al., 2023).
* ``llama3``: Meta's Llama 3.1 rule: wavelengths longer than
  ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, shorter than
  ``... / high_freq_factor`` kept, a linear blend between.
* ``longrope`` (``su``; Ding et al., 2024, "LongRoPE", as Phi-3 uses it): ``inv_freq[i] /
  short_factor[i]`` for positions below ``original_max_position_embeddings``, ``/
  long_factor[i]`` from there on, cos and sin both times ``attention_factor`` (default
  ``sqrt(1 + ln(s) / ln(original))``, ``s = max_position / original``). Chosen per position:
  transformers instead rotates a whole sequence with the long factors once it is longer than
  ``original`` (its Phi-3 recomputes the cache when generation crosses that length), so the
  two agree on sequences within the original length and differ past it, as vLLM's per-batch
  switch does.

Layout: HF checkpoints rotate dimension ``i`` with ``i + rot_dim/2`` of each head (GPT-NeoX
"rotate half"). pkgd permutes the Q/K projection rows at load time (`to_interleaved`, the same
permutation llama.cpp applies in its converter) so that rotated pairs are adjacent (GPT-J
pairing): ``pkgd_kernels.rotary_embedding``'s CPU form then rotates each pair as one complex
multiplication, 3 ops instead of ~10 per tensor, and the one-call decode step rotates pairs in
place. Attention scores are unchanged because queries and keys carry the same permutation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


class RotaryEmbedding(nn.Module):
    """Holds ``cos_sin_cache [max_position, rot_dim]`` (float32; cos | sin halves)."""

    cos_sin_cache: torch.Tensor  # a registered buffer

    def __init__(
        self, rot_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None, is_neox: bool = True
    ) -> None:
        super().__init__()
        self.rot_dim = rot_dim
        self.is_neox = is_neox
        scaling = scaling or {}
        t = torch.arange(max_position, dtype=torch.float32)
        if scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            cache = _longrope_cache(rot_dim, t, theta, scaling)
        else:
            freqs = torch.outer(t, _inv_freq(rot_dim, theta, scaling))
            cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)


def to_interleaved(w: torch.Tensor, num_heads: int, head_dim: int, rot_dim: int) -> torch.Tensor:
    """Reorder rows (dim 0) of a Q/K weight ``[num_heads * head_dim, ...]``, bias or QK-norm
    weight from the rotate-half layout to adjacent pairs: within each head's first ``rot_dim``
    rows, ``[a_0..a_{r/2-1}, b_0..b_{r/2-1}] -> [a_0, b_0, a_1, b_1, ...]``; the rest unchanged."""
    rest = w.shape[1:]
    heads = w.reshape(num_heads, head_dim, *rest)
    rot = (
        heads[:, :rot_dim].reshape(num_heads, 2, rot_dim // 2, *rest).transpose(1, 2).reshape(num_heads, rot_dim, *rest)
    )
    return torch.cat((rot, heads[:, rot_dim:]), dim=1).reshape(w.shape)


def _inv_freq(rot_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float32) / rot_dim))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _longrope_cache(rot_dim: int, t: torch.Tensor, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """``[len(t), rot_dim]`` cos | sin for LongRoPE (module docstring; transformers'
    ``_compute_longrope_parameters``). ``s`` needs ``short_factor``, ``long_factor`` and
    ``original_max_position_embeddings``."""
    original = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or len(t) / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)
    short = torch.outer(t[:original], 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * base))
    long = torch.outer(t[original:], 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * base))
    freqs = torch.cat((short, long))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
