"""Large request bodies are parsed, chat bodies templated and prompts tokenized in the API
server's worker process, not on a thread that would hold the GIL against the event loop; a
token-id prompt that cannot fit is refused before validation."""

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


def _count_tokenize(monkeypatch) -> list[int]:
    """A list that grows by one each time this process tokenizes (the worker is a fresh
    process: the patch does not reach it)."""
    from pkgd.frontend.input_processor import InputProcessor

    calls: list[int] = []
    original = InputProcessor.tokenize
    monkeypatch.setattr(InputProcessor, "tokenize", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    return calls


def _worker_pids(state) -> list[int]:
    procs = state.preprocess._procs
    return list(procs._processes) if procs is not None else []


async def test_a_large_chat_body_is_templated_and_tokenized_in_the_worker_with_the_same_prompt(tokenizer, monkeypatch):
    tokenized = _count_tokenize(monkeypatch)
    async with served(tokenizer) as (http, state, fake):
        assert (await http.post("/v1/chat/completions", json=_chat(max_tokens=2))).status_code == 200
        assert _worker_pids(state) == []  # under the default threshold: the thread did it
        on_thread = fake.added[0].prompt_token_ids
    assert tokenized == [1]
    async with served(tokenizer, config=ISOLATING) as (http, state, fake):
        r = await http.post("/v1/chat/completions", json=_chat(max_tokens=2))
        assert r.status_code == 200, r.text
        pids = _worker_pids(state)
        assert len(pids) == 1 and pids[0] != os.getpid()
        assert fake.added[0].prompt_token_ids == on_thread
        assert tokenized == [1]  # not here: in the worker
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
        ({"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}, 400, "leaves no room"),
        (
            {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}], "stop_token_ids": [10**6]},
            400,
            "stop_token_ids",
        ),  # the sampling parameters are checked before the prompt's length
    ],
    ids=["limit", "validation", "template", "model", "too long", "params first"],
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


async def test_large_completion_bodies_are_parsed_and_tokenized_in_the_worker(tokenizer, monkeypatch):
    body = {"prompt": [LONG, "hello there"], "max_tokens": 1, "add_special_tokens": False}
    tokenized = _count_tokenize(monkeypatch)
    async with served(tokenizer) as (http, state, fake):
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        on_thread = [r.prompt_token_ids for r in fake.added]
    assert len(tokenized) == 2
    async with served(tokenizer, config=ISOLATING) as (http, state, fake):
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert len(_worker_pids(state)) == 1 and len(tokenized) == 2  # none here
        assert [r.prompt_token_ids for r in fake.added] == on_thread
        state.preprocess.shutdown()


async def test_a_too_long_prompt_in_a_batch_is_named_alike_on_both_paths(tokenizer):
    body = {"prompt": ["hello", "word " * MAX_MODEL_LEN], "max_tokens": 1}
    answers = []
    for config in (None, ISOLATING):
        async with served(tokenizer, config=config) as (http, state, fake):
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 400 and "prompt[1]: the prompt has" in r.text, r.text
            answers.append(r.json())
            state.preprocess.shutdown()
    assert answers[0] == answers[1]


def test_the_worker_does_not_send_back_the_ids_of_a_prompt_that_cannot_fit(tokenizer, monkeypatch):
    from pkgd.api import preprocess, serving_chat
    from pkgd.frontend.input_processor import TokenizedPrompt

    monkeypatch.setattr(preprocess, "_worker_tok", tokenizer)  # as _install_tokenizer leaves it
    limits = VllmConfig().frontend.limits
    short = b'{"messages": [{"role": "user", "content": "hi"}]}'
    _, fits = serving_chat._parse_and_render(short, limits, MAX_MODEL_LEN)
    assert isinstance(fits, TokenizedPrompt) and fits.token_ids and len(fits.token_ids) == fits.num_tokens
    long = b'{"messages": [{"role": "user", "content": "%s"}]}' % (b"word " * MAX_MODEL_LEN)
    _, refused = serving_chat._parse_and_render(long, limits, MAX_MODEL_LEN)
    assert isinstance(refused, TokenizedPrompt) and refused.token_ids is None
    assert refused.num_tokens > MAX_MODEL_LEN


async def test_a_dead_worker_is_a_503_and_the_next_call_starts_another():
    pre = Preprocessor(1, process_min_bytes=1)
    first = await pre.run_isolated(os.getpid)
    with pytest.raises(APIError) as err:
        await pre.run_isolated(os._exit, 1)
    assert err.value.status == 503
    second = await pre.run_isolated(os.getpid)
    assert os.getpid() not in (first, second) and first != second
    pre.shutdown()


async def test_a_worker_that_dies_while_idle_is_replaced_at_once_and_no_request_fails():
    import asyncio
    import signal

    pre = Preprocessor(1, process_min_bytes=1)
    await pre.start()
    first = await pre.run_isolated(os.getpid)
    os.kill(first, signal.SIGKILL)
    for _ in range(200):  # replaced without a call asking for it
        procs = pre._procs
        if procs is not None and first not in procs._processes and procs._processes:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the dead worker was not replaced")
    assert await pre.run_isolated(os.getpid) not in (first, os.getpid())  # no 503
    pre.shutdown()


class _DiesWhenUnpickled:
    def __reduce__(self):
        return (os._exit, (3,))


async def test_a_worker_that_dies_while_it_starts_is_a_503_and_the_next_call_starts_another():
    tokenizers = iter([_DiesWhenUnpickled(), None])
    pre = Preprocessor(1, process_min_bytes=1, tokenizer=lambda: next(tokenizers))
    with pytest.raises(APIError) as err:
        await pre.run_isolated(os.getpid)
    assert err.value.status == 503
    assert await pre.run_isolated(os.getpid) != os.getpid()
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


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/invocations", _chat(max_tokens=2)),
        ("/invocations", {"prompt": [LONG, "hello there"], "max_tokens": 1}),
        ("/v1/responses", {"input": [{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}]}),
    ],
    ids=["invocations chat", "invocations completion", "responses"],
)
async def test_invocations_and_responses_send_large_bodies_to_the_worker(tokenizer, monkeypatch, path, body):
    tokenized = _count_tokenize(monkeypatch)
    async with served(tokenizer) as (http, state, fake):
        assert (await http.post(path, json=body)).status_code == 200
        on_thread = [r.prompt_token_ids for r in fake.added]
    assert len(tokenized) == len(on_thread)
    async with served(tokenizer, config=ISOLATING) as (http, state, fake):
        r = await http.post(path, json=body)
        assert r.status_code == 200, r.text
        assert len(_worker_pids(state)) == 1 and len(tokenized) == len(on_thread)  # none more here
        assert [r.prompt_token_ids for r in fake.added] == on_thread
        state.preprocess.shutdown()


@pytest.mark.parametrize("path", ["/invocations", "/v1/responses"])
async def test_their_errors_from_the_worker_are_the_same_4xx(tokenizer, path):
    long = "word " * MAX_MODEL_LEN
    body = {"messages": [{"role": "user", "content": long}]} if path == "/invocations" else {"input": long}
    answers = []
    for config in (None, ISOLATING):
        async with served(tokenizer, config=config) as (http, state, fake):
            r = await http.post(path, json=body)
            assert r.status_code == 400 and "leaves no room" in r.text, r.text
            assert fake.added == [] and len(_worker_pids(state)) == (config is ISOLATING)
            answers.append(r.json())
            state.preprocess.shutdown()
    assert answers[0] == answers[1]
