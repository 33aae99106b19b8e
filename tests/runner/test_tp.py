"""Tensor parallelism for real: tp=2 over gloo with a worker process; same greedy output as tp=1."""

from __future__ import annotations

import pytest
import torch
from tests.runner.driver import Driver
from tests.runner.factory import LogitsRecorder, make_runner

from pkgd.config.vllm_config import VllmConfig
from pkgd.model_files.resolve import resolve_model
from pkgd.runner.tp_executor import TPExecutor
from pkgd.sampling_params import SamplingParams


def _run(runner, prompts, sp, chunk=None):
    drv = Driver(runner, num_blocks=48, block_size=4)
    for i, p in enumerate(prompts):
        drv.add(str(i), p, sp)
    return drv.run(chunk=chunk)


def test_tp2_greedy_and_seeded_match_tp1(tiny_dirs):
    model_dir, _ = tiny_dirs("llama")  # 4 heads, 2 KV heads, vocab 160: all divide by 2
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (13, 6, 21)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=8)
    one = make_runner(model_dir)
    rec1 = LogitsRecorder(one)
    want_greedy = _run(one, prompts, greedy, chunk=5)
    want_seeded = _run(one, prompts, seeded)

    cfg = VllmConfig(model={"source": str(model_dir), "dtype": "float32"}, parallel={"tp": 2})
    tp = TPExecutor(cfg, resolve_model(cfg.model), device=torch.device("cpu"))
    workers = list(tp.workers)
    try:
        assert tp.model_info.num_kv_heads_per_rank == 1
        assert tp.kv_cache_bytes_per_block(4) * 2 == one.kv_cache_bytes_per_block(4)
        rec2 = LogitsRecorder(tp.runner)
        assert _run(tp, prompts, greedy, chunk=5) == want_greedy
        assert _run(tp, prompts, seeded) == want_seeded
        for a, b in zip(rec1.calls, rec2.calls):
            assert (a - b).abs().max().item() <= 1e-4
    finally:
        tp.shutdown()
    assert [p.returncode for p in workers] == [0] and not torch.distributed.is_initialized()


def test_tp2_gemma2_matches_tp1(tiny_dirs):
    """A dense family beyond Llama under tp=2: Gemma 2's extra norms, scaled embeddings,
    GeGLU, soft-caps (attention per rank's heads, final logits after the vocab gather) and
    alternating windowed layers, prompts longer than the 8-token window."""
    model_dir, _ = tiny_dirs("gemma2")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (19, 5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    one = make_runner(model_dir)
    rec1 = LogitsRecorder(one)
    want = _run(one, prompts, greedy, chunk=7)
    cfg = VllmConfig(model={"source": str(model_dir), "dtype": "float32"}, parallel={"tp": 2})
    tp = TPExecutor(cfg, resolve_model(cfg.model), device=torch.device("cpu"))
    try:
        rec2 = LogitsRecorder(tp.runner)
        assert _run(tp, prompts, greedy, chunk=7) == want
        assert len(rec1.calls) == len(rec2.calls)
        for a, b in zip(rec1.calls, rec2.calls):
            assert (a - b).abs().max().item() <= 1e-4
    finally:
        tp.shutdown()


def test_tp_size_that_does_not_divide_the_heads_fails_cleanly(tiny_dirs):
    model_dir, _ = tiny_dirs("llama")
    cfg = VllmConfig(model={"source": str(model_dir), "dtype": "float32"}, parallel={"tp": 3})
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) is not divisible by the tensor-parallel size \(3\)"
    ):
        TPExecutor(cfg, resolve_model(cfg.model), device=torch.device("cpu"))
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "arch,expert_parallel",
    [("mixtral", False), ("mixtral", True), ("qwen3-moe", True)],
    ids=["mixtral-feature-split", "mixtral-expert-parallel", "qwen3-moe-expert-parallel"],
)
def test_tp2_moe_matches_tp1(tiny_dirs, arch, expert_parallel):
    """An MoE model over 2 ranks, each rank holding half of every expert's features or half of
    the experts (``parallel.enable_expert_parallel``): the same greedy tokens and logits as one
    rank (mixed prefill/decode batches, chunked)."""
    model_dir, _ = tiny_dirs(arch)  # 4 or 8 experts, 96 or 32 expert features: all divide by 2
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (13, 6, 21)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    one = make_runner(model_dir)
    rec1 = LogitsRecorder(one)
    want = _run(one, prompts, greedy, chunk=5)
    cfg = VllmConfig(
        model={"source": str(model_dir), "dtype": "float32"},
        parallel={"tp": 2, "enable_expert_parallel": expert_parallel},
    )
    tp = TPExecutor(cfg, resolve_model(cfg.model), device=torch.device("cpu"))
    workers = list(tp.workers)
    try:
        moe = next(layer.mlp for layer in tp.runner.model.layers if hasattr(layer.mlp, "w13"))
        if expert_parallel:
            assert (moe.num_local_experts, moe.first_expert) == (moe.num_experts // 2, 0)
        else:
            assert moe.num_local_experts == moe.num_experts and moe.intermediate_local == moe.intermediate_size // 2
        rec2 = LogitsRecorder(tp.runner)
        assert _run(tp, prompts, greedy, chunk=5) == want
        assert len(rec1.calls) == len(rec2.calls)
        for a, b in zip(rec1.calls, rec2.calls):
            assert (a - b).abs().max().item() <= 1e-4
    finally:
        tp.shutdown()
    assert [p.returncode for p in workers] == [0] and not torch.distributed.is_initialized()


def test_tp_size_check_splits_experts_under_expert_parallel_else_their_features(tiny_dirs):
    """`check_tp_size` (what TPExecutor runs before spawning) asks what each MoE layout splits."""
    import dataclasses

    from pkgd.runner.models.config import load_arch_config
    from pkgd.runner.models.llama import check_tp_size

    model_dir, _ = tiny_dirs("mixtral")
    cfg = load_arch_config(model_dir)
    three = dataclasses.replace(cfg, raw={**cfg.raw, "num_local_experts": 3})
    check_tp_size(three, 2)  # each of the 3 experts' 96 features in halves
    with pytest.raises(ValueError, match=r"num_experts \(expert parallel\) \(3\) is not divisible by the tensor-par"):
        check_tp_size(three, 2, expert_parallel=True)
    odd = dataclasses.replace(cfg, intermediate_size=90)
    check_tp_size(odd, 4, expert_parallel=True)  # whole experts: 90 features stay together
    with pytest.raises(ValueError, match=r"the experts' intermediate_size \(90\) is not divisible"):
        check_tp_size(odd, 4)
