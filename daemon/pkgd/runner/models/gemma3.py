"""Gemma 3 text (Gemma Team, 2025, "Gemma 3 Technical Report"; ``Gemma3ForCausalLM``, the 1B
model and the language model of the larger ones saved alone): Gemma 2's layers
(`pkgd.runner.models.gemma2`) with

* QK-norm: a ``(1 + w)`` RMSNorm over each head of the queries and keys, before RoPE;
* two RoPE tables: local layers rotate with ``rope_local_base_freq`` (10 000) unscaled, global
  layers with ``rope_theta`` (1 000 000) and ``rope_scaling`` (transformers 5 writes both
  under ``rope_parameters``, keyed by layer type);
* five local layers to one global by default (``sliding_window_pattern`` 6), window
  ``sliding_window`` (512 in the released models);
* no attention-logit soft-cap: transformers' Gemma 3 never applies ``attn_logit_softcapping``,
  so neither does pkgd; the final-logit cap applies where the config sets one.

``use_bidirectional_attention`` (EmbeddingGemma) is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from pkgd.runner.attention import AttentionMetadata, KVCache
from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.layers.rotary import RotaryEmbedding
from pkgd.runner.models.config import ArchConfig
from pkgd.runner.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM
from pkgd.runner.models.llama import RopeStep
from pkgd_kernels.rotary import plan_rotary


class Gemma3Attention(Gemma2Attention):
    qk_norm = True

    def __init__(self, cfg: ArchConfig, tp: TPGroup, dtype: torch.dtype, kernels=None, layer_idx: int = 0) -> None:
        super().__init__(cfg, tp, dtype, kernels, layer_idx)
        self.soft_cap = 0.0  # transformers' Gemma 3 does not pass its attn_logit_softcapping on
        self.is_local = cfg.layer_types is not None and cfg.layer_types[layer_idx] == "sliding_attention"


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


def rope_of(cfg: ArchConfig, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` of Gemma 3's ``layer_type`` layers, from transformers 5's per-type
    ``rope_parameters`` or transformers 4's ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling``."""
    params = (cfg.raw.get("rope_parameters") or {}).get(layer_type)
    if isinstance(params, dict):
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(params.get("rope_theta", 10000.0)), scaling
    if layer_type == "sliding_attention":
        return float(cfg.raw.get("rope_local_base_freq", 10000.0)), None
    return float(cfg.raw.get("rope_theta", 1000000.0)), cfg.raw.get("rope_scaling") or None


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text (module docstring). ``rotary_emb`` is the global layers' table,
    ``rotary_emb_local`` the local layers'."""

    layer_cls = Gemma3DecoderLayer
    sliding_every = 6

    def __init__(
        self, cfg: ArchConfig, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32, kernels=None
    ) -> None:
        if cfg.raw.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention (EmbeddingGemma) is not supported")
        super().__init__(cfg, tp=tp, dtype=dtype, kernels=kernels)
        c = self.cfg
        tables = {}
        for layer_type in ("sliding_attention", "full_attention"):
            theta, scaling = rope_of(c, layer_type)
            tables[layer_type] = RotaryEmbedding(c.rot_dim, c.max_position_embeddings, theta, scaling, is_neox=False)
        self.rotary_emb_local = tables["sliding_attention"]
        self.rotary_emb = tables["full_attention"]

    def forward_layers(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """As `LlamaForCausalLM.forward_layers`, each layer with its type's rotary table."""
        steps = [
            RopeStep(r, plan_rotary(positions, r.cos_sin_cache, r.is_neox))
            for r in (self.rotary_emb, self.rotary_emb_local)
        ]
        residual = None
        for layer, kv_cache in zip(cast(Iterable[Gemma3DecoderLayer], self.layers), kv_caches):
            rope = steps[1] if cast(Gemma3Attention, layer.self_attn).is_local else steps[0]
            h, residual = layer(h, residual, positions, rope, kv_cache, meta)
        h, _ = self.norm(h, residual)
        return h
