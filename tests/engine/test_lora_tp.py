"""LoRA over tensor parallelism: tp=2 (a real worker process, gloo) with two adapters in one
batch gives transformers + peft's greedy tokens, so the adapters' shards (B's rows on the
column-parallel Q/K/V and gate/up, A's columns on the row-parallel o/down, added before the
all-reduce) add up to the whole update."""

import pytest

pytest.importorskip("pkgd.runner.tp_executor")

from tests.runner.lora_adapters import greedy, make_adapter  # noqa: E402
from tests.runner.tiny_models import build_tiny  # noqa: E402

from pkgd import LLM, LoRARequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


def test_tp2_lora_matches_peft(tmp_path):
    hf = build_tiny("llama", tmp_path / "base")
    refs = {
        None: hf,
        "a": make_adapter(hf, tmp_path / "a", r=8, seed=1),
        "b": make_adapter(hf, tmp_path / "b", r=4, targets=["k_proj", "o_proj", "up_proj", "down_proj"], seed=2),
    }
    loras = {None: None, "a": LoRARequest("a", 1, str(tmp_path / "a")), "b": LoRARequest("b", 2, str(tmp_path / "b"))}
    prompts = [[5, 6, 7, 8, 9], [100, 3, 42], list(range(10, 40))]
    which = ["a", None, "b"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(
        str(tmp_path / "base"), tensor_parallel_size=2, num_blocks=64, block_size=4, dtype="float32",
        enable_lora=True, max_loras=2, max_lora_rank=8,
    ) as llm:  # fmt: skip
        outs = llm.generate(prompts, params, lora_request=[loras[w] for w in which], use_tqdm=False)
    for prompt, w, out in zip(prompts, which, outs, strict=True):
        assert list(out.outputs[0].token_ids) == greedy(refs[w], prompt, 8), f"adapter {w}"
