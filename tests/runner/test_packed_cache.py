"""The packed-weights cache of GGUF weights kept quantized (`pkgd.runner.loader.packed_cache`):
the first load stores the packed weights, a later one reads them instead of repacking and
runs the same logits; a changed GGUF, a corrupt file, a file that does not fit the model and
an unwritable cache all fall back to packing, and sleep level 2 reloads from the cache."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from structlog.testing import capture_logs
from tests.runner.test_quantized import LEGACY, _logits, _types
from tests.runner.tiny_gguf import write_gguf
from tests.runner.tiny_models import build_tiny

import pkgd_kernels.quant_layout as quant_layout
from pkgd.config.vllm_config import VllmConfig
from pkgd.model_files.resolve import resolve_model
from pkgd.runner.layers.quantized import packed_layers
from pkgd.runner.loader import packed_cache
from pkgd.runner.loader.packed_cache import PackedWeightsCache

PROMPT = [[5, 6, 7, 8]]
QKV = "layers.0.self_attn.qkv_proj"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """One C kernel build for the module (each test's model cache starts empty)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def runner_of(kernel_dir):
    """``runner_of(gguf_path)``: a runner keeping its weights quantized, its model cache beside the file."""

    def make(path):
        from pkgd.runner.model_runner import ModelRunner

        cfg = VllmConfig(
            model={"source": str(path), "cache_dir": str(path.parent / "cache"), "quantization": "gguf"},
            parallel={"cpu_kernel_cache": str(kernel_dir)},
        )
        return ModelRunner(cfg, resolve_model(cfg.model), device=torch.device("cpu"))

    return make


@pytest.fixture
def gguf(tmp_path):
    """A tiny legacy-typed llama GGUF in its own directory (its cache beside it, empty)."""
    hf = build_tiny("llama-plain", tmp_path / "hf")
    return write_gguf(hf, tmp_path / "tiny.gguf", quantize=_types(LEGACY))


@pytest.fixture
def packs(monkeypatch):
    """Counts `pack_gguf_rows` calls (the repacking the cache saves); ``forbid()`` makes it raise."""
    calls = {"n": 0, "forbid": False}
    real = quant_layout.pack_gguf_rows

    def counted(*a, **k):
        if calls["forbid"]:
            raise AssertionError("repacked although the packed weights are cached")
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr("pkgd.runner.layers.quantized.pack_gguf_rows", counted)
    return calls


def _cache_files(path):
    return sorted((path.parent / "cache" / packed_cache.DIRECTORY).glob("*.safetensors"))


def _actions(logs):
    return [(e["action"], e.get("reason", "")) for e in logs if e["event"] == "packed_weights" and "reason" in e]


def test_a_warm_load_reads_the_stored_weights_and_runs_the_same_logits(gguf, packs, runner_of):
    first = runner_of(gguf)
    assert packs["n"] == len(packed_layers(first.model)) > 0
    (stored,) = _cache_files(gguf)
    logits, tokens = _logits(first, PROMPT, 4)

    from safetensors import safe_open  # the file is plain safetensors: one uint8 tensor per layer

    with safe_open(str(stored), framework="pt") as f:
        assert set(f.keys()) == set(packed_layers(first.model))
        assert "pkgd" in f.metadata()
        assert torch.equal(f.get_tensor(QKV), first.model.layers[0].self_attn.qkv_proj.qweight.data)

    packs["forbid"] = True
    with capture_logs() as logs:
        warm = runner_of(gguf)
    assert _actions(logs) == [("read", "stored by an earlier load")]
    for name, layer in packed_layers(warm.model).items():
        want = packed_layers(first.model)[name].qweight
        assert layer.qweight.segments == want.segments and torch.equal(layer.qweight.data, want.data), name
        assert layer.qdata.data_ptr() == layer.qweight.data.data_ptr()
    assert warm.model.layers[0].self_attn.qkv_proj.qweight.data.data_ptr() % 64 == 0
    warm_logits, warm_tokens = _logits(warm, PROMPT, 4)
    assert warm_tokens == tokens and torch.equal(warm_logits, logits)
    assert _cache_files(gguf) == [stored]


def test_sleep_level_2_wakes_up_from_the_cache(gguf, packs, runner_of):
    runner = runner_of(gguf)
    _, before = _logits(runner, PROMPT, 3)
    packs["forbid"] = True
    runner.sleep(2)
    runner.wake_up(["weights"])
    _, after = _logits(runner, PROMPT, 3)
    assert after == before


def test_a_changed_gguf_is_not_served_from_the_stale_cache(gguf, tmp_path, packs, runner_of):
    runner_of(gguf)
    # Other weights in a file of the same size at the same path: only the mtime tells them apart.
    other = write_gguf(
        build_tiny("llama-plain", tmp_path / "hf2", seed=1), tmp_path / "other.gguf", quantize=_types(LEGACY)
    )
    assert other.stat().st_size == gguf.stat().st_size
    fresh_logits, _ = _logits(runner_of(other), PROMPT, 3)  # its own entry: packed from its blocks
    stat = gguf.stat()
    shutil.copyfile(other, gguf)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    before = packs["n"]
    with capture_logs() as logs:
        runner = runner_of(gguf)
    assert packs["n"] > before
    ((action, reason),) = _actions(logs)
    assert action == "packed" and "stale: mtime_ns" in reason
    logits, _ = _logits(runner, PROMPT, 3)
    assert torch.equal(logits, fresh_logits)
    packs["forbid"] = True  # rewritten for the new file
    assert torch.equal(_logits(runner_of(gguf), PROMPT, 3)[0], fresh_logits)


def test_another_file_has_its_own_cache_entry(gguf, tmp_path, packs, runner_of):
    runner_of(gguf)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gguf, copy)
    before = packs["n"]
    runner_of(copy)  # same bytes, same cache directory, another path: another entry
    assert packs["n"] > before
    assert len(_cache_files(gguf)) == 2
    cache = PackedWeightsCache(tmp_path / "shared")
    assert cache.path(gguf, "LlamaForCausalLM") != cache.path(copy, "LlamaForCausalLM")
    assert cache.path(gguf, "LlamaForCausalLM") != cache.path(gguf, "MistralForCausalLM")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(gguf, packs, runner_of, damage):
    logits, _ = _logits(runner_of(gguf), PROMPT, 3)
    (stored,) = _cache_files(gguf)
    data = stored.read_bytes()
    stored.write_bytes({"garbage": os.urandom(5000), "truncated": data[: len(data) // 2], "empty": b""}[damage])
    before = packs["n"]
    with capture_logs() as logs:
        runner = runner_of(gguf)
    assert packs["n"] > before
    ((action, reason),) = _actions(logs)
    assert action == "packed" and reason.startswith(("unreadable", "not a packed-weights file")), reason
    assert torch.equal(_logits(runner, PROMPT, 3)[0], logits)
    assert stored.read_bytes() == data  # rewritten whole


def test_a_cache_file_that_does_not_fit_the_model_is_ignored(gguf, packs, runner_of):
    first = runner_of(gguf)
    logits, _ = _logits(first, PROMPT, 3)
    cache = PackedWeightsCache(gguf.parent / "cache" / packed_cache.DIRECTORY)
    layers = {name: m.qweight for name, m in packed_layers(first.model).items()}
    arch, raw = first.arch.architecture, first.arch.raw
    swapped = dict(layers)  # o_proj's bytes under qkv_proj's name: right file, wrong shape
    swapped[QKV] = layers["layers.0.self_attn.o_proj"]
    missing = {k: v for k, v in layers.items() if k != "lm_head"}
    for bad, why in ((swapped, f"does not fit the model: {QKV}"), (missing, "not stored")):
        assert cache.store(gguf, arch, raw, bad)
        before = packs["n"]
        with capture_logs() as logs:
            runner = runner_of(gguf)
        assert packs["n"] > before
        ((action, reason),) = _actions(logs)
        assert action == "packed" and why in reason, reason
        assert torch.equal(_logits(runner, PROMPT, 3)[0], logits)


def test_a_cache_that_cannot_be_written_only_warns(gguf, packs, runner_of):
    target = gguf.parent / "cache" / packed_cache.DIRECTORY
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("a file where the directory would go")
    with capture_logs() as logs:
        runner = runner_of(gguf)
    assert any(e["event"] == "packed_weights_not_cached" and e["log_level"] == "warning" for e in logs)
    assert runner.quantization.quantized and _logits(runner, PROMPT, 2)[1]
