"""Qwen3-MoE (Qwen team, 2025): Qwen3's decoder (QK-norm) with sparse MoE MLPs of ``num_experts``
SwiGLU experts of ``moe_intermediate_size``: softmax over all router logits, the top
``num_experts_per_tok``, renormalised when ``norm_topk_prob`` (`pkgd.runner.layers.moe`). Layers
listed in ``mlp_only_layers``, or off the ``decoder_sparse_step`` stride, keep a dense MLP of
``intermediate_size``. Checkpoint names: ``mlp.gate`` (router) and
``mlp.experts.{N}.gate_proj/up_proj/down_proj``, stacked at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from pkgd.runner.distributed import TPGroup
from pkgd.runner.layers.moe import FusedMoE, MoELayer, expert_names, load_moe_tensor, moe_sizes
from pkgd.runner.models.config import ArchConfig
from pkgd.runner.models.llama import LlamaDecoderLayer, LlamaMLP
from pkgd.runner.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

PREFIX = "mlp."
PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def is_sparse_layer(cfg: ArchConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` is MoE (transformers' rule for Qwen3-MoE)."""
    raw = cfg.raw
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    sparse = moe_sizes(raw, cfg.intermediate_size)[0] > 0 and (layer_idx + 1) % step == 0
    return sparse and layer_idx not in (raw.get("mlp_only_layers") or [])


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, cfg: ArchConfig, tp: TPGroup, dtype: torch.dtype, kernels, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(cfg, layer_idx):
            return LlamaMLP(cfg, tp, dtype, kernels)
        raw = cfg.raw
        experts, inter = moe_sizes(raw, cfg.intermediate_size)
        return FusedMoE(
            experts,
            int(raw.get("num_experts_per_tok", 8)),
            cfg.hidden_size,
            inter,
            renormalize=bool(raw.get("norm_topk_prob", False)),
            tp=tp,
            dtype=dtype,
            kernels=kernels,
        )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer

    def _mlp_names(self, prefix: str, layer: LlamaDecoderLayer) -> list[str]:
        if isinstance(layer.mlp, MoELayer):
            return expert_names(prefix + PREFIX, layer.mlp.num_experts, PARTS)
        return super()._mlp_names(prefix, layer)

    def _load_layer_tensor(self, layer: LlamaDecoderLayer, rest: str, t: torch.Tensor, full_name: str) -> None:
        moe = layer.mlp
        if not (
            isinstance(moe, MoELayer)
            and rest.startswith(PREFIX)
            and load_moe_tensor(moe, rest[len(PREFIX) :], t, PARTS)
        ):
            super()._load_layer_tensor(layer, rest, t, full_name)
