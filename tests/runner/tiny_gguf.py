"""Write a tiny GGUF from a transformers model the way llama.cpp's converter does (test helper):
llama-family (and Mistral, written as llama) Q/K rows permuted to llama.cpp's interleaved
rotary layout, Gemma's norm weights stored as 1 + w and its extra norms under their GGUF names,
Phi-3's fused tensors and LongRoPE factors as llama.cpp names them, 2-D weights optionally
quantized (Q8_0, or any of Q4_0/Q4_1/Q8_0/Q4_K/Q6_K per tensor), a byte-level BPE tokenizer
with ChatML specials and a chat template.

The gguf package quantizes Q4_0/Q4_1/Q8_0 only; `quantize_blocks` adds plain Q4_K and Q6_K
quantizers (per-sub-block min/max and absmax scales, not llama.cpp's searched ones: valid
blocks of those formats, all that the tests need)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h i", "\u0120 t"]

_GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "mixtral": "llama",
    "qwen3_moe": "qwen3moe",
}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # an MoE router
}
_ARCH_LAYER = {
    "gemma2": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_ARCH_LAYER["gemma3"] = _ARCH_LAYER["gemma2"]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str, arch: str = "llama") -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_ARCH_LAYER.get(arch, {}).get(module) or _LAYER[module]}.{kind}"


def _tensors(model):
    """``(HF-ish name, float32 array)`` of ``model``'s weights; transformers' stacked MoE experts
    (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) as llama.cpp's
    ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` (given as GGUF names)."""
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = name.split(".")[2]
            half = a.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", a[:, :half].copy()
            yield f"blk.{layer}.ffn_up_exps.weight", a[:, half:].copy()
        elif name.endswith("mlp.experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", a
        else:
            yield name, a


def _tokens(vocab: int) -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = [c for _, c in sorted(bytes_to_unicode().items())]
    return SPECIALS + chars[: vocab - len(SPECIALS) - len(MERGES)] + [m.replace(" ", "") for m in MERGES]


def _q4_k(a: np.ndarray) -> np.ndarray:
    n = a.shape[0] * a.shape[1] // 256
    x = a.reshape(n, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15.0
    d, dmin = scale.max(-1) / 63.0, (-lo).max(-1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    df, dminf = d16.astype(np.float32)[:, None], dmin16.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.clip(
        np.round(np.divide(x + (dminf * mn)[..., None], step, out=np.zeros_like(x), where=step > 0)), 0, 15
    ).astype(np.uint8)
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    qs = q.reshape(n, 4, 2, 32)
    qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(n, 128)
    blocks = np.concatenate([d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2), scales, qs], axis=1)
    return blocks.reshape(a.shape[0], -1)


def _q6_k(a: np.ndarray) -> np.ndarray:
    n = a.shape[0] * a.shape[1] // 256
    x = a.reshape(n, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31.0
    d16 = (scale.max(-1) / 127.0).astype(np.float16)
    df = d16.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = (np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 2, 128)  # halves h: input h*128 + r
    ql = q[:, :, :64] & 15 | ((q[:, :, 64:] & 15) << 4)
    hi = (q >> 4).reshape(n, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    blocks = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d16.view(np.uint8).reshape(n, 2)], axis=1
    )
    return blocks.reshape(a.shape[0], -1)


def quantize_blocks(a: np.ndarray, qtype: str) -> np.ndarray:
    """Rows of GGUF blocks of type ``qtype`` for the float matrix ``a [rows, k]``."""
    import gguf

    if qtype == "Q4_K":
        return _q4_k(a)
    if qtype == "Q6_K":
        return _q6_k(a)
    return gguf.quants.quantize(a, getattr(gguf.GGMLQuantizationType, qtype))


def write_gguf(model, path: Path, *, quantize: bool | str | Callable[[str], str | None] = False) -> Path:
    """Write ``model`` (a transformers model of a supported family) as a GGUF file at ``path``. With
    ``quantize`` every 2-D weight is quantized: to Q8_0 (True), to the type named, or to what
    the callable returns for its GGUF name (None: float32)."""
    import gguf

    cfg = model.config
    arch = _GGUF_ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _add_family_keys(w, cfg, arch)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(_tokens(cfg.vocab_size))
    w.add_token_types([3] * len(SPECIALS) + [1] * (cfg.vocab_size - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    experts = getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            w.add_expert_weights_norm(cfg.norm_topk_prob)
    for name, a in _tensors(model):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, cfg.num_key_value_heads)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp's Gemma converters store 1 + w
        gname = name if name.startswith("blk.") else _gguf_name(name, arch)
        qtype = (
            (quantize(gname) if callable(quantize) else "Q8_0" if quantize is True else quantize or None)
            if a.ndim in (2, 3)
            else None
        )
        if qtype:  # a stacked [E, rows, k] tensor: each expert's rows of blocks
            q = quantize_blocks(a.reshape(-1, a.shape[-1]), qtype)
            q = q.reshape(*a.shape[:-1], q.shape[-1])
            w.add_tensor(gname, q, raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_family_keys(w, cfg, arch: str) -> None:
    """RoPE, window and soft-cap keys as llama.cpp's converters write them; Phi-3's LongRoPE
    factors as the tensors ``rope_factors_long`` / ``rope_factors_short``."""
    import math

    rope = cfg.rope_parameters
    if arch == "gemma3":
        w.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
        w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        if rope["full_attention"].get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf_scaling("linear"))
            w.add_rope_scaling_factor(float(rope["full_attention"]["factor"]))
    else:
        w.add_rope_freq_base(float(rope["rope_theta"]))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(int(cfg.sliding_window))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
    if arch in ("gemma2", "gemma3") and cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    if arch == "phi3":
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            original = int(rope["original_max_position_embeddings"])
            w.add_rope_scaling_orig_ctx_len(original)
            scale = cfg.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def gguf_scaling(name: str):
    import gguf

    return {"linear": gguf.RopeScalingType.LINEAR}[name]
