"""GGUF files of the dense families beyond Llama/Qwen, written as llama.cpp's converters write
them (`tests.runner.tiny_gguf`: Mistral as ``llama`` with its window, Gemma's 1 + w norms and
extra norm names, Phi-3's fused tensors and LongRoPE factor tensors), Q8_0 2-D weights.

Dequantized (``model.quantization: none``): every tensor equals transformers' within Q8_0's
rounding (5e-3: norms exact, so Gemma's 1 + w is taken back off) and the logits of a prompt
longer than the window within 0.1 of transformers' (Q8_0 error through up to 6 layers,
measured max 0.06 for Gemma 3; the
float path's own parity is tests/runner/test_family_parity.py). Kept quantized (``auto``):
the weights stay in Q8_0 blocks and the logits stay within 0.3 (the int8 rounding of each
linear's input besides; tests/runner/test_quantized.py explains the bound).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tests.runner.driver import Driver
from tests.runner.factory import LogitsRecorder, make_runner
from tests.runner.tiny_gguf import write_gguf
from tests.runner.tiny_models import build_tiny

from pkgd.config.sections import ModelConfig
from pkgd.model_files.resolve import ensure_float_weights, resolve_model
from pkgd.runner.layers.quantized import QuantizedLinear
from pkgd.sampling_params import SamplingParams

ARCHES = ["mistral", "phi3", "phi3-longrope", "gemma2", "gemma3"]
PROMPT = list(range(3, 22))  # 19 tokens: past the tiny models' 8-token window
# What a GGUF cannot say differently: llama.cpp takes Gemma's attention scale from head_dim
# (the released 2B-12B models' query_pre_attn_scalar) and Gemma 3's layer pattern as five
# local layers to one global.
GGUF_SIZES = {
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {
        "query_pre_attn_scalar": 32,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
}


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """One model cache for the module: the C kernels it also holds are built once."""
    return str(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="module")
def tiny_family_gguf(tmp_path_factory):
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            d = tmp_path_factory.mktemp(f"gguf-{arch}")
            hf = build_tiny(arch, d / "hf", **GGUF_SIZES.get(arch, {}))
            cache[arch] = (write_gguf(hf, d / f"tiny-{arch}.Q8_0.gguf", quantize=True), hf)
        return cache[arch]

    return get


def _last_logits(runner) -> torch.Tensor:
    rec = LogitsRecorder(runner)
    drv = Driver(runner, num_blocks=16)
    drv.add("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    drv.run()
    return rec.calls[0][0]


def _hf_last(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0, -1]


@pytest.mark.parametrize("arch", ARCHES)
def test_dequantized_gguf_matches_transformers(tiny_family_gguf, model_cache, arch):
    path, hf = tiny_family_gguf(arch)
    mf = resolve_model(ModelConfig(source=str(path), cache_dir=model_cache))
    ensure_float_weights(mf)
    ours = load_file(mf.model_dir / "model.safetensors")
    want = hf.state_dict()
    assert set(ours) == set(want) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    for name, t in ours.items():
        assert (t - want[name]).abs().max() < 5e-3, name
    runner = make_runner(mf.model_dir)
    # llama.cpp writes Mistral as llama: the Llama model with the file's window is the same model
    assert type(runner.model).__name__ == {"mistral": "LlamaForCausalLM"}.get(arch, hf.config.architectures[0])
    windows = {layer.self_attn.sliding_window for layer in runner.model.layers}
    assert windows == ({0} if arch == "phi3-longrope" else {8} if arch in ("mistral", "phi3") else {0, 8})
    assert (_last_logits(runner) - _hf_last(hf)).abs().max() < 0.1


@pytest.mark.parametrize("arch", ARCHES)
def test_quantized_gguf_runs_close_to_transformers(tiny_family_gguf, model_cache, arch):
    path, hf = tiny_family_gguf(arch)
    runner = make_runner(path, cache_dir=model_cache, quantization="gguf")
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert (_last_logits(runner) - _hf_last(hf)).abs().max() < 0.3
