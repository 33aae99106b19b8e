"""/v1/responses on the app with the in-process fake engine: items in (the prompt the chat
template renders), response objects and the Responses event stream out, tools, refusals and
stored responses. The official client against real processes is in test_responses_e2e.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pkgd.config.vllm_config import VllmConfig

from .conftest import ANSWER, served
from .fakes import EOS

pytestmark = pytest.mark.anyio
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TEXT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def _prompt(state, messages) -> list[int]:
    ip = state.llm.input_processor
    return ip.tokenize(ip.render_chat(messages), add_special_tokens=False)


def _events(text: str) -> list[dict]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        event = json.loads(lines["data"])
        assert lines["event"] == event["type"]
        events.append(event)
    return events


def _collapse(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


async def test_string_input_with_instructions(tokenizer):
    async with served(tokenizer) as (http, state, fake):
        r = (
            await http.post(
                "/v1/responses", json={"input": "What is the capital of France?", "instructions": "Be brief."}
            )
        ).json()
        assert r["object"] == "response" and r["id"].startswith("resp_") and r["status"] == "completed"
        [item] = r["output"]
        assert item["type"] == "message" and item["content"][0] == {
            "type": "output_text",
            "text": ANSWER,
            "annotations": [],
            "logprobs": [],
        }
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        assert fake.added[0].prompt_token_ids == _prompt(state, messages)
        n = len(fake.added[0].prompt_token_ids)
        assert r["usage"]["input_tokens"] == n and r["usage"]["output_tokens"] == len(tokenizer.encode(ANSWER)) + 1
        assert r["usage"]["total_tokens"] == n + r["usage"]["output_tokens"] and r["instructions"] == "Be brief."
        assert r["store"] is False and r["tool_choice"] == "auto" and r["text"] == {"format": {"type": "text"}}


async def test_items_render_as_the_equivalent_chat(tokenizer):
    items = [
        {"role": "developer", "content": "Use tools."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    chat = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    async with served(tokenizer) as (http, state, fake):
        r = await http.post(
            "/v1/responses", json={"input": items, "max_output_tokens": 3, "temperature": 0.5, "top_p": 0.9}
        )
        body = r.json()
        assert fake.added[0].prompt_token_ids == _prompt(state, chat)
        sp = fake.added[0].sampling_params
        assert (sp.max_tokens, sp.temperature, sp.top_p) == (3, 0.5, 0.9)
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["usage"]["output_tokens"] == 3 and body["max_output_tokens"] == 3


async def test_stream_events_in_documented_order(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        r = await http.post("/v1/responses", json={"input": "Hi", "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.text)
        assert _collapse([e["type"] for e in events]) == TEXT_ORDER
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        done = events[-1]["response"]
        assert text == ANSWER == done["output"][0]["content"][0]["text"] and done["status"] == "completed"
        assert events[0]["response"]["status"] == "in_progress" and done["usage"]["output_tokens"] > 0
        ids = {e["item_id"] for e in events if "item_id" in e}
        assert ids == {done["output"][0]["id"]}


async def test_function_calls_become_items_streamed_or_not(tokenizer):
    cfg = VllmConfig.model_validate({"frontend": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}})
    script = lambda req: tokenizer.encode(CALL, add_special_tokens=False) + [EOS]  # noqa: E731
    async with served(tokenizer, config=cfg, script=script) as (http, state, fake):
        body = {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "auto"}
        r = (await http.post("/v1/responses", json=body)).json()
        [call] = r["output"]
        assert (
            call["type"] == "function_call"
            and call["name"] == "get_weather"
            and json.loads(call["arguments"]) == {"city": "Paris"}
        )
        assert (
            call["call_id"].startswith("call_")
            and call["status"] == "completed"
            and r["tools"][0]["name"] == "get_weather"
        )
        events = _events((await http.post("/v1/responses", json={**body, "stream": True})).text)
        types = _collapse([e["type"] for e in events])
        assert types == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        final = events[-1]["response"]["output"][0]
        assert json.loads(final["arguments"]) == {"city": "Paris"} and final["call_id"] == events[2]["item"]["call_id"]


async def test_the_official_client_streams_through_the_app(tokenizer):
    """``client.responses.stream``'s accumulator accepts every event (ids, indexes, parts)."""
    async with served(tokenizer) as (http, _s, _f):
        client = openai.AsyncOpenAI(
            base_url="http://test/v1",
            api_key="x",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=http._transport, base_url="http://test"),
        )
        async with client.responses.stream(model="SmolLM2-135M-Instruct", input="Hi") as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(deltas) == final.output_text == ANSWER
        plain = await client.responses.create(model="SmolLM2-135M-Instruct", input="Hi")
        assert plain.output_text == ANSWER and plain.usage.total_tokens > 0


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "objekt"}}}},
            "text.format",
            "text.format",
        ),
        ({"input": "x", "reasoning": {"effort": "low"}}, None, "reasoning: unrecognized request argument"),
        ({"input": "x", "background": True}, None, "background"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "text only"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, None, "function tools"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "responses_store_size"),
        ({"input": "x", "max_output_tokens": 5000}, None, "max_model_len"),
    ],
)
async def test_refusals_are_openai_shaped_400s(tokenizer, body, param, fragment):
    async with served(tokenizer) as (http, _s, fake):
        r = await http.post("/v1/responses", json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and fragment in err["message"], err
        assert param is None or err["param"] == param
        assert not fake.added
    async with served(tokenizer, runner="pooling") as (http, _s, _f):
        assert (await http.post("/v1/responses", json={"input": "x"})).status_code == 400


async def test_text_format_becomes_the_chat_constraint(tokenizer):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    async with served(tokenizer) as (http, _s, fake):
        body = {
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        }
        r = await http.post("/v1/responses", json=body)
        assert r.status_code == 200 and r.json()["text"]["format"]["name"] == "place"
        so = fake.added[-1].sampling_params.structured_outputs
        assert so is not None and so.json == schema
        await http.post("/v1/responses", json={"input": "x", "text": {"format": {"type": "json_object"}}})
        assert fake.added[-1].sampling_params.structured_outputs.json_object


async def test_stored_responses_continue_and_are_bounded(tokenizer):
    cfg = VllmConfig.model_validate({"frontend": {"responses_store_size": 2}})
    async with served(tokenizer, config=cfg) as (http, state, fake):
        first = (
            await http.post("/v1/responses", json={"input": "Hi", "instructions": "Be brief.", "store": True})
        ).json()
        assert first["store"] is True
        assert (await http.get(f"/v1/responses/{first['id']}")).json() == first
        second = (
            await http.post("/v1/responses", json={"input": "And?", "previous_response_id": first["id"], "store": True})
        ).json()
        history = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": "And?"},
        ]
        assert fake.added[-1].prompt_token_ids == _prompt(state, history)  # instructions are not carried over
        assert second["previous_response_id"] == first["id"]
        streamed = _events((await http.post("/v1/responses", json={"input": "3", "store": True, "stream": True})).text)
        third = streamed[-1]["response"]["id"]
        assert (await http.get(f"/v1/responses/{third}")).status_code == 200
        r = await http.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
        assert r.status_code == 400 and "not stored" in r.json()["error"]["message"]  # evicted (size 2)
        assert (await http.get(f"/v1/responses/{first['id']}")).status_code == 404
