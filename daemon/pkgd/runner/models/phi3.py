"""Phi-3 (Abdin et al., 2024, "Phi-3 Technical Report"): Llama's layers with Q/K/V stored as one
``qkv_proj`` and gate/up as one ``gate_up_proj`` (split back into their parts on load; the
model fuses them again in its own layout), sliding-window attention where the config sets
``sliding_window``, and LongRoPE (``longrope``, formerly ``su``) where ``rope_scaling`` asks
(`pkgd.runner.layers.rotary`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.models.config import ArchConfig
from pkgd.runner.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(
        self, cfg: ArchConfig, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32, kernels=None
    ) -> None:
        scaling = cfg.rope_scaling
        if scaling and "original_max_position_embeddings" not in scaling:  # a top-level key in Phi-3's config
            original = cfg.raw.get("original_max_position_embeddings", cfg.max_position_embeddings)
            cfg = dataclasses.replace(cfg, rope_scaling={**scaling, "original_max_position_embeddings": original})
        super().__init__(cfg, tp=tp, dtype=dtype, kernels=kernels)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As `LlamaForCausalLM.load_weights`, for Phi-3's fused tensor names."""
        super().load_weights(unfuse(weights, self.cfg))


def unfuse(weights: Iterable[tuple[str, torch.Tensor]], cfg: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Split ``self_attn.qkv_proj`` (rows ``[q | k | v]``) and ``mlp.gate_up_proj`` (rows
    ``[gate | up]``) into the separate HF names; other tensors pass through. Splits rows only,
    so a quantized tensor's rows of blocks split the same way."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    for name, t in weights:
        prefix, _, kind = name.rpartition(".")
        if prefix.endswith("self_attn.qkv_proj"):
            base = prefix[: -len("qkv_proj")]
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                yield f"{base}{part}.{kind}", rows
        elif prefix.endswith("mlp.gate_up_proj"):
            base = prefix[: -len("gate_up_proj")]
            gate, up = t.chunk(2)
            yield f"{base}gate_proj.{kind}", gate
            yield f"{base}up_proj.{kind}", up
        else:
            yield name, t
