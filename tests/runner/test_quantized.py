"""GGUF weights kept quantized (``model.quantization: gguf``) in the runner: the choice, the
loading, the logits against the dequantized float path on the same file, and the one-call
decode step on quantized weights against the per-layer forward.

Two tiny GGUFs cover every type, mixed within fused projections as llama.cpp's mixes do:
``legacy`` (llama, tied embedding; Q4_0 / Q4_1 / Q8_0) and ``kquant`` (qwen2 with Q/K/V
biases and an untied embedding, 256 features; Q4_K / Q6_K / Q8_0).

Bounds. Both paths read the same weights (the packing is exact: tests/kernels/test_quant.py);
what differs is the int8 rounding of every linear's input (``pkgd_kernels.quant``), which moves
each input by at most ``max|x| / 254`` of its block of 32 or 256. So the quantized logits are
compared twice. Against the float path with each linear's input rounded the same way (a
forward pre-hook): what is left is the order of float sums, and an int8 rounding that order
flips, one step (1/127 of a block's range) carried through the layers; measured max |logit
difference| 0.015 (legacy) and 0.006 (kquant), bound 0.05. Against the plain float path: the
rounding itself carried through two layers of random weights (whose hidden states have
larger outliers within a block than a trained model's) and the LM head; measured 0.044 (legacy)
and 0.21 (kquant, 256-wide blocks) on logits of magnitude 3-5, bound 0.6. The real model's
figure is benchmarks/perplexity.py's ratio. The one-call decode step runs the same kernels as
the per-layer forward, the only difference being the order of float sums (a GEMV's blocks
split between threads): hidden states agree to 1e-4.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tests.runner.driver import Driver
from tests.runner.factory import LogitsRecorder
from tests.runner.tiny_gguf import write_gguf
from tests.runner.tiny_models import build_tiny

from pkgd.config.vllm_config import VllmConfig
from pkgd.model_files.resolve import resolve_model
from pkgd.runner.layers.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedLMHead
from pkgd.runner.loader.gguf_weights import choose_quantization
from pkgd.sampling_params import SamplingParams

LEGACY = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_1",
    "ffn_down": "Q8_0",
    "token_embd": "Q8_0",
}
KQUANT = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q6_K",
    "ffn_down": "Q6_K",
    "token_embd": "Q4_K",
    "output": "Q8_0",
}
MODELS = {
    "legacy": ("llama-plain", {}, LEGACY),
    "kquant": ("qwen2", {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}, KQUANT),
}
ROUNDED_BOUND = 0.05
LOGIT_BOUND = 0.6


def _types(table):
    return lambda name: table[name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]]


@pytest.fixture(scope="module")
def tiny_quantized(tmp_path_factory):
    """name -> GGUF path of that tiny model."""
    out = {}
    for name, (arch, sizes, table) in MODELS.items():
        d = tmp_path_factory.mktemp(f"q-{name}")
        hf = build_tiny(arch, d / "hf", **sizes)
        out[name] = write_gguf(hf, d / f"tiny-{name}.gguf", quantize=_types(table))
    return out


def _runner(path, quantization="gguf", cache_dtype="auto", **model_kw):
    from pkgd.runner.model_runner import ModelRunner

    cfg = VllmConfig(
        model={
            "source": str(path),
            "cache_dir": str(path.parent / "cache"),
            "dtype": "float32",
            "quantization": quantization,
            **model_kw,
        },
        cache={"cache_dtype": cache_dtype},
    )
    return ModelRunner(cfg, resolve_model(cfg.model), device=torch.device("cpu"))


@pytest.mark.parametrize("name", list(MODELS))
def test_auto_keeps_every_type_quantized_and_writes_no_float_copy(tiny_quantized, name):
    runner = _runner(tiny_quantized[name])
    assert runner.quantization.quantized, runner.quantization.reason
    model, table = runner.model, MODELS[name][2]
    assert runner.model_info.quantization == "gguf:" + ",".join(sorted(set(table.values())))
    layer = model.layers[0]
    for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(m, QuantizedLinear) and m.qweight is not None
    assert isinstance(model.lm_head, QuantizedLMHead)
    assert isinstance(model.embed_tokens, QuantizedEmbedding) == (name == "kquant")  # untied: its own table
    qkv = [s.qtype for s in layer.self_attn.qkv_proj.qweight.segments]
    assert len(qkv) == (3 if name == "legacy" else 2)  # one segment per run of one type
    assert not runner.model_files.has_float_weights()  # nothing dequantized to disk
    float_bytes = 4 * runner.model_info.num_params
    assert runner.model_info.weight_bytes < float_bytes / 3.5
    assert runner.dtype == torch.float32 and "quantized" in runner.dtype_choice.reason  # no bf16 measurement
    assert runner.kv_dtype == torch.bfloat16  # 16-bit K/V under quantized weights


def test_sleep_level_2_reloads_the_quantized_weights(tiny_quantized):
    runner = _runner(tiny_quantized["legacy"])
    _, before = _logits(runner, [[5, 6, 7]], 3)
    runner.sleep(2)
    assert runner.model is None
    runner.wake_up(["weights"])
    assert isinstance(runner.model.lm_head, QuantizedLMHead) and not runner.model_files.has_float_weights()
    _, after = _logits(runner, [[5, 6, 7]], 3)
    assert after == before


def _logits(runner, prompts, steps):
    drv = Driver(runner, num_blocks=64, block_size=4)
    rec = LogitsRecorder(runner)
    for i, p in enumerate(prompts):
        drv.add(str(i), p, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    out = drv.run()
    return torch.cat(rec.calls), out


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_the_dequantized_float_path_within_activation_rounding(tiny_quantized, name):
    """Decode steps (the one-call step) and a prefill's every position (batched linears) of
    the quantized path against the float path on the same tokens: within `ROUNDED_BOUND` of
    the float path with its linears' inputs rounded as the kernels round them (float32 K/V on
    both sides, so only that rounding differs), and within `LOGIT_BOUND` of the plain float
    path, also with the default bfloat16 K/V (decode steps read the rounded cache)."""
    torch.set_num_threads(2)
    quantized = _runner(tiny_quantized[name], cache_dtype="float32")
    default_kv = _runner(tiny_quantized[name])
    assert default_kv.kv_dtype == torch.bfloat16
    dequantized = _runner(tiny_quantized[name], quantization="none")
    assert dequantized.model_files.has_float_weights() and not dequantized.quantization.quantized
    worst = rounded_worst = 0.0
    compared16 = 0
    for prompt in ([7, 9, 11], list(range(3, 40)), list(range(100, 113))):
        decoded, tokens = _logits(quantized, [prompt], 6)  # the prompt's last position, then 5 decodes
        decoded16, tokens16 = _logits(default_kv, [prompt], 6)
        seq = prompt + tokens["0"][:-1]
        want = _all_position_logits(dequantized, seq)
        assert 0.5 < want.abs().max() < 20  # logits of the magnitude the bounds were measured on
        with _kernel_rounded_activations(dequantized, quantized):
            rounded = _all_position_logits(dequantized, seq)
        prefill = _all_position_logits(quantized, seq)
        worst = max(worst, float((decoded - want[len(prompt) - 1 :]).abs().max()), float((prefill - want).abs().max()))
        if tokens16 == tokens:  # same tokens: the same positions compare (a near-tie may flip one)
            worst = max(worst, float((decoded16 - want[len(prompt) - 1 :]).abs().max()))
            compared16 += 1
        rounded_worst = max(
            rounded_worst,
            float((decoded - rounded[len(prompt) - 1 :]).abs().max()),
            float((prefill - rounded).abs().max()),
        )
    assert rounded_worst < ROUNDED_BOUND, rounded_worst
    assert worst < LOGIT_BOUND, worst
    assert compared16 > 0


@contextlib.contextmanager
def _kernel_rounded_activations(float_runner, quantized_runner):
    """Make the float runner's linears (and LM head) round their inputs to int8 blocks as
    `quantized_runner`'s kernels do, for the duration of the block."""
    from pkgd_kernels.quant import dequantized_activations
    from pkgd_kernels.quant_layout import BLOCK

    pairs = [(float_runner.model.lm_head, quantized_runner.model.lm_head)]
    for lf, lq in zip(float_runner.model.layers, quantized_runner.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            pairs.append((lf.get_submodule(name), lq.get_submodule(name)))
    hooks = []
    for f, q in pairs:
        block = BLOCK[q.qweight.segments[0].qtype]
        hooks.append(f.register_forward_pre_hook(lambda m, a, block=block: (dequantized_activations(a[0], block),)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _all_position_logits(runner, ids):
    """Logits at every position of one prefill of ``ids``."""
    saved = []
    fwd = runner.model.forward

    def keep(*a):
        saved.append(fwd(*a))
        return saved[-1]

    runner.model.forward = keep
    try:
        drv = Driver(runner, num_blocks=64, block_size=4)
        drv.add("x", ids, SamplingParams(temperature=0.0, max_tokens=1))
        drv.run()
    finally:
        runner.model.forward = fwd
    with torch.inference_mode():
        return runner.model.compute_logits(saved[0])


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "seq_lens", [[1], [37], [61, 3], [3, 40, 7, 1, 22, 16, 8, 30]], ids=["1x1", "1x37", "61+3", "8"]
)
def test_one_call_step_on_quantized_weights_matches_the_per_layer_forward(tiny_quantized, name, threads, seq_lens):
    from tests.runner.test_cpu_decode import _forward, _random_step

    runner = _runner(tiny_quantized[name], cache_dtype="float32")  # the kernels, not K/V rounding
    model = runner.model
    assert model.cpu_decode is not None and model.cpu_decode.quantized
    torch.set_num_threads(threads)
    for impl in runner.cpu_kernels.quant.available_impls():
        runner.cpu_kernels.quant.use_impl(impl)
        ids, positions, meta = _random_step(runner, seq_lens, seed=len(seq_lens))
        caches = runner.kv_caches
        before = [(k.clone(), v.clone()) for k, v in caches]
        want, _ = _forward(model, ids, positions, caches, meta, fused=False)
        after_ref = [(k.clone(), v.clone()) for k, v in caches]
        for (k, v), (k0, v0) in zip(caches, before):
            k.copy_(k0)
            v.copy_(v0)
        got, calls = _forward(model, ids, positions, caches, meta, fused=True)
        assert calls == [True]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=impl)
        for (k, v), (kr, vr) in zip(caches, after_ref):
            torch.testing.assert_close(k, kr, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, vr, atol=1e-4, rtol=1e-4)
    runner.cpu_kernels.quant.use_impl(runner.cpu_kernels.quant.best_impl)


def test_what_keeps_a_file_dequantized_is_logged_and_runs_in_float(tiny_quantized, tmp_path):
    from pkgd.runner.models.config import load_arch_config

    path = tiny_quantized["legacy"]
    mf = resolve_model(VllmConfig(model={"source": str(path), "cache_dir": str(tmp_path)}).model)
    cfg = load_arch_config(mf.model_dir)
    runner = _runner(path)
    kernels = runner.cpu_kernels
    cpu = torch.device("cpu")
    cases = [
        (("none", path), dict(device=cpu, tp_size=1, kernels=kernels), "model.quantization is none"),
        (("auto", None), dict(device=cpu, tp_size=1, kernels=kernels), "not a GGUF"),
        (("auto", path), dict(device=torch.device("cuda"), tp_size=1, kernels=kernels), "CPU, not cuda"),
        (("auto", path), dict(device=cpu, tp_size=2, kernels=kernels), "tensor parallelism"),
        (("auto", path), dict(device=cpu, tp_size=1, kernels=None), "C kernels are unavailable"),
        (("auto", path), dict(device=cpu, tp_size=1, kernels=kernels, dtype="bfloat16"), "model.dtype is bfloat16"),
        (("auto", path), dict(device=cpu, tp_size=1, kernels=kernels, pooling=True), "pooling runner"),
    ]
    for (requested, gguf), kw, reason in cases:
        choice, weights = choose_quantization(requested, gguf, cfg, **kw)
        assert not choice.quantized and weights is None and reason in choice.reason, choice
    # a file with float 2-D weights: dequantized, and it runs
    from tests.runner.tiny_models import build_tiny

    hf = build_tiny("llama-plain", tmp_path / "hf")
    f32 = write_gguf(hf, tmp_path / "tiny-f32.gguf", quantize=False)
    floats = _runner(f32)
    assert not floats.quantization.quantized and "cannot stay quantized" in floats.quantization.reason
    assert floats.quantization.tensor_types == {"F32": len(hf.state_dict()) - 1}  # lm_head is tied
    _, out = _logits(floats, [[5, 6, 7]], 2)
    assert len(out["0"]) == 2


def test_vllm_quantization_flag(tiny_quantized):
    from pkgd.config.errors import ConfigError
    from pkgd.config.overrides import parse_flags

    ops, problems = parse_flags(["--quantization", "gguf"])
    assert not problems and VllmConfig(model={"quantization": ops[0].value}).model.quantization == "gguf"
    assert VllmConfig().model.quantization == "auto"  # the default decides by measurement
    assert VllmConfig(model={"quantization": "GGUF"}).model.quantization == "gguf"
    with pytest.raises(Exception, match="no kernels for 'awq'"):
        VllmConfig(model={"quantization": "awq"})
    assert ConfigError  # the CLI reports it as a config error with exit 2 (tests/cli)


def _fake_measure(decode, batched, calls):
    def measure(layers, float_dtype, kernels):
        calls.append((len(layers), float_dtype))
        return {"decode_speedup": decode, "batched_speedup": batched, "decode_layers": 1.0}

    return measure


def test_auto_keeps_the_blocks_only_when_measured_faster_than_the_float_path(tiny_quantized, tmp_path):
    """``auto``: decode at least `QUANT_MIN_SPEEDUP` faster and batched steps no more than that
    slower keeps the blocks; anything else dequantizes; the figures and the float dtype they
    were measured against are in the reason; ``gguf`` never measures."""
    from pkgd.runner.loader import quant_choice as QC
    from pkgd.runner.loader.dtype import MeasurementCache

    path = tiny_quantized["legacy"]
    runner = _runner(path)
    kw = dict(device=torch.device("cpu"), tp_size=1, kernels=runner.cpu_kernels)
    layers = runner.arch.num_hidden_layers
    cases = [((1.9, 1.2), True), ((1.9, 0.92), True), ((1.9, 0.85), False), ((1.05, 2.0), False), ((0.5, 0.5), False)]
    calls: list = []
    for (decode, batched), keep in cases:
        measure = _fake_measure(decode, batched, calls)
        choice, weights = choose_quantization(
            "auto", path, runner.arch, measure=measure, float_dtype=lambda: torch.bfloat16, **kw
        )
        assert choice.quantized == keep and (weights is not None) == keep, (decode, batched, choice)
        assert f"decode {decode:.2f}x" in choice.reason and "than bfloat16" in choice.reason, choice.reason
        assert choice.figures["batched_speedup"] == batched
        if weights is not None:
            weights.close()
    assert calls == [(layers, torch.bfloat16)] * len(cases)  # every decoder layer offered

    def no_float_dtype():
        raise AssertionError("gguf asked for the float dtype")

    choice, weights = choose_quantization("gguf", path, runner.arch, measure=None, float_dtype=no_float_dtype, **kw)
    assert choice.quantized and "model.quantization is gguf" in choice.reason and not choice.figures
    weights.close()

    # the figures are kept: a second start with the same cache decides without measuring
    cache, calls = MeasurementCache(tmp_path / "quantization-choice"), []
    for _ in range(2):
        measure = _fake_measure(0.8, 1.0, calls)
        choice, _ = choose_quantization("auto", path, runner.arch, measure=measure, cache=cache, **kw)
        assert not choice.quantized and "than float32" in choice.reason
    assert len(calls) == 1 and "cached" in choice.reason and len(list(cache.directory.glob("*.json"))) == 1
    choice, weights = choose_quantization(
        "auto",
        path,
        runner.arch,
        measure=_fake_measure(2.0, 1.0, calls),
        cache=cache,
        float_dtype=lambda: torch.bfloat16,
        **kw,
    )
    assert choice.quantized and len(calls) == 2  # another float dtype is another measurement
    weights.close()
    assert QC.decode_layers(1 << 20, 30, cache_bytes=32 << 20) == 30 and QC.decode_layers(1 << 20, 100, 32 << 20) == 64
    assert QC.decode_layers(1 << 30, 30, cache_bytes=32 << 20) == 1


def test_auto_measures_the_files_layers_and_the_runner_follows_the_figures(tiny_quantized):
    """The real measurement on a tiny file (no speed asserted: its figures decide, and the
    runner loads what they decided)."""
    from pkgd.runner.loader import quant_choice as QC

    runner = _runner(tiny_quantized["kquant"], quantization="auto")
    figures = runner.quantization.figures
    assert {"decode_speedup", "batched_speedup", "decode_quant_ms", "decode_float_ms"} <= set(figures)
    assert all(figures[k] > 0 for k in ("decode_quant_ms", "decode_float_ms", "batched_quant_ms", "batched_float_ms"))
    assert 1 <= figures["decode_layers"] <= runner.arch.num_hidden_layers
    assert runner.quantization.quantized == QC.decide(figures)
    assert isinstance(runner.model.lm_head, QuantizedLMHead) == runner.quantization.quantized
    _, out = _logits(runner, [[5, 6, 7]], 2)
    assert len(out["0"]) == 2


MOE_TYPES = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0", "ffn_gate_inp": "Q8_0"}
MOE_LOGIT_BOUND = 0.2  # measured 0.038 (Mixtral) and 0.045 (Qwen3-MoE), legacy 32-wide blocks


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
def test_moe_experts_stay_quantized_and_match_the_dequantized_float_path(tmp_path, arch):
    """llama.cpp's stacked experts (one type per stacked tensor; the router dequantized) run as a
    `QuantizedMoE` per MoE layer; logits within `LOGIT_BOUND` of the float path on the same file
    (the int8 rounding of each expert's input, as for the dense linears): `MOE_LOGIT_BOUND`."""
    from pkgd.runner.layers.quantized import QuantizedMoE

    hf = build_tiny(arch, tmp_path / "hf")
    path = write_gguf(hf, tmp_path / f"tiny-{arch}.gguf", quantize=lambda n: MOE_TYPES.get(n.split(".")[-2], "Q8_0"))
    # float32 K/V: the experts' rounding alone (16-bit K/V moves an int8-rounded input across a
    # rounding step now and then, and a near-tied router then picks another expert)
    quantized = _runner(path, cache_dtype="float32")
    assert quantized.quantization.quantized, quantized.quantization.reason
    assert quantized.model.cpu_decode is None  # the one-call step has dense MLPs only
    moes = [layer.mlp for layer in quantized.model.layers if isinstance(layer.mlp, QuantizedMoE)]
    assert len(moes) == (2 if arch == "mixtral" else 1)  # Qwen3-MoE's layer 1 is dense
    gate_up = moes[0].gate_up[1].qweight
    assert [s.qtype for s in gate_up.segments] == [2, 3]  # Q4_0 gate rows, then Q4_1 up rows
    assert moes[0].down[1].qweight.segments[0].qtype == 8  # Q8_0
    assert moes[0].gate.dtype == torch.float32
    dequantized = _runner(path, quantization="none")
    worst = 0.0
    for prompt in ([7, 9, 11], list(range(3, 40))):
        decoded, tokens = _logits(quantized, [prompt], 6)
        want = _all_position_logits(dequantized, prompt + tokens["0"][:-1])
        prefill = _all_position_logits(quantized, prompt + tokens["0"][:-1])
        worst = max(worst, float((decoded - want[len(prompt) - 1 :]).abs().max()), float((prefill - want).abs().max()))
    assert worst < MOE_LOGIT_BOUND, worst
