"""``model.dtype: auto`` (`pkgd.runner.loader.dtype`): chosen by the CPU's features and a
start-up measurement, here with mocked feature sets and mocked measurements; and the
measurement itself on this host."""

from __future__ import annotations

import pytest
import torch

from pkgd.runner.loader import dtype as D

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16"}
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _figures(batched: float, decode: float) -> dict[str, float]:
    return {
        "batched_fp32_ms": 10.0,
        "batched_bf16_ms": 10.0 / batched,
        "batched_speedup": batched,
        "decode_fp32_ms": 1.0,
        "decode_bf16_ms": 1.0 / decode,
        "decode_speedup": decode,
    }


class Measure:
    """A mocked measurement that counts its calls."""

    def __init__(self, batched: float, decode: float) -> None:
        self.figures, self.calls = _figures(batched, decode), 0

    def __call__(self, shapes, kernels, layers):
        assert shapes == SHAPES and layers == 1
        self.calls += 1
        return self.figures


@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", "float16", None])
def test_avx2_only_hosts_stay_float32_without_measuring(checkpoint):
    """On an AVX2-only host bf16 GEMMs crawl: auto is float32, never slower than float32."""
    measure = Measure(5.0, 2.0)
    choice = D.choose_dtype("auto", checkpoint, "cpu", shapes=SHAPES, flags=AVX2, measure=measure)
    assert choice.dtype == torch.float32 and choice.reason == "no native bf16" and measure.calls == 0
    assert choice.features == ("avx2",) and choice.figures == {}


@pytest.mark.parametrize("flags", [AVX512_BF16, AMX, frozenset({"bf16"})], ids=["avx512_bf16", "amx", "arm-bf16"])
@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16"])
def test_bf16_capable_hosts_take_bf16_when_the_measurement_confirms(flags, checkpoint):
    measure = Measure(4.0, 1.5)
    choice = D.choose_dtype("auto", checkpoint, "cpu", shapes=SHAPES, flags=flags, measure=measure)
    assert choice.dtype == torch.bfloat16 and choice.reason == "bf16 measured faster" and measure.calls == 1
    assert choice.figures == measure.figures and set(choice.features) <= set(flags)


@pytest.mark.parametrize("batched,decode", [(0.9, 2.0), (4.0, 1.05), (1.0, 1.0), (0.01, 0.5)])
def test_bf16_capable_hosts_stay_float32_when_bf16_is_not_faster_on_both(batched, decode):
    choice = D.choose_dtype("auto", "bfloat16", "cpu", shapes=SHAPES, flags=AMX, measure=Measure(batched, decode))
    assert choice.dtype == torch.float32 and choice.reason == "bf16 not faster enough"
    assert choice.figures["batched_speedup"] == batched  # the figures that decided are kept


def test_explicit_dtypes_and_cuda_need_no_measurement():
    never = Measure(9.0, 9.0)
    assert D.choose_dtype("float16", "float32", "cpu", shapes=SHAPES, flags=AVX2, measure=never).dtype == torch.float16
    assert D.choose_dtype("float32", None, "cpu", shapes=SHAPES, flags=AMX, measure=never).reason == "requested"
    assert D.choose_dtype("auto", "bfloat16", "cuda", measure=never).dtype == torch.bfloat16
    assert D.choose_dtype("auto", "float16", "cuda", measure=never).dtype == torch.float16
    assert D.choose_dtype("auto", None, "cuda", measure=never).dtype == torch.float32
    assert D.choose_dtype("auto", "bfloat16", "cpu", shapes=(), flags=AMX, measure=never).reason == "nothing measured"
    assert never.calls == 0
    with pytest.raises(ValueError, match="model.dtype"):
        D.choose_dtype("int8", None, "cpu")


def test_the_choice_is_a_json_report():
    choice = D.choose_dtype("auto", "float32", "cpu", shapes=SHAPES, flags=AMX, measure=Measure(4.0, 1.5))
    report = choice.as_dict()
    assert (
        report["dtype"] == "bfloat16"
        and report["requested"] == "auto"
        and report["features"] == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    )
    assert report["figures"]["decode_speedup"] == 1.5


def test_layer_shapes_per_tensor_parallel_rank():
    from types import SimpleNamespace

    arch = SimpleNamespace(
        head_dim=64, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3
    )
    assert D.linear_shapes(arch) == SHAPES
    arch = SimpleNamespace(
        head_dim=8, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    assert D.linear_shapes(arch, tp_size=2) == [(16 + 16, 64), (64, 16), (96, 64), (64, 48)]


def test_the_measurement_on_this_host(monkeypatch):
    """The real measurement runs on small shapes, restores the thread count and reports
    positive times; where this CPU has native bf16, the choice follows its figures."""
    torch.set_num_threads(2)
    figures = D.measure_bf16_speedup([(128, 64), (64, 96)], repeat=2)
    assert torch.get_num_threads() == 2
    keys = {f"{k}_{x}" for k in ("batched", "decode") for x in ("fp32_ms", "bf16_ms", "speedup")}
    assert set(figures) == keys | {"decode_copies"} and figures["decode_copies"] == 1
    assert all(v > 0 for v in figures.values())
    choice = D.choose_dtype("auto", "float32", "cpu", shapes=[(128, 64)])
    if D.cpu_has_native_bf16():
        faster = min(choice.figures["batched_speedup"], choice.figures["decode_speedup"]) >= D.BF16_MIN_SPEEDUP
        assert (choice.dtype == torch.bfloat16) == faster
    else:
        assert choice.dtype == torch.float32 and not choice.figures


def test_the_decode_measurement_streams_past_the_last_level_cache(monkeypatch):
    """Enough copies of a layer to read twice the cache's bytes, never more than the model's
    layers, at least one; the real run times a pass over them per layer."""
    layer = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2: 14.2 MB of float32
    mib = 1 << 20
    assert D.decode_copies(layer, 30, cache_bytes=32 * mib) == 5  # 64 MiB / 14.2 MB, rounded up
    assert D.decode_copies(layer, 3, cache_bytes=32 * mib) == 3  # the whole model fits: as it runs
    assert D.decode_copies(layer, 30, cache_bytes=0) == 1
    assert D.decode_copies([(64, 64)], 1000, cache_bytes=mib) == 128
    assert D.last_level_cache_bytes() >= 0
    seen = []
    monkeypatch.setattr(D, "last_level_cache_bytes", lambda: 2 * 4 * 128 * 64)  # two copies of the layer
    real = D._measure
    monkeypatch.setattr(D, "_measure", lambda *a: seen.append(a[3]) or real(*a))
    figures = D.measure_bf16_speedup([(128, 64)], None, 8, repeat=1)
    assert seen == [4] and figures["decode_copies"] == 4
    assert figures["decode_fp32_ms"] > 0 and figures["decode_bf16_ms"] > 0


def test_the_runner_passes_the_models_layer_count(tiny_dirs, tmp_path, monkeypatch):
    from tests.runner.factory import make_runner

    copies = []
    monkeypatch.setattr(D, "cpu_flags", lambda: AMX)
    monkeypatch.setattr(D, "last_level_cache_bytes", lambda: 1 << 40)  # all layers
    monkeypatch.setattr(D, "_measure", lambda shapes, kernels, repeat, n: copies.append(n) or _figures(0.5, 0.5))
    model_dir, _ = tiny_dirs("qwen2")
    runner = make_runner(model_dir, dtype="auto", cache_dir=str(tmp_path))
    assert copies == [runner.arch.num_hidden_layers]


def test_the_runner_logs_its_choice(tiny_dirs):
    from structlog.testing import capture_logs
    from tests.runner.factory import make_runner

    model_dir, _ = tiny_dirs("qwen2")
    with capture_logs() as logs:
        runner = make_runner(model_dir, dtype="auto")
    (line,) = [e for e in logs if e["event"] == "dtype_choice"]
    assert line["dtype"] == str(runner.dtype).removeprefix("torch.") == runner.model_info.dtype
    assert line["requested"] == "auto" and line["reason"] in (
        "no native bf16",
        "bf16 measured faster",
        "bf16 not faster enough",
    )
    assert runner.dtype_choice.as_dict() == {
        k: line[k] for k in ("dtype", "requested", "reason", "features", "figures", "measurement")
    }


def test_a_restart_reuses_the_first_measurement(tmp_path):
    """The figures are kept per host and shapes: a second choice reads them instead of
    measuring, so it is the same choice even where a new measurement would differ."""
    cache = D.MeasurementCache(tmp_path / "dtype-choice")
    first = Measure(1.5, 1.12)
    choice = D.choose_dtype("auto", "float32", "cpu", shapes=SHAPES, flags=AMX, measure=first, cache=cache)
    assert choice.dtype == torch.bfloat16 and choice.measurement == "measured now" and first.calls == 1
    (stored,) = (tmp_path / "dtype-choice").glob("*.json")
    noisy = Measure(1.5, 1.05)  # a second measurement that would fall below the bar
    again = D.choose_dtype("auto", "float32", "cpu", shapes=SHAPES, flags=AMX, measure=noisy, cache=cache)
    assert noisy.calls == 0 and again.dtype == torch.bfloat16 and again.figures == choice.figures
    assert again.measurement == f"cached {stored}" and again.as_dict()["measurement"] == again.measurement


def test_the_cache_key_covers_what_the_figures_depend_on(tmp_path):
    cache = D.MeasurementCache(tmp_path)
    key = cache.key(SHAPES, None, AMX)
    assert key == cache.key(list(SHAPES), None, frozenset(AMX))
    assert key != cache.key(SHAPES[:2], None, AMX)
    assert key != cache.key(SHAPES, None, AVX512_BF16)
    assert key != cache.key(SHAPES, None, AMX, layers=30)
    from types import SimpleNamespace

    kernels = SimpleNamespace(path="/c/libpkgd-abc.so", bf16_impl="dpbf16")
    assert (
        key
        != cache.key(SHAPES, kernels, AMX)
        != cache.key(SHAPES, SimpleNamespace(path="/c/libpkgd-abc.so", bf16_impl="widen"), AMX)
    )
    # other shapes measure again, beside the first file
    for shapes in (SHAPES, SHAPES[:2]):
        measure = Measure(4.0, 1.5)
        measure_shapes = shapes

        def call(s, k, layers, measure=measure, expected=measure_shapes):
            assert s == list(expected)
            measure.calls += 1
            return measure.figures

        D.choose_dtype("auto", None, "cpu", shapes=shapes, flags=AMX, measure=call, cache=cache)
        assert measure.calls == 1
    assert len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.parametrize("content", ["", "{not json", '{"figures": {"batched_speedup": "x"}}', "[1, 2]"])
def test_a_damaged_cache_file_is_measured_again_and_replaced(tmp_path, content):
    cache = D.MeasurementCache(tmp_path)
    cache.path(cache.key(SHAPES, None, AMX)).write_text(content)
    measure = Measure(4.0, 1.5)
    choice = D.choose_dtype("auto", None, "cpu", shapes=SHAPES, flags=AMX, measure=measure, cache=cache)
    assert measure.calls == 1 and choice.measurement == "measured now" and choice.dtype == torch.bfloat16
    assert cache.load(cache.key(SHAPES, None, AMX)) == measure.figures


def test_an_unwritable_cache_still_chooses(tmp_path):
    from structlog.testing import capture_logs

    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = D.MeasurementCache(blocker / "dtype-choice")  # a directory under a file cannot exist
    with capture_logs() as logs:
        choice = D.choose_dtype("auto", None, "cpu", shapes=SHAPES, flags=AMX, measure=Measure(0.9, 2.0), cache=cache)
    assert choice.dtype == torch.float32 and choice.reason == "bf16 not faster enough"
    assert [e["event"] for e in logs] == ["dtype_measurement_not_cached"]


def test_the_runner_keeps_its_measurement_in_the_model_cache(tiny_dirs, tmp_path, monkeypatch):
    """Two starts of the runner on a (mocked) bf16 host: the first measures and stores under
    ``model.cache_dir``/dtype-choice, the second reads it and runs the same dtype."""
    from tests.runner.factory import make_runner

    calls = []

    def fake_measure(shapes, kernels, repeat, copies):
        calls.append(shapes)
        return _figures(0.5, 0.5)  # float32 wins: the runner needs no bf16 packing path here

    monkeypatch.setattr(D, "cpu_flags", lambda: AMX)
    monkeypatch.setattr(D, "_measure", fake_measure)
    model_dir, _ = tiny_dirs("qwen2")
    first = make_runner(model_dir, dtype="auto", cache_dir=str(tmp_path))
    second = make_runner(model_dir, dtype="auto", cache_dir=str(tmp_path))
    assert len(calls) == 1 and first.dtype == second.dtype == torch.float32
    assert first.dtype_choice.measurement == "measured now"
    (stored,) = (tmp_path / "dtype-choice").glob("*.json")
    assert second.dtype_choice.measurement == f"cached {stored}"
    assert second.dtype_choice.reason == "bf16 not faster enough"
