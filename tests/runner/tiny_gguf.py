"""Write a tiny GGUF from a transformers model the way llama.cpp's converter does (test helper):
llama-family Q/K rows permuted to llama.cpp's interleaved rotary layout, 2-D weights optionally
quantized to Q8_0, a byte-level BPE tokenizer with ChatML specials and a chat template."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h i", "\u0120 t"]

_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _tokens(vocab: int) -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = [c for _, c in sorted(bytes_to_unicode().items())]
    return SPECIALS + chars[: vocab - len(SPECIALS) - len(MERGES)] + [m.replace(" ", "") for m in MERGES]


def write_gguf(model, path: Path, *, quantize: bool = False) -> Path:
    """Write ``model`` (a transformers Llama/Qwen2/Qwen3) as a GGUF file at ``path``."""
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
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
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
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, cfg.num_key_value_heads)
        if quantize and a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
