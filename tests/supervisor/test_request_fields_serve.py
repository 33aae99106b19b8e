"""Issue 34's request fields end to end: `pkgd serve` with the real children serving a tiny
random-weight Llama (SmolLM2's tokenizer, a vocabulary of its size), driven by the official
``openai`` client: ``prompt_logprobs``, ``allowed_token_ids``, ``bad_words``,
``truncate_prompt_tokens``, ``request_id`` and ``X-Request-Id``, a special token as a stop
string, and seeded sampling repeated across prefix-cache hits."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import openai
import pytest
from supervisor_helpers import NEEDS_REAL_CHILDREN, Daemon

from pkgd.config.sections import DEFAULT_MODEL_SOURCE

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_CHILDREN,
]

NAME = "tiny-llama"
VOCAB = 49152  # SmolLM2's tokenizer
MESSAGES = [{"role": "user", "content": "Name a city."}]


@pytest.fixture(scope="module")
def served():
    from tests.runner.tiny_models import build_tiny

    workdir = Path(tempfile.mkdtemp(prefix="pkgd-", dir="/tmp"))
    build_tiny("llama", workdir / "model", vocab_size=VOCAB)
    config = {
        "model": {
            "source": str(workdir / "model"),
            "tokenizer": DEFAULT_MODEL_SOURCE,
            "name": NAME,
            "max_model_len": 256,
        },
        "cache": {"num_blocks": 128},
        "parallel": {"cpu_threads": 1},
        "supervisor": {"engine_ready_timeout": 600},
    }
    (workdir / "d").mkdir()
    d = Daemon(workdir / "d", config, real=True)
    try:
        url = d.wait_ready(600)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, _tokenizer()
    finally:
        d.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


def _tokenizer():
    from pkgd.config.vllm_config import VllmConfig
    from pkgd.frontend.async_llm import load_frontend_tokenizer

    return load_frontend_tokenizer(VllmConfig())


def _one(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_prompt_logprobs_on_completions_and_chat(served):
    client, tok = served
    prompt = "The quick brown fox jumps over the lazy dog " * 3  # 30 tokens: a cached prefix the 2nd time
    runs = [
        client.completions.create(model=NAME, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2})
        for _ in range(2)
    ]
    for r in runs:
        lps = r.choices[0].model_extra["prompt_logprobs"]
        ids = tok.encode(prompt)
        assert len(lps) == r.usage.prompt_tokens == len(ids) and lps[0] is None
        for token_id, entry in zip(ids[1:], lps[1:]):
            assert str(token_id) in entry and 1 <= len(entry) <= 3  # the prompt token and the top 2
            assert all(e["logprob"] <= 0 and e["rank"] >= 1 for e in entry.values())
    assert runs[0].choices[0].model_extra["prompt_logprobs"] == runs[1].choices[0].model_extra["prompt_logprobs"]
    chat = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    lps = chat.model_extra["prompt_logprobs"]
    assert len(lps) == chat.usage.prompt_tokens and lps[0] is None and all(len(e) == 1 for e in lps[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=NAME, prompt="x", stream=True, extra_body={"prompt_logprobs": 1})


def test_allowed_token_ids_and_bad_words(served):
    client, tok = served
    paris, london, big, city, town = (_one(tok, w) for w in (" Paris", " London", " big", " city", " town"))
    bias = {str(paris): 30, str(london): 20}
    common = {"model": NAME, "max_tokens": 6, "temperature": 0}
    r = client.completions.create(
        prompt="Go", logit_bias=bias, extra_body={"allowed_token_ids": [paris, london]}, **common
    )
    assert r.choices[0].text == " Paris" * 6
    r = client.completions.create(
        prompt="Go",
        logit_bias=bias,
        extra_body={"allowed_token_ids": [paris, london], "bad_words": ["Paris"]},
        **common,
    )
    assert r.choices[0].text == " London" * 6
    # a two-token bad word: " city" never right after " big", though all three words come often
    r = client.completions.create(
        model=NAME,
        prompt="Go",
        max_tokens=60,
        temperature=1.0,
        seed=3,
        logit_bias={str(big): 30, str(city): 30, str(town): 30},
        extra_body={"allowed_token_ids": [big, city, town], "bad_words": ["big city"]},
    )
    words = r.choices[0].text.split()
    assert len(words) == 60 and set(words) == {"big", "city", "town"}
    assert "big city" not in r.choices[0].text and "big town" in r.choices[0].text


def test_truncate_prompt_tokens(served):
    client, _tok = served
    r = client.completions.create(
        model=NAME, prompt="one two three four five six seven", max_tokens=1, extra_body={"truncate_prompt_tokens": 4}
    )
    assert r.usage.prompt_tokens == 4
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=NAME, prompt="x", max_tokens=1, extra_body={"truncate_prompt_tokens": 257})


def test_request_id_and_the_x_request_id_header(served):
    client, _tok = served
    raw = client.chat.completions.with_raw_response.create(
        model=NAME, messages=MESSAGES, max_tokens=2, extra_body={"request_id": "order-42"}
    )
    assert raw.parse().id == "chatcmpl-order-42" and raw.headers["x-request-id"] == "chatcmpl-order-42"
    raw = client.completions.with_raw_response.create(
        model=NAME, prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "trace-9"}
    )
    assert raw.headers["x-request-id"] == "trace-9" and re.fullmatch(r"cmpl-trace-9-[0-9a-f]{8}", raw.parse().id)


def test_a_special_token_stop_string_stops(served):
    client, tok = served
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert start not in (tok.eos_token_id, None)
    force = {
        "model": NAME,
        "prompt": "Hi",
        "max_tokens": 5,
        "logit_bias": {str(start): 100},
        "extra_body": {"ignore_eos": True},
    }
    free = client.completions.create(**force)
    assert free.choices[0].finish_reason == "length" and free.choices[0].text == ""  # skipped, never stopped
    r = client.completions.create(stop=["<|im_start|>"], **force)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == "<|im_start|>"
    assert r.usage.completion_tokens == 1
    chat = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=5, stop=["<|im_start|>"], logit_bias={str(start): 100}
    )
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content == ""


def test_seeded_requests_repeat_across_prefix_cache_hits(served):
    client, _tok = served
    prompt = "Repeat after me: the same seed gives the same tokens, " * 2
    texts = {
        client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=1.0, seed=123).choices[0].text
        for _ in range(3)
    }
    assert len(texts) == 1
