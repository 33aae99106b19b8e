"""Tiny random-weight Llama / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE checkpoints built with transformers
(test helper)."""

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
    """The transformers config of a tiny ``arch``; ``sizes`` override `TINY`'s."""
    import transformers as tf

    TINY = {**globals()["TINY"], **sizes}

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
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return model
