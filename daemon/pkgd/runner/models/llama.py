"""Llama (Touvron et al., 2023) for the paged KV cache; also the base of Qwen2 and Qwen3, and of
the MoE families (Mixtral, Qwen3-MoE), whose layers build their own MLP (`LlamaDecoderLayer.build_mlp`).

Pre-norm decoder: ``h += attn(rms_norm(h)); h += mlp(rms_norm(h))`` with the residual adds
fused into the next norm (`RMSNorm` with a residual), GQA attention with RoPE, SwiGLU MLP,
final RMSNorm, LM head (tied to the embedding when ``tie_word_embeddings``). Tensor parallel:
Q/K/V and gate/up are column-parallel (heads / intermediate features split across ranks),
o_proj and down_proj row-parallel, embedding and LM head vocab-parallel.

``forward(input_ids [T] int64, positions [T] int64, kv_caches, meta) -> hidden [T, H]``
after the final norm; ``compute_logits(hidden [N, H]) -> [N, V]`` float32 for the rows that
need them only (the LM head is 28M of SmolLM2's 135M parameters).

Every op goes through ``pkgd_kernels`` (CUDA: Triton; CPU: the C kernels of ``kernels``, the
`pkgd_kernels.cpu.CpuKernels` the runner loaded and hands to the model, where they take the
tensors, else PyTorch). On CPU, a step of at most 8 decoding sequences runs as one C call over
every layer instead (`pkgd.runner.models.llama_cpu_decode`, set up in
`process_weights_after_loading` when the model qualifies); the per-layer forward here
(`LlamaForCausalLM.forward_layers`) is its reference and its fallback.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, cast

import torch
from torch import nn

import pkgd_kernels as pk
from pkgd.runner.attention import AttentionMetadata, KVCache, paged_attention
from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pkgd.runner.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pkgd.runner.layers.moe import check_moe_tp_size, moe_sizes
from pkgd.runner.layers.norm import RMSNorm
from pkgd.runner.layers.rotary import RotaryEmbedding, to_interleaved
from pkgd.runner.models.config import ArchConfig
from pkgd.runner.models.llama_cpu_decode import CpuDecodeStep
from pkgd_kernels.rotary import RotaryPlan, plan_rotary


class RopeStep(NamedTuple):
    """The rotary table and the step's `pkgd_kernels.rotary.plan_rotary` (computed once per
    forward, shared by every layer; None on CUDA)."""

    table: RotaryEmbedding
    plan: RotaryPlan | None


def kv_heads_per_rank(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """``(local KV heads, shard count)``: KV heads split across ranks, or, when there are fewer
    KV heads than ranks, each rank holds one replica (vLLM's rule)."""
    if num_kv_heads >= tp.size:
        return tp.shard(num_kv_heads, "num_key_value_heads"), tp.size
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of num_key_value_heads {num_kv_heads}")
    return 1, num_kv_heads


def check_tp_size(cfg: ArchConfig, tp_size: int, expert_parallel: bool = False) -> None:
    """Raise `ValueError` naming the first size ``tp_size`` ranks cannot split evenly (an MoE
    model's experts or their features by ``expert_parallel``, `pkgd.runner.layers.moe`)."""
    tp = TPGroup(0, tp_size, expert_parallel)
    tp.shard(cfg.num_attention_heads, "num_attention_heads")
    kv_heads_per_rank(cfg.num_key_value_heads, tp)
    check_moe_tp_size(cfg.raw, cfg.intermediate_size, tp)
    if not moe_sizes(cfg.raw, cfg.intermediate_size)[0] or "moe_intermediate_size" in cfg.raw:
        tp.shard(cfg.intermediate_size, "intermediate_size")  # the dense MLPs'
    tp.shard(cfg.vocab_size, "vocab_size")


class LlamaAttention(nn.Module):
    """GQA self-attention of layer ``layer_idx``: ``sliding_window`` its window in tokens (from
    `ArchConfig.window_of`; 0 = none), ``soft_cap`` its attention-logit cap (0 = none; a
    subclass sets it), both applied by `paged_attention`."""

    qk_norm = False
    o_proj_bias_follows_attention_bias = True

    def __init__(self, cfg: ArchConfig, tp: TPGroup, dtype: torch.dtype, kernels=None, layer_idx: int = 0) -> None:
        super().__init__()
        self.kernels = kernels
        self.head_dim = d = cfg.head_dim
        self.num_heads = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads, kv_shards = kv_heads_per_rank(cfg.num_key_value_heads, tp)
        self.scale = d**-0.5
        self.sliding_window = cfg.window_of(layer_idx)
        self.soft_cap = 0.0
        self.qkv_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d],
            bias=cfg.attention_bias,
            tp=tp,
            part_shards=[tp.size, kv_shards, kv_shards],
            dtype=dtype,
            kernels=kernels,
        )
        o_bias = cfg.attention_bias and self.o_proj_bias_follows_attention_bias
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, bias=o_bias, tp=tp, dtype=dtype, kernels=kernels
        )
        if self.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, kernels)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, kernels)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, rope: RopeStep, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t, d = h.shape[0], self.head_dim
        qkv = self.qkv_proj(h)
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        v = qkv[:, q_size + kv_size :].view(t, -1, d)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, d)).view(t, q_size)
            k = self.k_norm(k.reshape(-1, d)).view(t, kv_size)
        q, k = pk.rotary_embedding(
            positions, q, k, d, rope.table.cos_sin_cache, rope.table.is_neox, plan=rope.plan, kernels=self.kernels
        )
        out = paged_attention(
            q.view(t, -1, d), k.view(t, -1, d), v, kv_cache, meta, self.scale, self.kernels,
            sliding_window=self.sliding_window, soft_cap=self.soft_cap,
        )  # fmt: skip
        return self.o_proj(out.view(t, q_size))


class LlamaMLP(nn.Module):
    """Gated MLP: ``down(act(gate(h)) * up(h))``, SwiGLU here (``hidden_act`` silu); a
    subclass names its activations and overrides `act_and_mul`."""

    activations: tuple[str, ...] = ("silu",)

    def __init__(self, cfg: ArchConfig, tp: TPGroup, dtype: torch.dtype, kernels=None) -> None:
        super().__init__()
        self.kernels = kernels
        if cfg.hidden_act not in self.activations:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only {', '.join(self.activations)})")
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [i, i], bias=cfg.mlp_bias, tp=tp, dtype=dtype, kernels=kernels
        )
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp, dtype=dtype, kernels=kernels)

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2*I]`` (gate | up) -> ``[T, I]``."""
        return pk.silu_and_mul(gate_up, kernels=self.kernels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(h)))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    mlp_cls: type[LlamaMLP] = LlamaMLP

    def __init__(self, cfg: ArchConfig, tp: TPGroup, dtype: torch.dtype, kernels=None, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, tp, dtype, kernels, layer_idx)
        self.mlp = self.build_mlp(cfg, tp, dtype, kernels, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)

    def forward(self, h, residual, positions: torch.Tensor, rope: RopeStep, kv_cache: KVCache, meta: AttentionMetadata):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def build_mlp(self, cfg: ArchConfig, tp: TPGroup, dtype: torch.dtype, kernels, layer_idx: int) -> nn.Module:
        """The layer's MLP (``forward(h [T, H]) -> [T, H]``): ``mlp_cls`` (SwiGLU here, GeGLU for
        Gemma); MoE families override."""
        return self.mlp_cls(cfg, tp, dtype, kernels)


class LlamaForCausalLM(nn.Module):
    """The whole model. Parameter names follow HF's, with q/k/v fused into ``qkv_proj`` and
    gate/up into ``gate_up_proj`` (`load_weights` maps them). ``kernels``: the loaded
    `pkgd_kernels.cpu.CpuKernels` (CPU only; None = PyTorch ops), handed to every layer."""

    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # False for a pooling model (the loader sets it): a checkpoint without lm_head.weight loads.
    requires_lm_head = True
    # Whether `CpuDecodeStep` computes this family's layers (False where they are not Llama's).
    one_call_decode = True

    def __init__(
        self, cfg: ArchConfig, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32, kernels=None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.dtype = dtype
        self.kernels = kernels
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype, tied=cfg.tie_word_embeddings, kernels=kernels
        )
        tied = self.lm_head.embedding_rows if cfg.tie_word_embeddings else None
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype, tied_rows=tied)
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, tp, dtype, kernels, layer_idx=i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        # Q/K rows are loaded in the adjacent-pair layout (`to_interleaved`): GPT-J-style RoPE.
        self.rotary_emb = RotaryEmbedding(
            cfg.rot_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, is_neox=False
        )
        self.cpu_decode: CpuDecodeStep | None = None
        # Set by `pkgd.runner.lora.manager.LoRAManager` when adapters are served: the one-call
        # decode step computes the base model only, so it steps aside while a token uses one.
        self.lora_step: Any = None

    def process_weights_after_loading(self) -> None:
        """Called after every submodule's own: on CPU, set up the one-call decode step
        (`pkgd.runner.models.cpu_decode`) when the model qualifies."""
        self.cpu_decode = CpuDecodeStep.build(self)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.cpu_decode is not None and (self.lora_step is None or not self.lora_step.any_active):  # CPU only
            out = self.cpu_decode(h, positions, kv_caches, meta)
            if out is not None:
                return out
        return self.forward_layers(h, positions, kv_caches, meta)

    def forward_layers(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Embeddings ``h [T, H]`` -> hidden states ``[T, H]`` after the final norm, layer by
        layer (writing this step's K/V into ``kv_caches``): the reference of the one-call
        decode step."""
        r = self.rotary_emb
        rope = RopeStep(r, plan_rotary(positions, r.cos_sin_cache, r.is_neox))
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, positions, rope, kv_cache, meta)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H] -> logits [N, V]`` in float32."""
        return self.lm_head(hidden).float()

    # ---- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (full, unsharded; any float dtype).

        Raises:
            ValueError: an unknown name, a shape mismatch, or parameters left unloaded
                (the message lists them).
        """
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._load_one(name, tensor)
            if target:
                loaded.add(target)
        missing = set(self._expected_names()) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")

    def _expected_names(self) -> list[str]:
        names = ["model.norm.weight"]
        if self.requires_lm_head or self.cfg.tie_word_embeddings:
            names.append("lm_head.weight")  # tied: loaded from model.embed_tokens.weight
        if not self.cfg.tie_word_embeddings:
            names.append("model.embed_tokens.weight")
        for i, layer in enumerate(cast(Iterable[LlamaDecoderLayer], self.layers)):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            names += self._mlp_names(p, layer)
            if layer.self_attn.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def _mlp_names(self, prefix: str, layer: LlamaDecoderLayer) -> list[str]:
        """The checkpoint names of ``layer``'s MLP weights (``prefix``: ``model.layers.{i}.``)."""
        return [prefix + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]

    def _load_one(self, name: str, t: torch.Tensor) -> str | None:
        if "rotary_emb" in name:
            return None
        if name == "model.embed_tokens.weight":
            if self.cfg.tie_word_embeddings:
                self.lm_head.load(t)
                return "lm_head.weight"
            self.embed_tokens.load(t)
            return name
        if name == "lm_head.weight":
            if not self.cfg.tie_word_embeddings:
                self.lm_head.load(t)
            return name
        if name == "model.norm.weight":
            _copy(self.norm.weight, t, name)
            return name
        if not name.startswith("model.layers."):
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        idx_str, _, rest = name[len("model.layers.") :].partition(".")
        layer = cast(LlamaDecoderLayer, self.layers[int(idx_str)])  # built from layer_cls
        self._load_layer_tensor(layer, rest, self._to_pair_layout(rest, t), name)
        return name

    def _load_layer_tensor(self, layer: LlamaDecoderLayer, rest: str, t: torch.Tensor, full_name: str) -> None:
        """Load one tensor of a decoder layer (``rest``: its name after ``model.layers.{i}.``);
        MoE families take their MLP tensors here first."""
        _load_layer(layer, rest, t, full_name)

    def _to_pair_layout(self, rest: str, t: torch.Tensor) -> torch.Tensor:
        """Q/K projection rows (and QK-norm weights) in the adjacent-pair RoPE layout."""
        c = self.cfg
        if rest.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
            heads = c.num_attention_heads if rest.startswith("self_attn.q") else c.num_key_value_heads
            return to_interleaved(t, heads, c.head_dim, c.rot_dim)
        if rest.startswith(("self_attn.q_norm.", "self_attn.k_norm.")):
            return to_interleaved(t, 1, c.head_dim, c.rot_dim)
        return t


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _load_layer(layer: LlamaDecoderLayer, rest: str, t: torch.Tensor, full_name: str) -> None:
    module, _, kind = rest.rpartition(".")
    group, _, proj = module.partition(".")
    mlp = layer.mlp if isinstance(layer.mlp, LlamaMLP) else None  # None: an MoE layer's
    if group == "self_attn" and proj in _QKV:
        layer.self_attn.qkv_proj.load_part(_QKV[proj], t, kind)
    elif group == "self_attn" and proj == "o_proj":
        layer.self_attn.o_proj.load(t, kind)
    elif group == "self_attn" and proj in ("q_norm", "k_norm") and layer.self_attn.qk_norm:
        _copy(getattr(layer.self_attn, proj).weight, t, full_name)
    elif group == "mlp" and proj in _GATE_UP and mlp is not None:
        mlp.gate_up_proj.load_part(_GATE_UP[proj], t, kind)
    elif group == "mlp" and proj == "down_proj" and mlp is not None:
        mlp.down_proj.load(t, kind)
    elif module.endswith("layernorm") and kind == "weight" and isinstance(getattr(layer, module, None), RMSNorm):
        _copy(getattr(layer, module).weight, t, full_name)  # Gemma's layers have two more
    else:
        raise ValueError(f"unexpected tensor {full_name!r} in checkpoint")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} does not match the model's {tuple(dst.shape)}")
    dst.copy_(src)
