"""`pkgd serve` with the real children serving a tiny random-weight Mixtral (SmolLM2's
tokenizer, a vocabulary of its size) through the official ``openai`` client: completions
equal transformers' greedy ``generate`` on the same weights, chat and streaming answer."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from supervisor_helpers import NEEDS_REAL_CHILDREN, Daemon

from pkgd.config.sections import DEFAULT_MODEL_SOURCE

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_CHILDREN,
]

NAME = "tiny-mixtral"
VOCAB = 49152  # SmolLM2's tokenizer


def test_pkgd_serve_serves_a_tiny_mixtral_through_the_openai_client(workdir):
    from tests.runner.tiny_models import build_tiny

    model_dir = workdir / "mixtral"
    hf = build_tiny("mixtral", model_dir, vocab_size=VOCAB)
    config = {
        "model": {"source": str(model_dir), "tokenizer": DEFAULT_MODEL_SOURCE, "name": NAME, "max_model_len": 256},
        "cache": {"num_blocks": 128},
        "parallel": {"cpu_threads": 1},
        "supervisor": {"engine_ready_timeout": 600},
    }
    (workdir / "d").mkdir()
    d = Daemon(workdir / "d", config, real=True)
    try:
        url = d.wait_ready(600)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == [NAME]
        g = torch.Generator().manual_seed(0)
        for n in (5, 17):
            prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
            r = client.completions.create(
                model=NAME, prompt=prompt, temperature=0, max_tokens=8, extra_body={"ignore_eos": True}
            )
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
            want = httpx.post(url + "/detokenize", json={"model": NAME, "tokens": out[0, n:].tolist()}, timeout=30)
            assert r.usage is not None and r.usage.completion_tokens == 8
            assert r.choices[0].text == want.json()["prompt"]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(
            model=NAME, messages=messages, temperature=0, max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 6
        text = chat.choices[0].message.content
        stream = client.chat.completions.create(
            model=NAME, messages=messages, temperature=0, max_tokens=6, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    finally:
        d.cleanup()
