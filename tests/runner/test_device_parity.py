"""On a CUDA device in float16 / bfloat16: pkgd's logits on the paged cache against transformers'.

Skipped without CUDA (``benchmarks/gpu_check.sh`` runs it on a GPU host). The bound calibrates
itself: in 16 bits neither implementation reproduces the float32 logits, so pkgd's error
against transformers in float32 (same weights, same tokens) must stay within twice the error of
transformers' own forward in the same 16-bit dtype on the same device, plus a small floor for
steps where both round to (almost) nothing. Each sampled token must be the argmax of pkgd's own
logits (greedy), whatever transformers would pick.
"""

from __future__ import annotations

import pytest
import torch
from tests.runner.conftest import LogitsRecorder
from tests.runner.driver import Driver

from pkgd.config.vllm_config import VllmConfig
from pkgd.model_files.resolve import resolve_model
from pkgd.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh)")

ARCHES = ["llama", "llama-untied", "qwen2", "qwen3"]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
FLOOR = 1e-3  # logits of these tiny models are O(1): a thousandth is below either dtype's rounding


def _prompt(seed: int, n: int, vocab: int = 160) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _hf_logits(hf, tokens: list[int], device: str, dtype: torch.dtype) -> torch.Tensor:
    model = hf.to(device=device, dtype=dtype)
    with torch.no_grad():
        return model(torch.tensor([tokens], device=device)).logits[0].float().cpu()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prompt", "chunked-prefill"])
def test_prompt_and_decodes_on_cuda_within_twice_transformers_own_16_bit_error(tiny_dirs, arch, dtype, chunk):
    model_dir, hf = tiny_dirs(arch)
    cfg = VllmConfig(model={"source": str(model_dir), "dtype": dtype}, parallel={"device": "cuda"})
    from pkgd.runner.model_runner import ModelRunner

    runner = ModelRunner(cfg, resolve_model(cfg.model), device=torch.device("cuda"))
    rec = LogitsRecorder(runner)
    drv = Driver(runner, num_blocks=32, block_size=4)
    prompt = _prompt(1, 23)
    drv.add("a", prompt, SamplingParams(temperature=0.0, max_tokens=6))
    outputs = drv.run(chunk=chunk)["a"]
    ours = torch.stack([c[0].float().cpu() for c in rec.calls])
    assert len(outputs) == 6 and ours.shape[0] == 6
    assert [int(row.argmax()) for row in ours] == outputs
    rows = slice(len(prompt) - 1, len(prompt) - 1 + len(outputs))
    text = prompt + outputs[:-1]
    want = _hf_logits(hf, text, "cuda", torch.float32)[rows]
    theirs = _hf_logits(hf, text, "cuda", DTYPES[dtype])[rows]
    hf.to(device="cpu", dtype=torch.float32)  # the session's shared model goes back as it was
    our_err, their_err = (ours - want).abs().max().item(), (theirs - want).abs().max().item()
    assert our_err <= 2 * their_err + FLOOR, f"pkgd {dtype} max |diff| {our_err:.2e}, transformers {their_err:.2e}"
