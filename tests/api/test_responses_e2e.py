"""The Responses API and vLLM's extra routes through real engine-core and API-server processes
serving SmolLM2-135M-Instruct, driven by the official ``openai`` client, unmodified."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pkgd.config.vllm_config import VllmConfig

from .test_responses import TEXT_ORDER  # the documented event order, one list for both
from .test_serving_e2e import MODEL, QUESTION, Daemon

pytestmark = pytest.mark.slow
SETTINGS = {
    # the dequantized float path: its greedy answers (Paris) are what the assertions expect; the
    # quantized path is tested in its own tests
    "model": {"max_model_len": 2048, "quantization": "none"},
    "frontend": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True, "responses_store_size": 4},
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
GREEDY = {"temperature": 0, "max_output_tokens": 32}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("responses"), config=VllmConfig.model_validate(SETTINGS))
    yield d
    d.stop()


def _chat(c: openai.OpenAI, messages: list[dict]) -> str:
    return (
        c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
        .choices[0]
        .message.content
    )


def test_create_plain_and_with_instructions_equal_the_chat_answer(daemon):
    c = daemon.client()
    r = c.responses.create(model=MODEL, input=QUESTION[0]["content"], **GREEDY)
    assert r.status == "completed" and "Paris" in r.output_text
    assert r.output_text == _chat(c, QUESTION)
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    brief = c.responses.create(model=MODEL, input=QUESTION[0]["content"], instructions="Answer in one word.", **GREEDY)
    assert brief.output_text == _chat(c, [{"role": "system", "content": "Answer in one word."}, *QUESTION])
    assert brief.instructions == "Answer in one word."


def test_stream_events_in_order_and_deltas_join_to_the_final_text(daemon):
    c = daemon.client()
    with c.responses.stream(model=MODEL, input=QUESTION[0]["content"], **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]] == TEXT_ORDER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (
        deltas
        == final.output_text
        == c.responses.create(model=MODEL, input=QUESTION[0]["content"], **GREEDY).output_text
    )


def test_a_function_tool_and_its_output_round_trip(daemon):
    c = daemon.client()
    r = c.responses.create(model=MODEL, input="What is the weather in Paris? Use the tool.", tools=[WEATHER], **GREEDY)
    assert r.tools[0].name == "get_weather"
    assert r.status == "completed" or r.incomplete_details.reason == "max_output_tokens"  # a 135M model rambles
    assert r.output and {item.type for item in r.output} <= {"message", "function_call"}
    for item in r.output:
        if item.type == "function_call":
            assert item.name == "get_weather" and isinstance(json.loads(item.arguments), dict)
    follow = c.responses.create(
        model=MODEL,
        tools=[WEATHER],
        **GREEDY,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        ],
    )
    assert follow.status in ("completed", "incomplete") and follow.output


def test_text_format_and_a_required_tool_constrain_the_output(daemon):
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        city: str

    c = daemon.client()
    parsed = c.responses.parse(
        model=MODEL, input="France's capital, as JSON.", text_format=Capital, temperature=0, max_output_tokens=64
    )
    assert isinstance(parsed.output_parsed, Capital) and parsed.output_parsed.city
    call = c.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=128,
    )
    [item] = [i for i in call.output if i.type == "function_call"]  # a valid call, by construction
    assert item.name == "get_weather" and isinstance(json.loads(item.arguments)["city"], str)


def test_previous_response_id_continues_a_stored_response(daemon):
    c = daemon.client()
    first = c.responses.create(model=MODEL, input="My name is Ada. Say hi.", store=True, **GREEDY)
    assert first.store is True and c.responses.retrieve(first.id).output_text == first.output_text
    second = c.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id and second.output_text
    # The first turn (its input and its answer) is in the second prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="not stored"):
        c.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")


def test_models_retrieve_ping_and_invocations(daemon):
    c = daemon.client()
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-nope")
    with httpx.Client(base_url=daemon.url, timeout=60) as http:
        assert http.get("/ping").status_code == 200
        r = http.post("/invocations", json={"messages": QUESTION, "max_tokens": 8, "temperature": 0}).json()
        assert r["object"] == "chat.completion" and r["choices"][0]["message"]["content"]
        r = http.post("/invocations", json={"prompt": "The sky is", "max_tokens": 4}).json()
        assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] == 4
