"""Tiny random-weight checkpoints of every supported family, built with transformers (causal LMs
and sequence classifiers), and a word-level tokenizer for them (test helper)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}


def hf_config(arch: str, **sizes):
    """The transformers config of a tiny ``arch``; ``sizes`` override `TINY`'s (for Gemma, any
    of its config's keys)."""
    import transformers as tf

    TINY = {**globals()["TINY"], **{k: v for k, v in sizes.items() if k in globals()["TINY"]}}

    if arch == "llama":
        return tf.LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)
    if arch == "llama-plain":  # default RoPE: what a llama GGUF without rope_freqs describes
        return tf.LlamaConfig(**TINY, tie_word_embeddings=True)
    if arch == "llama-untied":
        return tf.LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    if arch == "qwen2":
        return tf.Qwen2Config(**TINY, tie_word_embeddings=False, rope_theta=1e6)
    if arch == "qwen3":
        return tf.Qwen3Config(**{**TINY, "num_attention_heads": 4}, head_dim=32, tie_word_embeddings=True)
    if arch == "mixtral":  # 4 experts, top 2; the intermediate size is each expert's
        return tf.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "mixtral-window":  # Mixtral with Mistral's sliding window (8 tokens)
        return tf.MixtralConfig(
            **TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False
        )
    if arch == "qwen3-moe":  # 8 experts of 32 features, top 2 unnormalised; layer 1 dense
        return tf.Qwen3MoeConfig(
            **TINY,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        )
    if arch == "qwen3-moe-norm":  # top 2 renormalised (norm_topk_prob); decoder_sparse_step 2: layer 0 dense
        return tf.Qwen3MoeConfig(
            **TINY,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        )
    if arch == "mistral":  # a window of 8 tokens: the tests' longer prompts cross it
        return tf.MistralConfig(**TINY, sliding_window=8, tie_word_embeddings=False)
    if arch == "phi3":  # fused qkv / gate_up, a window of 8 tokens, partial rotary
        return tf.Phi3Config(
            **TINY, sliding_window=8, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=1, bos_token_id=2
        )
    if arch == "phi3-longrope":  # LongRoPE; the short factors (and attention factor) up to 64
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64}
        head_half = TINY["hidden_size"] // TINY["num_attention_heads"] // 2
        rope["short_factor"] = [1.0 + 0.1 * i for i in range(head_half)]
        rope["long_factor"] = [2.0 + 0.5 * i for i in range(head_half)]
        return tf.Phi3Config(
            **TINY, original_max_position_embeddings=64, rope_parameters=rope, pad_token_id=0, eos_token_id=1,
            bos_token_id=2,
        )  # fmt: skip
    if arch == "gemma2":  # local (window 8) / global layers, both soft-caps, GeGLU
        return tf.Gemma2Config(**{
            **TINY, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "pad_token_id": 0, "eos_token_id": 1,
            "bos_token_id": 2, **sizes,
        })  # fmt: skip
    if arch == "gemma3":  # QK-norm, two RoPE tables (the global one scaled), local/local/global
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        }
        return tf.Gemma3TextConfig(**{
            **TINY, "num_hidden_layers": 3, "head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "rope_parameters": rope,
            "final_logit_softcapping": 3.0, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, **sizes,
        })  # fmt: skip
    raise KeyError(arch)


def build_tiny(arch: str, out_dir: Path, seed: int = 0, **sizes):
    """Save a tiny model with every parameter random (biases and norm weights included, so
    each one matters) to ``out_dir``; returns the transformers model (fp32, eval). ``sizes``
    override `TINY`'s."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch, **sizes), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + w: w near 0, the scale near 1 again
                p.copy_((0.0 if arch.startswith("gemma") else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return model
