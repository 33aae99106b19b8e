"""Qwen3 (Qwen team, 2025): Llama with QK-norm, an RMSNorm over each head's ``head_dim`` applied
to queries and keys before RoPE, and ``head_dim`` set independently of ``hidden_size``."""

from __future__ import annotations

import dataclasses

import torch

from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.models.config import ArchConfig
from pkgd.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer

    def __init__(
        self, cfg: ArchConfig, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32, kernels=None
    ) -> None:
        if cfg.raw.get("use_sliding_window"):
            raise ValueError("Qwen3 with use_sliding_window: true is not supported (sliding-window attention)")
        super().__init__(dataclasses.replace(cfg, mlp_bias=False), tp=tp, dtype=dtype, kernels=kernels)
