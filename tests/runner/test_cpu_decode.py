"""The one-call CPU decode step (`pkgd.runner.models.llama_cpu_decode`) against its reference,
the model's per-layer forward.

Both run on the same model, the same random KV cache contents and the same step; the final
hidden states and every layer's cache after the step must agree. Thread counts 2 and 3 make
the kernel split GEMV blocks between threads (each thread's share of a weight starts
mid-block), which one thread never does.
"""

from __future__ import annotations

import pytest
import torch
from tests.runner.driver import Driver
from tests.runner.factory import make_runner, onednn_bf16_view_expected

from pkgd.runner.attention import AttentionMetadata
from pkgd.runner.models.llama_cpu_decode import LLAMA_DECODE, CpuDecodeStep, DecoderDims
from pkgd.sampling_params import SamplingParams

needs_bf16_packing = pytest.mark.skipif(
    not onednn_bf16_view_expected(),
    reason="the bf16 one-call step reads oneDNN's bf16 packing, made so on AVX512-BF16 / AMX hosts only",
)

ARCHES = ["llama", "llama-untied", "qwen2", "qwen3"]
BLOCK = 4


def _random_step(runner, seq_lens: list[int], seed: int):
    """Caches of random contents and a decode step of ``len(seq_lens)`` sequences whose blocks
    are scattered through them; returns ``(input_ids, positions, meta)``."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 3
    runner.initialize_kv_cache(num_blocks, BLOCK)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for n in seq_lens:
        tables.append([order.pop() for _ in range(-(-n // BLOCK))])
        slots.append(tables[-1][(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
    meta = AttentionMetadata.build(
        query_lens=[1] * len(seq_lens),
        seq_lens=seq_lens,
        block_table_rows=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=BLOCK,
        kv_bytes_per_token=0,
        device=torch.device("cpu"),
    )
    ids = torch.randint(0, runner.arch.vocab_size, (len(seq_lens),), generator=g)
    positions = torch.tensor(seq_lens, dtype=torch.int64) - 1
    return ids, positions, meta


def _forward(model, ids, positions, caches, meta, fused: bool):
    step, calls = model.cpu_decode, []
    if fused:

        def counted(*a):
            out = step(*a)
            calls.append(out is not None)
            return out

        model.cpu_decode = counted
    else:
        model.cpu_decode = None
    try:
        with torch.inference_mode():
            return model(ids, positions, caches, meta), calls
    finally:
        model.cpu_decode = step


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("threads", [1, 2, 3])
# 1x37 and 61+3: few (sequence, KV head) pairs for the threads, so sequences are cut into
# spans of blocks whose partial softmaxes are merged (3 tokens: one span left empty)
@pytest.mark.parametrize(
    "seq_lens",
    [[1], [9], [37], [61, 3], [5, 13, 2], [3, 40, 7, 1, 22, 16, 8, 30]],
    ids=["1x1", "1x9", "1x37", "61+3", "3", "8"],
)
def test_one_call_step_matches_the_per_layer_forward(tiny_dirs, c_kernels, arch, threads, seq_lens):
    model_dir, _ = tiny_dirs(arch)
    runner = make_runner(model_dir)
    model = runner.model
    assert isinstance(model.cpu_decode, CpuDecodeStep)
    torch.set_num_threads(threads)
    ids, positions, meta = _random_step(runner, seq_lens, seed=len(seq_lens) * 10 + threads)
    base = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    ref, _ = _forward(model, ids, positions, base, meta, fused=False)
    got, calls = _forward(model, ids, positions, runner.kv_caches, meta, fused=True)
    assert calls == [True]  # served by the C step, not the fallback
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    for (k, v), (rk, rv) in zip(runner.kv_caches, base):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)


def test_steps_it_does_not_serve_fall_back_to_the_per_layer_forward(tiny_dirs, c_kernels):
    model_dir, _ = tiny_dirs("llama")
    runner = make_runner(model_dir)
    step = runner.model.cpu_decode
    ids, positions, meta = _random_step(runner, [3] * 9, seed=1)
    assert step(runner.model.embed_tokens(ids), positions, runner.kv_caches, meta) is None  # 9 > 8 rows
    # a prefill in the batch
    ids, positions, meta = _random_step(runner, [3, 5], seed=2)
    meta.num_decodes = 1
    assert step(runner.model.embed_tokens(ids), positions, runner.kv_caches, meta) is None
    # K and V caches of two dtypes
    ids, positions, meta = _random_step(runner, [3, 5], seed=3)
    runner.kv_caches = [(k.half(), v) for k, v in runner.kv_caches]
    assert step(runner.model.embed_tokens(ids), positions, runner.kv_caches, meta) is None


def test_not_built_without_the_c_kernels(tiny_dirs):
    model_dir, _ = tiny_dirs("qwen3")
    runner = make_runner(model_dir, cpu_kernels=False)
    assert runner.cpu_kernels is None and runner.model.cpu_decode is None


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
def test_moe_models_are_declined_and_decode_layer_by_layer(tiny_dirs, c_kernels, arch):
    """The C step has dense MLPs only: an MoE model (Qwen3-MoE: even with one dense layer) gets
    none, and its decode steps run the per-layer forward (the parity tests check its output)."""
    model_dir, _ = tiny_dirs(arch)
    runner = make_runner(model_dir)
    assert runner.cpu_kernels is not None and runner.model.cpu_decode is None
    ids, positions, meta = _random_step(runner, [3, 5], seed=4)
    hidden = runner.model(ids, positions, runner.kv_caches, meta)
    assert hidden.shape == (2, runner.arch.hidden_size) and torch.isfinite(hidden).all()


def test_new_caches_are_picked_up(tiny_dirs, c_kernels):
    """The runner may allocate its caches again (a new engine config): the step must write and
    read the new ones, never the freed ones."""
    model_dir, _ = tiny_dirs("qwen2")
    runner = make_runner(model_dir)
    outs = []
    for _ in range(2):
        drv = Driver(runner, num_blocks=16, block_size=BLOCK)  # initialises a fresh cache
        drv.add("a", list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=6))
        outs.append(drv.run()["a"])
    assert outs[0] == outs[1]


def test_the_log_says_the_kernels_and_the_one_call_step_are_in_use(tiny_dirs, c_kernels):
    from structlog.testing import capture_logs

    model_dir, _ = tiny_dirs("llama")
    with capture_logs() as logs:
        runner = make_runner(model_dir)
    (loaded,) = [e for e in logs if e["event"] == "cpu_kernels_loaded"]
    assert loaded["one_call_decode"] is True and loaded["library"] == str(runner.cpu_kernels.path)
    assert runner.model.cpu_decode is not None and runner.model.kernels is runner.cpu_kernels


def test_the_per_layer_reference_needs_no_c_kernels(tiny_dirs, c_kernels):
    """The one-call step against the per-layer forward of a runner built without any C kernel
    (every op in its PyTorch form), on the same weights, caches and step."""
    model_dir, _ = tiny_dirs("qwen3")
    fused = make_runner(model_dir)
    plain = make_runner(model_dir, cpu_kernels=False)
    assert plain.cpu_kernels is None and plain.model.cpu_decode is None
    ids, positions, meta = _random_step(fused, [5, 13, 2], seed=5)
    plain.kv_caches = [(k.clone(), v.clone()) for k, v in fused.kv_caches]
    ref, _ = _forward(plain.model, ids, positions, plain.kv_caches, meta, fused=False)
    got, calls = _forward(fused.model, ids, positions, fused.kv_caches, meta, fused=True)
    assert calls == [True]
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    for (k, v), (rk, rv) in zip(fused.kv_caches, plain.kv_caches):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)


def test_a_library_that_disagrees_with_its_structs_is_refused_not_called(tiny_dirs, c_kernels, tmp_path, monkeypatch):
    """The C side reports its struct layouts; a ctypes struct edited apart from the C one makes
    the loader refuse the library (logged), and the per-layer forward serves the steps."""
    import ctypes
    import dataclasses

    from structlog.testing import capture_logs

    from pkgd.runner.models import llama_cpu_decode as lcd

    class Shorter(ctypes.Structure):  # a field dropped on the Python side only
        _c_name_ = "pkgd_decoder_dims"
        _fields_ = DecoderDims._fields_[:-1]

    monkeypatch.setattr(lcd, "LLAMA_DECODE", dataclasses.replace(LLAMA_DECODE, structs=(Shorter,)))
    model_dir, _ = tiny_dirs("llama")
    with capture_logs() as logs:
        runner = make_runner(model_dir)
    assert runner.model.cpu_decode is None
    (refused,) = [e for e in logs if e["event"] == "one_call_decode_unavailable"]
    assert "struct pkgd_decoder_dims" in refused["reason"] and "in C but" in refused["reason"]


def _compare(runner, seq_lens, seed):
    """(max |one-call - per-layer| / max |per-layer| of the hidden states, same for the caches)."""
    model = runner.model
    ids, positions, meta = _random_step(runner, seq_lens, seed=seed)
    base = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    ref, _ = _forward(model, ids, positions, base, meta, fused=False)
    got, calls = _forward(model, ids, positions, runner.kv_caches, meta, fused=True)
    assert calls == [True] and got.dtype == ref.dtype == model.dtype
    hidden = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    cache = max(
        ((c.float() - rc.float()).abs().max() / rc.float().abs().max()).item()
        for kv, rkv in zip(runner.kv_caches, base)
        for c, rc in zip(kv, rkv)
    )
    return hidden, cache


@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
def test_16_bit_caches_under_a_float32_model(tiny_dirs, c_kernels, cache_dtype):
    model_dir, _ = tiny_dirs("qwen2")
    runner = make_runner(model_dir)
    runner.config = runner.config.model_copy(
        update={"cache": runner.config.cache.model_copy(update={"cache_dtype": cache_dtype})}
    )
    runner.kv_dtype = getattr(torch, cache_dtype)
    hidden, cache = _compare(runner, [5, 13, 2], seed=11)
    assert hidden <= 1e-5 and cache <= 1e-2  # the new K/V rounded to 16 bits on both paths


@needs_bf16_packing
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("impl", ["dpbf16", "widen"])
@pytest.mark.parametrize("seq_lens", [[9], [61, 3], [3, 40, 7, 1, 22, 16, 8, 30]], ids=["1x9", "61+3", "8"])
def test_bf16_step_matches_the_per_layer_bf16_forward(tiny_dirs, c_kernels, arch, impl, seq_lens):
    """bf16 weights and KV cache: the one-call step keeps its residual stream in float32 and
    rounds only GEMV inputs and cache writes, the per-layer forward rounds after every op, so
    they agree to bf16 rounding (measured here: <= 1.1e-2 of the largest value), not to float32's."""
    if impl == "dpbf16" and not c_kernels.bf16_native:
        pytest.skip("this CPU has no AVX512-BF16")
    model_dir, _ = tiny_dirs(arch)
    runner = make_runner(model_dir, dtype="bfloat16")
    assert isinstance(runner.model.cpu_decode, CpuDecodeStep) and runner.kv_caches == []
    runner.cpu_kernels.use_bf16_impl(impl)
    torch.set_num_threads(2)
    hidden, cache = _compare(runner, seq_lens, seed=len(seq_lens) + len(impl))
    assert hidden <= 3e-2 and cache <= 3e-2, (hidden, cache)


def _linears(model):
    return [
        m
        for layer in model.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


@needs_bf16_packing
def test_bf16_step_reads_either_block_width(tiny_dirs, c_kernels):
    """oneDNN packs bf16 weights in 32-wide blocks on some CPUs and 64-wide on others; the step
    given the same weights repacked by hand in the other width computes the same hidden states
    (the same sums in the same order: 32 outputs at a time either way)."""
    model_dir, _ = tiny_dirs("llama-untied")
    runner = make_runner(model_dir, dtype="bfloat16")
    model = runner.model
    native = model.cpu_decode
    assert isinstance(native, CpuDecodeStep)
    ids, positions, meta = _random_step(runner, [5, 13, 2], seed=4)
    want, calls = _forward(model, ids, positions, runner.kv_caches, meta, fused=True)
    assert calls == [True]
    linears = _linears(model)
    width = linears[0].gemv_weight.shape[2]
    other = 96 - width  # 32 <-> 64
    views = [m.gemv_weight for m in linears]
    try:
        for m, v in zip(linears, views):
            dense = v.permute(0, 2, 1, 3).reshape(v.shape[0] * width, -1)  # W [n, k]
            n, k = dense.shape
            m.gemv_weight = dense.view(n // other, other, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        model.cpu_decode = CpuDecodeStep.build(model)
        assert (
            isinstance(model.cpu_decode, CpuDecodeStep)
            and model.cpu_decode.dims.weight_dtype != native.dims.weight_dtype
        )
        ids, positions, meta = _random_step(runner, [5, 13, 2], seed=4)
        got, calls = _forward(model, ids, positions, runner.kv_caches, meta, fused=True)
        assert calls == [True]
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    finally:
        for m, v in zip(linears, views):
            m.gemv_weight = v
        model.cpu_decode = native


@needs_bf16_packing
def test_bf16_dot_product_paths_agree(tiny_dirs, c_kernels):
    """vdpbf16ps and the widening path compute the same sums of the same rounded inputs, up to
    their order."""
    if not c_kernels.bf16_native:
        pytest.skip("this CPU has no AVX512-BF16")
    model_dir, _ = tiny_dirs("llama-untied")
    runner = make_runner(model_dir, dtype="bfloat16")
    model = runner.model
    outs = []
    for impl in ("dpbf16", "widen"):
        runner.cpu_kernels.use_bf16_impl(impl)
        ids, positions, meta = _random_step(runner, [5, 13, 2], seed=3)
        outs.append(_forward(model, ids, positions, runner.kv_caches, meta, fused=True)[0].float())
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-2 * outs[1].abs().max().item()  # one bf16 ulp of the output
