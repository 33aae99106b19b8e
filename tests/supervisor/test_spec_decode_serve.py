"""Speculative decoding through the real daemon (`pkgd serve` with the real children and
SmolLM2) and the openai SDK: ``--speculative-config`` n-gram gives the greedy text of a
daemon without it and reports accepted tokens in ``/metrics``; a request's ``prediction``
(OpenAI Predicted Outputs) is its draft, with the accepted / rejected counts in usage."""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest
from supervisor_helpers import NEEDS_REAL_CHILDREN, merge

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_CHILDREN,
]

MODEL = "smollm2"
# The default dtype, as the other real-daemon tests (a float32 load outlasts the API server's
# start-up wait on a loaded machine). Answers are kept short: verification computes 1 + k
# positions in one batch whose attention spans are split differently from a one-token step's,
# which in bf16 can resolve a near tie the other way (docs/speculative-decoding.md).
# quantization none: both daemons on the dequantized float path, so their greedy texts compare
# (a start-up choice could differ between them); the quantized path is tested in its own tests.
REAL = {
    "model": {"name": MODEL, "max_model_len": 1024, "quantization": "none"},
    "cache": {"kv_cache_memory_bytes": 64 << 20},
    "supervisor": {"drain_timeout": 10, "engine_ready_timeout": 300},
}
SPEC = '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}'
TEXT = "The quick brown fox jumpd over the lazy dog. The farmer walkd to the market with fresh aples."
PROMPTS = [
    f"{TEXT}\n\nRewrite the text above, fixing the typos. Output only the corrected text.",
    "List the days of the week, one per line.",
]


def chat(client: openai.OpenAI, content: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=32, **kw
    )


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_ngram_daemon_gives_the_same_greedy_text_and_counts_acceptance(start_daemon):
    plain = start_daemon(REAL, real=True, name="plain")
    url = plain.wait_ready(600)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    want = [chat(client, p).choices[0].message.content for p in PROMPTS]
    plain.signal(signal.SIGTERM)
    assert plain.wait_exit(60) == 0

    spec = start_daemon(merge(REAL, {}), real=True, name="spec", argv=["--speculative-config", SPEC])
    url = spec.wait_ready(600)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    assert [chat(client, p).choices[0].message.content for p in PROMPTS] == want
    drafts = metric(url, "vllm:spec_decode_num_drafts_total")
    accepted = metric(url, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= metric(url, "vllm:spec_decode_num_draft_tokens_total")
    assert metric(url, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted

    # Predicted Outputs: the expected answer as the prediction; same text, counts in usage
    r = chat(client, PROMPTS[1], prediction={"type": "content", "content": want[1]})
    assert r.choices[0].message.content == want[1]
    details = r.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[1]}],
        temperature=0,
        max_tokens=32,
        prediction={"type": "content", "content": want[1]},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[1]
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    bad = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "text"}},
        timeout=30,
    )
    assert bad.status_code == 400 and "prediction" in json.dumps(bad.json())
