"""Gemma 2 (Gemma Team, 2024, "Gemma 2: Improving Open Language Models at a Practical Size"):
Llama's attention and gated MLP with

* RMSNorm as ``x_hat * (1 + w)``: checkpoints store ``w``; `load_weights` stores ``1 + w`` into
  the shared `RMSNorm` (float32: identical; bfloat16: rounded twice, normalised value then
  product, where transformers rounds the float32 product once);
* four norms per layer, the sublayers' outputs normed before each residual add:
  ``h += post_attn_norm(attn(input_norm(h))); h += post_ffw_norm(mlp(pre_ffw_norm(h)))``;
* embeddings times ``sqrt(hidden_size)`` (rounded to the model dtype, as transformers does);
* GeGLU (``hidden_activation`` gelu_pytorch_tanh, `pkgd_kernels.gelu_tanh_and_mul`);
* scores scaled by ``query_pre_attn_scalar ** -0.5``, attention logits soft-capped
  (``attn_logit_softcapping``: ``c * tanh(s / c)``, in the attention backend), final logits
  soft-capped (``final_logit_softcapping``);
* local (sliding-window) and global layers alternating, from ``layer_types`` (layer 0 local
  when the config has none, as transformers' default).

Embeddings are tied unless the config says otherwise. The one-call CPU decode step
(`pkgd.runner.models.llama_cpu_decode`) does not compute these layers: every step runs the
per-layer forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

import pkgd_kernels as pk
from pkgd.runner.attention import AttentionMetadata, KVCache
from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.layers.norm import RMSNorm
from pkgd.runner.models.config import ArchConfig
from pkgd.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RopeStep


class GemmaMLP(LlamaMLP):
    """GeGLU: ``down(gelu_tanh(gate(h)) * up(h))``."""

    activations = ("gelu_pytorch_tanh",)

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return pk.gelu_tanh_and_mul(gate_up)


class Gemma2Attention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, tp: TPGroup, dtype: torch.dtype, kernels=None, layer_idx: int = 0) -> None:
        super().__init__(cfg, tp, dtype, kernels, layer_idx)
        self.scale = float(cfg.raw.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        self.soft_cap = float(cfg.raw.get("attn_logit_softcapping") or 0.0)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Gemma2Attention
    mlp_cls = GemmaMLP

    def __init__(self, cfg: ArchConfig, tp: TPGroup, dtype: torch.dtype, kernels=None, layer_idx: int = 0) -> None:
        super().__init__(cfg, tp, dtype, kernels, layer_idx)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)

    def forward(self, h, residual, positions: torch.Tensor, rope: RopeStep, kv_cache: KVCache, meta: AttentionMetadata):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, rope, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


def gemma_arch_config(cfg: ArchConfig, sliding_every: int) -> ArchConfig:
    """``cfg`` with Gemma's defaults filled: the activation from ``hidden_activation``, tied
    embeddings unless the config unties them, and, without ``layer_types``, every
    ``sliding_every``-th layer global (the others local) as transformers' configs default."""
    act = cfg.raw.get("hidden_activation") or cfg.raw.get("hidden_act") or "gelu_pytorch_tanh"
    types = cfg.layer_types
    if types is None:
        pattern = int(cfg.raw.get("sliding_window_pattern") or sliding_every)
        n = cfg.num_hidden_layers
        types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n))
    return dataclasses.replace(
        cfg, hidden_act=act, layer_types=types, tie_word_embeddings=bool(cfg.raw.get("tie_word_embeddings", True))
    )


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (module docstring). ``norm_offset``: added to every norm weight on load (1 for
    HF checkpoints, which store ``w`` of ``1 + w``)."""

    layer_cls = Gemma2DecoderLayer
    one_call_decode = False
    norm_offset = 1.0
    sliding_every = 2  # transformers' Gemma 2 default: layers 0, 2, ... local

    def __init__(
        self, cfg: ArchConfig, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32, kernels=None
    ) -> None:
        super().__init__(gemma_arch_config(cfg, self.sliding_every), tp=tp, dtype=dtype, kernels=kernels)
        self.embed_scale = self.cfg.hidden_size**0.5
        self.final_soft_cap = float(self.cfg.raw.get("final_logit_softcapping") or 0.0)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return self.forward_layers(h, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H] -> logits [N, V]`` float32, soft-capped when the config says so."""
        logits = super().compute_logits(hidden)
        if self.final_soft_cap:
            logits = logits.div_(self.final_soft_cap).tanh_().mul_(self.final_soft_cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As `LlamaForCausalLM.load_weights`, with ``norm_offset`` added to norm weights."""
        super().load_weights(self._offset_norms(weights))

    def _offset_norms(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            if name.endswith("norm.weight") and self.norm_offset:
                t = t.float() + self.norm_offset
            yield name, t

    def _expected_names(self) -> list[str]:
        names = super()._expected_names()
        for i in range(len(self.layers)):
            names += [
                f"model.layers.{i}.{n}.weight" for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
            ]
        return names
