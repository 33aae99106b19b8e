"""Conversion of a GGUF file into an HF-layout directory (torch-free: numpy + gguf), in two steps.

`convert_gguf` writes what every use of the file needs, into ``out_dir`` (an empty temporary
directory; `resolve.converted_dir` renames it into the cache once this returns):

* ``config.json`` from the GGUF metadata (``{arch}.block_count``, ``.embedding_length``,
  ``.attention.head_count`` ...), ``tie_word_embeddings`` when the file has no ``output.weight``.
* ``tokenizer.json`` built by transformers' GGUF tokenizer conversion (the vocabulary, merges,
  pre-tokenizer split and special tokens stored in the file), ``tokenizer_config.json`` with the
  special tokens and ``tokenizer.chat_template``, and ``generation_config.json`` with the
  BOS/EOS ids.

`write_float_weights` writes ``model.safetensors``, only when the weights are to run as floats
(``model.quantization: none``, or a file the quantized kernels cannot read; the runner reads
quantized blocks straight from the GGUF otherwise): every tensor dequantized to float32 with
`gguf.quants.dequantize` (exact: Q4_1/Q8_0 values are fp16 scale × int + fp16 offset, all
representable in fp32), renamed to the HF names, and for llama-family attention with
llama.cpp's Q/K row permutation undone. llama.cpp's ``convert_hf_to_gguf.py``
(``LlamaModel.permute``) reorders each head's rows from HF's rotate-half layout to interleaved
pairs, ``w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2)``; `unpermute_qk` is its
inverse. Qwen2/Qwen3, Gemma 2/3 and Phi-3 files are written without the permutation.

Families beyond Llama's layout: llama.cpp writes Mistral as ``llama`` (a
``llama.attention.sliding_window`` becomes the window); ``gemma2``/``gemma3`` name Gemma's two
extra norms (``post_attention_norm``, ``post_ffw_norm``; their ``ffn_norm`` is the
pre-feed-forward norm) and store every norm weight as ``1 + w`` (llama.cpp's converter adds
the 1), which is taken back off here so the tensors are HF's; ``phi3`` keeps the fused
``attn_qkv`` and ``ffn_up`` (gate | up) tensors and LongRoPE's factors as the tensors
``rope_factors_long`` / ``rope_factors_short``, read into the config.

MoE files (Mixtral, written as ``llama`` with ``llama.expert_count``; ``qwen3moe``) hold each
layer's experts stacked, ``ffn_{gate,up,down}_exps [E, ...]``, and the router ``ffn_gate_inp``;
they are written out under the HF per-expert names (`moe_hf_names`) that the model's loader
stacks again (`pkgd.runner.loader.gguf_weights` reads the same names when it keeps the blocks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pkgd.model_files.errors import ModelSourceError

if TYPE_CHECKING:
    from pkgd.model_files.gguf_index import GGUFTensor

# GGUF general.architecture -> (HF architectures name, HF model_type, undo Q/K permutation).
_ARCHES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
}
# llama.cpp writes Mixtral as a "llama" file with {arch}.expert_count set.
_MIXTRAL = ("MixtralForCausalLM", "mixtral")

# MoE tensors (llama.cpp's stacked layout): the router ``ffn_gate_inp [E, H]`` and each stacked
# ``ffn_{gate,up,down}_exps [E, ...]``, split into the HF per-expert names of the model type:
# its block prefix and the names of each expert's gate/up/down.
_EXPERT_PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_MOE_LAYOUT = {
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
# Per-architecture GGUF layer names that differ from `_LAYER_NAMES`.
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Tensors that are configuration, not weights (read by `gguf_config`).
CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})
# Architectures whose norm weights llama.cpp stores as 1 + w (`norm_shift`).
_NORM_SHIFTED = frozenset({"gemma2", "gemma3"})

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Any = None) -> None:
    """Write the config and tokenizer files of ``gguf_path`` into ``out_dir``.

    ``progress`` (a `pkgd.phases.Phase`) is told two steps: the config, then the tokenizer.

    Raises:
        ModelSourceError: the file is not a readable GGUF, its architecture is not one of
            llama/qwen2/qwen3/qwen3moe/gemma2/gemma3/phi3, or it uses a feature this converter does not handle.
    """
    reader, meta, arch = read_gguf(gguf_path)
    config = gguf_config(meta, arch, {t.name for t in reader.tensors}, _rope_factors(reader))
    if progress is not None:
        progress.set_total(2)
        progress.note(tensors=len(reader.tensors))
    _write_json(out_dir / "config.json", config)
    if progress is not None:
        progress.advance()
    _write_tokenizer(meta, arch, config, out_dir, gguf_path)
    if progress is not None:
        progress.advance()


def write_float_weights(gguf_path: Path, out_path: Path, progress: Any = None) -> None:
    """Write every tensor of ``gguf_path`` dequantized to float32, HF-named, as safetensors at
    ``out_path``. ``progress`` is told one step per tensor, then one for writing the file.

    Raises:
        ModelSourceError: as `convert_gguf`, or a tensor that cannot be dequantized.
    """
    reader, meta, arch = read_gguf(gguf_path)
    config = gguf_config(meta, arch, {t.name for t in reader.tensors}, _rope_factors(reader))
    if progress is not None:
        progress.set_total(len(reader.tensors) + 1)
    tensors = _dequantized_tensors(reader, config, arch, gguf_path, progress)
    from safetensors.numpy import save_file

    save_file(tensors, str(out_path), metadata={"format": "pt"})
    if progress is not None:
        progress.advance()


def read_gguf(gguf_path: Path) -> tuple[Any, dict[str, Any], str]:
    """``(reader, metadata, architecture)`` of a GGUF file (`gguf.GGUFReader`, memory-mapped).

    Raises:
        ModelSourceError: not a readable GGUF, or an architecture other than
            llama/qwen2/qwen3/qwen3moe/gemma2/gemma3/phi3.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_path)
        meta = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as e:  # the gguf package raises ValueError/struct errors/IndexError
        raise ModelSourceError(f"model source {str(gguf_path)!r}: {gguf_path} is not a valid GGUF file ({e})") from e
    return reader, meta, _supported_arch(gguf_path, meta.get("general.architecture"))


def read_gguf_tensors(gguf_path: Path) -> tuple[list[GGUFTensor], str]:
    """``(tensors, architecture)`` of a GGUF file, without its other metadata
    (`pkgd.model_files.gguf_index.scan_gguf`: the same tensors as `read_gguf`'s reader, seconds
    sooner for a file with a tokenizer).

    Raises:
        ModelSourceError: as `read_gguf`.
    """
    from pkgd.model_files.gguf_index import scan_gguf  # imports gguf, as read_gguf does

    try:
        index = scan_gguf(gguf_path)
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"model source {str(gguf_path)!r}: {gguf_path} is not a valid GGUF file ({e})") from e
    return index.tensors, _supported_arch(gguf_path, index.architecture)


def _supported_arch(gguf_path: Path, arch: Any) -> str:
    if arch not in _ARCHES:
        raise ModelSourceError(
            f"model source {str(gguf_path)!r}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(_ARCHES))}"
        )
    return str(arch)


def permutes_qk(arch: str) -> bool:
    """Whether llama.cpp stored this architecture's Q/K rows permuted (`unpermute_qk`)."""
    return _ARCHES[arch][2]


def norm_shift(arch: str) -> float:
    """What llama.cpp added to this architecture's norm weights (subtract it for HF's)."""
    return 1.0 if arch in _NORM_SHIFTED else 0.0


def _rope_factors(reader: Any) -> dict[str, list[float]]:
    """LongRoPE's factor tensors of a GGUF (Phi-3), by tensor name."""
    return {
        t.name: [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
        for t in reader.tensors
        if t.name in CONFIG_TENSORS
    }


def gguf_config(
    meta: dict[str, Any], arch: str, tensor_names: set[str], rope_factors: dict[str, list[float]] | None = None
) -> dict[str, Any]:
    """The HF ``config.json`` dict for a GGUF's metadata (``rope_factors``: LongRoPE's factor
    tensors by name, where the file has them)."""
    hf_arch, model_type, _ = _ARCHES[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if "rope_freqs.weight" in tensor_names:
        raise ModelSourceError(
            "GGUF files with a rope_freqs tensor (llama3 rope scaling) are not supported; "
            "use the model's Hugging Face directory instead"
        )
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": int(get("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelSourceError(f"GGUF rope scaling {scaling!r} is not supported (supported: linear)")
    if model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        cfg["mlp_bias"] = False
    if model_type in ("qwen3", "qwen3_moe"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    experts = int(get("expert_count", 0) or 0)
    if experts:
        _moe_config(cfg, arch, get, experts)
        if arch == "qwen3moe":  # a layer without a router keeps a dense MLP
            layers = range(cfg["num_hidden_layers"])
            cfg["mlp_only_layers"] = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    window = get("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    if arch in ("gemma2", "gemma3"):
        _gemma_config(cfg, get, arch)
    if arch == "phi3":
        _phi3_config(cfg, get, rope_factors or {})
    for key, name in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[name] = int(value)
    return cfg


def _moe_config(cfg: dict[str, Any], arch: str, get: Any, experts: int) -> None:
    """The MoE keys of an HF config, from ``{arch}.expert_count`` / ``.expert_used_count`` /
    ``.expert_feed_forward_length``: a llama file with experts is Mixtral (each expert of
    ``feed_forward_length``); a qwen3moe file's top-k weights are renormalised (llama.cpp's
    graph for it always does, unless ``.expert_weights_norm`` says otherwise)."""
    used = int(get("expert_used_count"))
    if arch == "llama":
        cfg["architectures"], cfg["model_type"] = [_MIXTRAL[0]], _MIXTRAL[1]
        cfg.update(num_local_experts=experts, num_experts_per_tok=used)
    elif arch == "qwen3moe":
        cfg.update(
            num_experts=experts,
            num_experts_per_tok=used,
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            norm_topk_prob=bool(get("expert_weights_norm", True)),
        )
    else:
        raise ModelSourceError(f"GGUF architecture {arch!r} with experts is not supported (Mixtral, Qwen3-MoE are)")


def moe_hf_names(gguf_name: str, config: dict[str, Any]) -> list[str] | None:
    """HF names of an MoE tensor of a GGUF of ``config`` (from `gguf_config`): one for the router
    ``blk.N.ffn_gate_inp``, one per expert (in order) for a stacked ``blk.N.ffn_*_exps``; None
    for any other tensor or a dense model."""
    layout = _MOE_LAYOUT.get(config.get("model_type", ""))
    m = _BLOCK.match(gguf_name)
    if layout is None or m is None:
        return None
    layer, part, kind = m.groups()
    prefix = f"model.layers.{layer}.{layout[0]}."
    if part == "ffn_gate_inp":
        return [f"{prefix}gate.{kind}"]
    if part not in _EXPERT_PARTS:
        return None
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    return [f"{prefix}experts.{e}.{layout[1][_EXPERT_PARTS[part]]}.{kind}" for e in range(experts)]


def _gemma_config(cfg: dict[str, Any], get: Any, arch: str) -> None:
    """Gemma 2/3 keys. The attention scale is llama.cpp's: ``1/sqrt(head_dim)``, but
    ``1/sqrt(hidden / heads)`` for the 27B models (46 and 62 layers), as their HF configs'
    ``query_pre_attn_scalar`` say."""
    cfg["hidden_act"] = cfg["hidden_activation"] = "gelu_pytorch_tanh"
    big = cfg["num_hidden_layers"] == {"gemma2": 46, "gemma3": 62}[arch]
    cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = get(key)
        cfg[key] = float(value) if value is not None else None
    if arch == "gemma3":
        cfg["attn_logit_softcapping"] = None
        cfg["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
        cfg["sliding_window_pattern"] = 6


def _phi3_config(cfg: dict[str, Any], get: Any, factors: dict[str, list[float]]) -> None:
    """Phi-3 keys: partial rotary from ``rope.dimension_count``, LongRoPE from the factor
    tensors and ``rope.scaling.original_context_length`` / ``.attn_factor``."""
    rot = get("rope.dimension_count")
    if rot:
        cfg["partial_rotary_factor"] = int(rot) / cfg["head_dim"]
    original = get("rope.scaling.original_context_length")
    if original:
        cfg["original_max_position_embeddings"] = int(original)
    if factors:
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"],
            "original_max_position_embeddings": int(original or cfg["max_position_embeddings"]),
        }
        attn = get("rope.scaling.attn_factor")
        if attn is not None:
            scaling["attention_factor"] = float(attn)
        cfg["rope_scaling"] = scaling


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K weight/bias.

    ``w`` is ``[n_head * head_dim, ...]`` (floats, or a quantized tensor's rows of blocks: only
    rows move); llama.cpp stored, per head, the two rotate-half halves interleaved. Returns the
    HF layout (same shape and dtype).
    """
    d = w.shape[0]
    return w.reshape(n_head, d // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name of a GGUF tensor name of architecture ``arch``, None when it has no
    HF counterpart."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        module = _ARCH_LAYER_NAMES.get(arch, {}).get(part) or _LAYER_NAMES.get(part)
        if module is None:
            return None
        return f"model.layers.{layer}.{module}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[base]}.{kind}" if base in _TOP_NAMES else None


def _dequantized_tensors(
    reader: Any, config: dict[str, Any], arch: str, gguf_path: Path, progress: Any
) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    permute, shift = permutes_qk(arch), norm_shift(arch)
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name in CONFIG_TENSORS:
            if progress is not None:
                progress.advance()
            continue
        names = moe_hf_names(t.name, config)
        name = hf_name(t.name, arch) if names is None else names[0]
        if name is None:
            raise ModelSourceError(f"model source {str(gguf_path)!r}: unexpected GGUF tensor {t.name!r}")
        try:
            arr = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise ModelSourceError(f"model source {str(gguf_path)!r}: cannot dequantize {t.name} ({e})") from e
        if names is not None and arr.ndim == 3:  # stacked experts [E, rows, cols]: one tensor each
            if arr.shape[0] != len(names):
                raise ModelSourceError(
                    f"model source {str(gguf_path)!r}: {t.name} stacks {arr.shape[0]} experts, "
                    f"the metadata says {len(names)}"
                )
            out.update((n, np.ascontiguousarray(a)) for n, a in zip(names, arr))
            if progress is not None:
                progress.advance()
            continue
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_qk(arr, config["num_attention_heads"])
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_qk(arr, config["num_key_value_heads"])
        elif shift and name.endswith("norm.weight"):
            arr = arr - np.float32(shift)
        out[name] = np.ascontiguousarray(arr)
        if progress is not None:
            progress.advance()
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - out.keys()
    if missing:
        raise ModelSourceError(f"model source {str(gguf_path)!r}: GGUF lacks {', '.join(sorted(missing))}")
    return out


def _write_tokenizer(meta: dict[str, Any], arch: str, config: dict[str, Any], out_dir: Path, gguf_path: Path) -> None:
    """tokenizer.json + tokenizer_config.json + generation_config.json from GGUF metadata."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    groups = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in tok_dict:
        raise ModelSourceError(f"model source {str(gguf_path)!r}: GGUF has no tokenizer (tokenizer.ggml.tokens)")
    try:
        backend, _ = convert_gguf_tokenizer(arch, tok_dict)
    except (ValueError, KeyError) as e:
        raise ModelSourceError(f"model source {str(gguf_path)!r}: cannot build its tokenizer ({e!r})") from e
    backend.save(str(out_dir / "tokenizer.json"))
    tokens = tok_dict["tokens"]
    specials = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unk_token_id"),
        ("pad_token", "pad_token_id"),
    ):
        if key in tok_dict:
            specials[name] = tokens[int(tok_dict[key])]
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(tok_config.get("add_bos_token", False)),
        "add_eos_token": bool(tok_config.get("add_eos_token", False)),
        **specials,
        **({"chat_template": tok_config["chat_template"]} if "chat_template" in tok_config else {}),
    }
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    gen: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out_dir / "generation_config.json", gen)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
