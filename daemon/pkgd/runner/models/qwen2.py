"""Qwen2 (Yang et al., 2024): Llama with biases on the Q/K/V projections (none on o_proj
or the MLP). Sliding-window attention (``use_sliding_window``) is not supported."""

from __future__ import annotations

import dataclasses

import torch

from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.models.config import ArchConfig
from pkgd.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    o_proj_bias_follows_attention_bias = False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer

    def __init__(
        self, cfg: ArchConfig, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32, kernels=None
    ) -> None:
        if cfg.raw.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window: true is not supported (sliding-window attention)")
        super().__init__(
            dataclasses.replace(cfg, attention_bias=True, mlp_bias=False), tp=tp, dtype=dtype, kernels=kernels
        )
