"""ModelRunner behaviour through hand-built SchedulerOutputs on a tiny random Llama."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tests.runner.driver import Driver
from tests.runner.factory import make_runner

from pkgd.runner.models import UnsupportedArchitectureError
from pkgd.sampling_params import SamplingParams
from pkgd.scheduler_output import CachedRequestData, SchedulerOutput


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def llama(tiny_dirs):
    return tiny_dirs("llama")


def test_model_info_and_kv_block_size(llama):
    model_dir, _ = llama
    r = make_runner(model_dir, max_model_len=100)
    info = r.model_info
    assert info.max_model_len == 100 and info.vocab_size == 160 and info.num_layers == 2
    assert (info.num_heads, info.num_kv_heads, info.head_dim, info.dtype) == (4, 2, 16, "float32")
    assert r.kv_cache_bytes_per_block(16) == 2 * 2 * 16 * 2 * 16 * 4
    assert make_runner(model_dir, max_model_len=4096).model_info.max_model_len == 256  # the model's own limit


def test_seeded_sampling_same_tokens_alone_or_batched(llama):
    model_dir, _ = llama
    sp = SamplingParams(temperature=1.0, seed=77, max_tokens=12)

    def run(extra: int, chunk=None):
        drv = Driver(make_runner(model_dir), num_blocks=64)
        for i in range(extra):
            drv.add(f"x{i}", _prompt(10 + i, 5 + 3 * i), SamplingParams(temperature=1.0, max_tokens=8 + i))
        drv.add("seeded", _prompt(1, 11), sp)
        return drv.run(chunk=chunk)["seeded"]

    alone = run(0)
    assert run(3) == alone
    assert run(2, chunk=4) == alone
    assert len(set(alone)) > 1


def test_preempted_request_resumes_with_the_same_tokens(llama):
    model_dir, _ = llama
    for sp in (SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.9, seed=3, max_tokens=10)):
        ref = Driver(make_runner(model_dir))
        ref.add("a", _prompt(4, 13), sp)
        want = ref.run()["a"]
        drv = Driver(make_runner(model_dir))
        drv.add("a", _prompt(4, 13), sp)
        for _ in range(4):
            drv.step()
        drv.preempt("a")  # comes back as a new request carrying its 3 outputs
        assert drv.run()["a"] == want
        drv.flush()
        assert drv.runner.states == {}


def test_logprobs_and_prompt_logprobs_match_transformers(llama):
    model_dir, hf = llama
    prompt = _prompt(5, 14)
    sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=3)
    results = []
    for chunk in (None, 4):
        drv = Driver(make_runner(model_dir))
        drv.add("a", prompt, sp)
        drv.run(chunk=chunk)
        results.append(drv.reqs["a"])
    r = results[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + r.outputs])).logits[0], -1)
    assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        e = r.prompt_logprobs[j]
        assert e.token_ids[0] == prompt[j] and len(e.token_ids) == 4
        assert e.logprobs[0] == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)
        assert e.rank == int((ref[j - 1] > ref[j - 1, prompt[j]]).sum()) + 1
        assert e.token_ids[1:] == ref[j - 1].topk(3).indices.tolist()
    assert len(r.logprobs) == 3
    for j, e in enumerate(r.logprobs):
        pos = len(prompt) - 1 + j
        assert e.token_ids[0] == r.outputs[j] and e.rank == 1
        assert e.logprobs[0] == pytest.approx(ref[pos, r.outputs[j]].item(), abs=1e-4)
    chunked = results[1]
    assert chunked.outputs == r.outputs
    assert [e and e.token_ids for e in chunked.prompt_logprobs] == [e and e.token_ids for e in r.prompt_logprobs]


def test_prompt_logprobs_not_repeated_after_preemption(llama):
    model_dir, _ = llama
    drv = Driver(make_runner(model_dir))
    drv.add("a", _prompt(6, 9), SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=0))
    drv.step()
    drv.step()
    drv.preempt("a")
    drv.run()
    assert len(drv.reqs["a"].prompt_logprobs) == 9


def test_partial_prefill_samples_nothing(llama):
    model_dir, _ = llama
    drv = Driver(make_runner(model_dir))
    drv.add("a", _prompt(7, 10), SamplingParams(temperature=0.0, max_tokens=2))
    out = drv.step(chunk=4)
    assert out.req_ids == ["a"] and out.sampled_token_ids == [[]] and out.logprobs is None


def test_contract_errors(llama):
    model_dir, _ = llama
    r = make_runner(model_dir)
    empty = SchedulerOutput([], CachedRequestData(), {}, 0, set())
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        r.execute_model(empty)
    r.initialize_kv_cache(8, 4)
    assert r.execute_model(empty).req_ids == []
    bad = SchedulerOutput([], CachedRequestData(["ghost"], [[]], [0]), {"ghost": 1}, 1, set())
    with pytest.raises(KeyError, match="ghost"):
        r.execute_model(bad)


def test_unsupported_architecture_lists_supported(llama, tmp_path):
    model_dir, _ = llama
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as e:
        make_runner(d)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg


@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
def test_a_16_bit_kv_cache_halves_the_bytes_and_keeps_the_logits_close(llama, cache_dtype):
    from tests.runner.factory import LogitsRecorder

    from pkgd.config.vllm_config import VllmConfig
    from pkgd.model_files.resolve import resolve_model
    from pkgd.runner.model_runner import ModelRunner

    model_dir, _ = llama
    cfg = VllmConfig(model={"source": str(model_dir), "dtype": "float32"}, cache={"cache_dtype": cache_dtype})
    half = ModelRunner(cfg, resolve_model(cfg.model), device=torch.device("cpu"))
    full = make_runner(model_dir)
    assert half.kv_cache_bytes_per_block(16) * 2 == full.kv_cache_bytes_per_block(16)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    logits = []
    for runner in (full, half):
        rec = LogitsRecorder(runner)
        drv = Driver(runner, num_blocks=32)
        drv.add("a", _prompt(5, 9), sp)
        drv.add("b", _prompt(6, 14), sp)
        drv.run(chunk=8)  # chunked prefill reads the 16-bit cache too
        assert runner.kv_caches[0][0].dtype == getattr(torch, "float32" if runner is full else cache_dtype)
        logits.append(torch.cat([c for c in rec.calls]))
    diff = (logits[0] - logits[1]).abs().max().item()
    assert 0 < diff < 0.05 * logits[0].abs().max().item()  # rounded K/V, not a different model


def test_a_16_bit_kv_cache_is_refused_off_cpu():
    from pkgd.runner.model_runner import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", torch.float32, torch.device("cpu")) == torch.float32
    assert resolve_kv_cache_dtype("float16", torch.float32, torch.device("cpu")) == torch.float16
    assert resolve_kv_cache_dtype("float16", torch.float16, torch.device("cuda")) == torch.float16
    with pytest.raises(ValueError, match="cache.cache_dtype: bfloat16 differs from the model dtype float16"):
        resolve_kv_cache_dtype("bfloat16", torch.float16, torch.device("cuda"))


def test_auto_kv_cache_is_bfloat16_under_quantized_weights_on_cpu():
    from pkgd.runner.model_runner import resolve_kv_cache_dtype

    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu, quantized=True) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu, quantized=False) == torch.float32
    # an explicit dtype wins
    assert resolve_kv_cache_dtype("float32", torch.float32, cpu, quantized=True) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.float16, torch.device("cuda"), quantized=True) == torch.float16
