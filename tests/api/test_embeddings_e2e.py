"""The embedded SmolLM2-135M-Instruct served with ``model.runner: pooling`` by real engine-core
and API-server processes, driven by the official ``openai`` client: embeddings equal the
offline ``LLM.embed()``; then the development routes on the same processes (prefix-cache
reset, sleep mode releasing the engine's memory and restoring it)."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest

from pkgd.config.vllm_config import VllmConfig

from .test_serving_e2e import MODEL, Daemon

pytestmark = pytest.mark.slow
SETTINGS = {
    # float32 on both sides: the comparison is serving path against offline path, and bf16's
    # batch-shape-dependent rounding (auto picks it on some hosts) would swamp the tolerance.
    # quantization none on both sides too: the dequantized float weights, whose size the sleep
    # test counts on (the quantized path is tested in its own tests).
    "model": {
        "max_model_len": 512,
        "runner": "pooling",
        "enable_sleep_mode": True,
        "dtype": "float32",
        "quantization": "none",
    },
    "frontend": {"server_dev_mode": True, "enable_tokenizer_info_endpoint": True},
    "cache": {"num_blocks": 256},
}
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]
HIDDEN = 576


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("embed"), config=VllmConfig.model_validate(SETTINGS))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def offline():
    from pkgd import LLM

    llm = LLM(runner="pooling", max_model_len=512, num_blocks=64, dtype="float32", quantization="none")
    yield llm
    llm.shutdown()


def _b64(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def _norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def _close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_embeddings_with_the_openai_client_equal_offline_embed(daemon, offline):
    c = daemon.client()
    want = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    one = c.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == HIDDEN
    assert _close(one.data[0].embedding, want[0])
    # float; left out (the client then asks for base64 and decodes it itself); base64 asked
    # for explicitly (the client hands the strings over: float32 little-endian bytes).
    for fmt in ("float", None, "base64"):
        many = c.embeddings.create(model=MODEL, input=TEXTS, **({"encoding_format": fmt} if fmt else {}))
        assert [d.index for d in many.data] == [0, 1, 2]
        vectors = [_b64(d.embedding) if fmt == "base64" else d.embedding for d in many.data]
        assert all(_close(v, w) for v, w in zip(vectors, want, strict=True)), fmt
        assert all(abs(_norm(v) - 1.0) < 1e-5 for v in vectors)  # normalised by default
    tokens = offline.get_tokenizer().encode(TEXTS[1])
    assert many.usage.prompt_tokens == sum(len(offline.get_tokenizer().encode(t)) for t in TEXTS)
    by_ids = c.embeddings.create(model=MODEL, input=[tokens])
    assert _close(by_ids.data[0].embedding, want[1])
    raw = c.embeddings.create(model=MODEL, input=TEXTS[0], extra_body={"normalize": False}).data[0].embedding
    assert _norm(raw) > 2 and _close([x / _norm(raw) for x in raw], want[0])


def test_refusals_are_openai_shaped_400s(daemon):
    c = daemon.client()
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        c.embeddings.create(model=MODEL, input="x", dimensions=64)
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def _rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_prefix_cache_reset_and_sleep_mode_release_memory(daemon):
    c = daemon.client()
    before = c.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    with httpx.Client(base_url=daemon.url, timeout=120) as http:
        assert http.post("/reset_prefix_cache").json() == {"reset": True}
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        pid = http.get("/server_info").json()["engines"][0]["pid"]
        awake = _rss(pid)
        assert http.post("/sleep", params={"level": 2}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        # Level 2 drops the weights (SmolLM2's float32 weights are ~540 MB) and the KV cache.
        assert _rss(pid) < awake - 300 * 2**20
        r = http.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 503 and "sleep" in r.json()["error"]["message"]
        assert http.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
        assert http.post("/wake_up").json() == {"is_sleeping": False}
    after = c.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    assert _close(after, before, 1e-6)


def test_tokenizer_info_serves_what_a_remote_tokenizer_reads(daemon):
    with httpx.Client(base_url=daemon.url, timeout=30) as http:
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] == "<|im_end|>" and "chat_template" in info
        eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
        assert len(eos) == 1
