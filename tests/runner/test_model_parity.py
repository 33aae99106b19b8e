"""Logits of pkgd's models on the paged cache match transformers' forward (fp32, <= 1e-4)."""

from __future__ import annotations

import pytest
import torch
from tests.runner.driver import Driver
from tests.runner.factory import LogitsRecorder, make_runner

from pkgd.sampling_params import SamplingParams

ARCHES = ["llama", "llama-untied", "qwen2", "qwen3"]
TOL = 1e-4
GREEDY6 = SamplingParams(temperature=0.0, max_tokens=6)


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _prompt(seed: int, n: int, vocab: int = 160) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _check(hf, prompt, outputs, logits_seq):
    """``logits_seq[j]`` predicted output j; compare with transformers over the whole text."""
    ref = _hf_logits(hf, prompt + outputs[:-1])
    for j, ours in enumerate(logits_seq):
        want = ref[len(prompt) - 1 + j]
        assert (ours - want).abs().max().item() <= TOL, f"step {j}"
        assert int(ours.argmax()) == outputs[j]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prompt", "chunked-prefill"])
def test_prompt_and_five_decodes_match_transformers(tiny_dirs, arch, chunk, cpu_path):
    model_dir, hf = tiny_dirs(arch)
    runner = make_runner(model_dir)
    assert (runner.cpu_kernels is not None) == (cpu_path is not None)
    rec = LogitsRecorder(runner)
    drv = Driver(runner, num_blocks=32, block_size=4)
    prompt = _prompt(1, 23)
    drv.add("a", prompt, GREEDY6)
    outputs = drv.run(chunk=chunk)["a"]
    assert len(outputs) == 6
    logits = [c[0] for c in rec.calls]
    assert len(logits) == 6  # the LM head ran once per sampled token, on one row
    _check(hf, prompt, outputs, logits)


@pytest.mark.parametrize("arch", ARCHES)
def test_two_requests_batched_with_mixed_prefill_and_decode(tiny_dirs, arch, cpu_path):
    model_dir, hf = tiny_dirs(arch)
    runner = make_runner(model_dir)
    rec = LogitsRecorder(runner)
    drv = Driver(runner, num_blocks=32, block_size=4)
    pa, pb = _prompt(2, 17), _prompt(3, 9)
    drv.add("a", pa, GREEDY6)
    drv.add("b", pb, GREEDY6)
    per_req: dict[str, list[torch.Tensor]] = {"a": [], "b": []}

    def step(**kw):
        n0 = len(rec.calls)
        out = drv.step(**kw)
        rows = [rid for rid, toks in zip(out.req_ids, out.sampled_token_ids) if toks]
        if rows:
            assert len(rec.calls) == n0 + 1 and rec.calls[-1].shape[0] == len(rows)
            for i, rid in enumerate(rows):
                per_req[rid].append(rec.calls[-1][i])

    step(only={"a"})  # a: whole prompt
    step(chunk=5)  # a decodes while b prefills its first 5 tokens (mixed batch)
    while not all(r.done for r in drv.reqs.values()):
        step()
    for rid, prompt in (("a", pa), ("b", pb)):
        outs = drv.reqs[rid].outputs
        assert len(outs) == 6 and len(per_req[rid]) == 6
        _check(hf, prompt, outs, per_req[rid])


def test_prefix_cache_hit_reads_shared_blocks(tiny_dirs):
    """A new request whose first blocks are already cached (num_computed_tokens > 0, block
    ids shared with another request) computes only its tail and matches transformers."""
    from pkgd.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    model_dir, hf = tiny_dirs("qwen3")
    runner = make_runner(model_dir)
    rec = LogitsRecorder(runner)
    runner.initialize_kv_cache(16, 4)
    prefix = _prompt(4, 8)
    a, b = prefix + _prompt(5, 3), prefix + _prompt(6, 5)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    so = SchedulerOutput(
        [NewRequestData("a", a, [], sp, [0, 1, 2], 0)], CachedRequestData(), {"a": len(a)}, len(a), set()
    )
    runner.execute_model(so)
    # b reuses blocks 0 and 1 (8 prefix tokens) and computes its 5 new tokens only
    so = SchedulerOutput([NewRequestData("b", b, [], sp, [0, 1, 5, 6], 8)], CachedRequestData(), {"b": 5}, 5, {"a"})
    out = runner.execute_model(so)
    want = _hf_logits(hf, b)[-1]
    assert (rec.calls[-1][0] - want).abs().max().item() <= TOL
    assert out.sampled_token_ids == [[int(want.argmax())]]
