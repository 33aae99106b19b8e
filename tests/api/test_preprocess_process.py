"""Large request bodies are parsed (and chat bodies templated) in the API server's worker
process, not on a thread that would hold the GIL against the event loop; a token-id prompt
that cannot fit is refused before validation."""

from __future__ import annotations

import os
import pickle

import pytest

from pkgd.api.errors import APIError
from pkgd.api.preprocess import Preprocessor
from pkgd.config.vllm_config import VllmConfig

from .conftest import count_validations, served
from .fakes import MAX_MODEL_LEN

pytestmark = pytest.mark.anyio

ISOLATING = VllmConfig.model_validate({"frontend": {"preprocess_process_min_bytes": 1024}})
LONG = "word " * 400  # 2000 characters: a body over the 1024-byte threshold


def _chat(**extra):
    return {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}], **extra}


def _worker_pids(state) -> list[int]:
    procs = state.preprocess._procs
    return list(procs._processes) if procs is not None else []


async def test_a_large_chat_body_is_templated_in_the_worker_with_the_same_prompt(tokenizer):
    async with served(tokenizer) as (http, state, fake):
        assert (await http.post("/v1/chat/completions", json=_chat(max_tokens=2))).status_code == 200
        assert _worker_pids(state) == []  # under the default threshold: the thread did it
        on_thread = fake.added[0].prompt_token_ids
    async with served(tokenizer, config=ISOLATING) as (http, state, fake):
        r = await http.post("/v1/chat/completions", json=_chat(max_tokens=2))
        assert r.status_code == 200, r.text
        pids = _worker_pids(state)
        assert len(pids) == 1 and pids[0] != os.getpid()
        assert fake.added[0].prompt_token_ids == on_thread
        # below the API server in the CPU scheduler's share
        assert os.getpriority(os.PRIO_PROCESS, pids[0]) > os.getpriority(os.PRIO_PROCESS, 0)
        r = await http.post("/v1/chat/completions", json=_chat(max_tokens=2, stream=True))
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert _worker_pids(state) == pids  # one process, reused
        state.preprocess.shutdown()


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (_chat(n=10**6), 400, "frontend.limits.max_n"),  # the limits, checked in the worker
        ({"messages": [{"role": 7, "content": LONG}]}, 400, "messages"),  # pydantic's error
        (_chat(add_generation_prompt=True, continue_final_message=True), 400, "continue_final_message"),
        (_chat(model="no-such-model"), 404, "no-such-model"),  # checked after the template
    ],
    ids=["limit", "validation", "template", "model"],
)
async def test_errors_met_in_the_worker_are_the_same_4xx(tokenizer, body, status, words):
    answers = []
    for config in (None, ISOLATING):
        async with served(tokenizer, config=config) as (http, state, fake):
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == status and words in r.text, r.text
            assert fake.added == []
            assert len(_worker_pids(state)) == (config is ISOLATING)  # the worker met the error
            answers.append(r.json())
            state.preprocess.shutdown()
    assert answers[0] == answers[1]


async def test_large_completion_and_embedding_bodies_are_parsed_in_the_worker(tokenizer):
    async with served(tokenizer, config=ISOLATING) as (http, state, fake):
        r = await http.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert len(_worker_pids(state)) == 1
        state.preprocess.shutdown()


async def test_a_dead_worker_is_a_503_and_the_next_call_starts_another():
    pre = Preprocessor(1, process_min_bytes=1)
    first = await pre.run_isolated(os.getpid)
    with pytest.raises(APIError) as err:
        await pre.run_isolated(os._exit, 1)
    assert err.value.status == 503
    second = await pre.run_isolated(os.getpid)
    assert os.getpid() not in (first, second) and first != second
    pre.shutdown()


def test_api_errors_pickle_whole():
    err = pickle.loads(pickle.dumps(APIError(413, "too big", param="prompt", code="max_input_chars")))
    assert (err.status, err.message, err.param, err.code) == (413, "too big", "prompt", "max_input_chars")


@pytest.mark.parametrize(
    "prompt", [[1] * MAX_MODEL_LEN, [[1], [1] * (MAX_MODEL_LEN + 5)]], ids=["one prompt", "a batch"]
)
async def test_a_token_id_prompt_that_cannot_fit_is_refused_before_validation(tokenizer, monkeypatch, prompt):
    from pkgd.api.protocol import CompletionRequest

    validated = count_validations(monkeypatch, CompletionRequest)
    async with served(tokenizer) as (http, _state, fake):
        r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400 and f"max_model_len {MAX_MODEL_LEN}" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "prompt"
        assert validated == [] and fake.added == []
        r = await http.post("/v1/completions", json={"prompt": [1] * (MAX_MODEL_LEN - 1), "max_tokens": 1})
        assert r.status_code == 200, r.text
