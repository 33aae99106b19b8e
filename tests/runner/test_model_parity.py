"""Logits of pkgd's models on the paged cache match transformers' forward (fp32, <= 1e-4), and
greedy outputs match transformers' ``generate``. In bfloat16 (the MoE families) the bound calibrates
itself, as in test_device_parity.py: pkgd's error against transformers in float32 stays within
twice transformers' own bf16 error (same weights, same tokens) plus `BF16_FLOOR`, and each greedy
token is transformers' float32 choice unless the two are within that bound of a tie."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.runner.driver import Driver
from tests.runner.factory import LogitsRecorder, make_runner

from pkgd.sampling_params import SamplingParams

ARCHES = ["llama", "llama-untied", "qwen2", "qwen3", "mixtral", "qwen3-moe", "qwen3-moe-norm"]
TOL = 1e-4
GREEDY6 = SamplingParams(temperature=0.0, max_tokens=6)
MOE_ARCHES = ["mixtral", "qwen3-moe"]
# bf16 keeps 8 significant bits: logits of these tiny models are O(1), so a step of ~0.008
# separates neighbouring bf16 values; a few such steps are below either side's rounding.
BF16_FLOOR = 2e-2


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


def _recording_step(drv: Driver, rec: LogitsRecorder, per_req: dict[str, list[torch.Tensor]], **kw) -> None:
    """One driver step; each request that sampled appends its logits row to ``per_req``."""
    n0 = len(rec.calls)
    out = drv.step(**kw)
    rows = [rid for rid, toks in zip(out.req_ids, out.sampled_token_ids) if toks]
    if rows:
        assert len(rec.calls) == n0 + 1 and rec.calls[-1].shape[0] == len(rows)
        for i, rid in enumerate(rows):
            per_req.setdefault(rid, []).append(rec.calls[-1][i])


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
    _recording_step(drv, rec, per_req, only={"a"})  # a: whole prompt
    _recording_step(drv, rec, per_req, chunk=5)  # a decodes while b prefills its first 5 tokens (mixed batch)
    while not all(r.done for r in drv.reqs.values()):
        _recording_step(drv, rec, per_req)
    for rid, prompt in (("a", pa), ("b", pb)):
        outs = drv.reqs[rid].outputs
        assert len(outs) == 6 and len(per_req[rid]) == 6
        _check(hf, prompt, outs, per_req[rid])


@pytest.mark.parametrize("arch", ["qwen3", "mixtral", "qwen3-moe"])
def test_prefix_cache_hit_reads_shared_blocks(tiny_dirs, arch):
    """A new request whose first blocks are already cached (num_computed_tokens > 0, block
    ids shared with another request) computes only its tail and matches transformers."""
    from pkgd.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    model_dir, hf = tiny_dirs(arch)
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


_GENERATED: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _hf_generate(arch: str, hf, prompt: list[int], n: int) -> list[int]:
    key = (arch, tuple(prompt))
    if key not in _GENERATED:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _GENERATED[key] = out[0, len(prompt) :].tolist()
    return _GENERATED[key]


PROMPTS = [(7, 23), (8, 9), (9, 14)]  # (seed, length)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prompt", "chunked-prefill"])
def test_batched_greedy_outputs_equal_transformers_generate(tiny_dirs, arch, chunk):
    """Three prompts in one batch (prefills together, then decodes together, or in 7-token chunks
    beside the others' decodes): each output is transformers' greedy ``generate`` of its prompt."""
    model_dir, hf = tiny_dirs(arch)
    drv = Driver(make_runner(model_dir), num_blocks=48, block_size=4)
    prompts = [_prompt(seed, n) for seed, n in PROMPTS]
    for i, p in enumerate(prompts):
        drv.add(str(i), p, SamplingParams(temperature=0.0, max_tokens=8))
    outs = drv.run(chunk=chunk)
    assert [outs[str(i)] for i in range(len(prompts))] == [_hf_generate(arch, hf, p, 8) for p in prompts]


_BF16_HF: dict[str, torch.nn.Module] = {}


def _bf16_bound(arch: str, hf, text: list[int], rows: slice) -> tuple[torch.Tensor, float]:
    """transformers' float32 logits of ``text`` at ``rows`` and the bf16 bound there: twice the
    error of transformers' own bf16 forward plus `BF16_FLOOR`."""
    if arch not in _BF16_HF:
        _BF16_HF[arch] = copy.deepcopy(hf).to(torch.bfloat16)
    want = _hf_logits(hf, text)[rows]
    theirs = _hf_logits(_BF16_HF[arch], text)[rows].float()
    return want, 2 * (theirs - want).abs().max().item() + BF16_FLOOR


def _check_bf16(arch: str, hf, prompt: list[int], outputs: list[int], logits_seq: list[torch.Tensor]) -> None:
    want, bound = _bf16_bound(arch, hf, prompt + outputs[:-1], slice(len(prompt) - 1, len(prompt) - 1 + len(outputs)))
    ours = torch.stack(logits_seq).float()
    assert [int(row.argmax()) for row in ours] == outputs  # greedy on its own logits
    err = (ours - want).abs().max().item()
    assert err <= bound, f"pkgd bf16 max |diff| {err:.3e} > bound {bound:.3e}"
    for j, tok in enumerate(outputs):
        best = int(want[j].argmax())
        # transformers' float32 choice, unless pkgd's token is within the bound of a tie with it
        assert tok == best or want[j, best] - want[j, tok] <= 2 * bound, f"step {j}"


@pytest.mark.parametrize("arch", MOE_ARCHES)
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prompt", "chunked-prefill"])
def test_bf16_batch_within_twice_transformers_own_bf16_error(tiny_dirs, arch, chunk, cpu_path):
    model_dir, hf = tiny_dirs(arch)
    runner = make_runner(model_dir, dtype="bfloat16")
    assert runner.model.dtype == torch.bfloat16
    rec = LogitsRecorder(runner)
    drv = Driver(runner, num_blocks=48, block_size=4)
    prompts = [_prompt(seed, n) for seed, n in PROMPTS]
    for i, p in enumerate(prompts):
        drv.add(str(i), p, GREEDY6)
    per_req: dict[str, list[torch.Tensor]] = {}
    while not all(r.done for r in drv.reqs.values()):
        _recording_step(drv, rec, per_req, chunk=chunk)
    for i, p in enumerate(prompts):
        _check_bf16(arch, hf, p, drv.reqs[str(i)].outputs, per_req[str(i)])


@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_bf16_prefix_cache_hit(tiny_dirs, arch):
    """As `test_prefix_cache_hit_reads_shared_blocks`, in bfloat16 (its bound)."""
    from pkgd.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    model_dir, hf = tiny_dirs(arch)
    runner = make_runner(model_dir, dtype="bfloat16")
    rec = LogitsRecorder(runner)
    runner.initialize_kv_cache(16, 4)
    prefix = _prompt(4, 8)
    a, b = prefix + _prompt(5, 3), prefix + _prompt(6, 5)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    so = SchedulerOutput(
        [NewRequestData("a", a, [], sp, [0, 1, 2], 0)], CachedRequestData(), {"a": len(a)}, len(a), set()
    )
    runner.execute_model(so)
    so = SchedulerOutput([NewRequestData("b", b, [], sp, [0, 1, 5, 6], 8)], CachedRequestData(), {"b": 5}, 5, {"a"})
    out = runner.execute_model(so)
    _check_bf16(arch, hf, b, out.sampled_token_ids[0], [rec.calls[-1][0]])
