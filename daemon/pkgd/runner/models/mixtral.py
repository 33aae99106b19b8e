"""Mixtral (Jiang et al., 2024, "Mixtral of Experts"): Mistral's decoder (Llama's, without
biases) with every MLP a sparse mixture of ``num_local_experts`` SwiGLU experts, the top
``num_experts_per_tok`` per token weighted by a softmax over their router logits
(`pkgd.runner.layers.moe`). Checkpoint names: ``block_sparse_moe.gate`` (router) and
``block_sparse_moe.experts.{N}.w1/w3/w2`` (gate/up/down), stacked at load time. A
``sliding_window`` is Mistral's: each token attends to the last W positions (`ArchConfig.window_of`).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import nn

from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.layers.moe import FusedMoE, MoELayer, expert_names, load_moe_tensor, moe_sizes
from pkgd.runner.models.config import ArchConfig
from pkgd.runner.models.llama import LlamaDecoderLayer, LlamaForCausalLM

PREFIX = "block_sparse_moe."
PARTS = {"w1": "gate", "w3": "up", "w2": "down"}


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, cfg: ArchConfig, tp: TPGroup, dtype: torch.dtype, kernels, layer_idx: int) -> nn.Module:
        experts, inter = moe_sizes(cfg.raw, cfg.intermediate_size)
        return FusedMoE(
            experts or 8,  # transformers' MixtralConfig default
            int(cfg.raw.get("num_experts_per_tok", 2)),
            cfg.hidden_size,
            inter,
            renormalize=True,
            tp=tp,
            dtype=dtype,
            kernels=kernels,
        )


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer

    def __init__(
        self, cfg: ArchConfig, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32, kernels=None
    ) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        super().__init__(
            dataclasses.replace(cfg, attention_bias=False, mlp_bias=False), tp=tp, dtype=dtype, kernels=kernels
        )

    def _mlp_names(self, prefix: str, layer: LlamaDecoderLayer) -> list[str]:
        return expert_names(prefix + PREFIX, cast(MoELayer, layer.mlp).num_experts, PARTS)

    def _load_layer_tensor(self, layer: LlamaDecoderLayer, rest: str, t: torch.Tensor, full_name: str) -> None:
        moe = cast(MoELayer, layer.mlp)  # every Mixtral layer's (MixtralDecoderLayer.build_mlp)
        if not (rest.startswith(PREFIX) and load_moe_tensor(moe, rest[len(PREFIX) :], t, PARTS)):
            super()._load_layer_tensor(layer, rest, t, full_name)
