"""A new tool-call parser through real engine-core and API-server processes serving
SmolLM2-135M-Instruct, driven by the openai SDK's streaming helper. The small model does not
write tool calls by itself, so a ``structured_outputs`` regex makes it write, token by token,
exactly what a Mistral v11+ model writes; ``tool_choice`` stays "auto", so the ``mistral``
parser is what turns that text into calls."""

from __future__ import annotations

import json
import re

import pytest

from pkgd.config.vllm_config import VllmConfig

from .test_serving_e2e import MODEL, Daemon

pytestmark = pytest.mark.slow
SETTINGS = {
    "model": {"max_model_len": 2048},
    "frontend": {"tool_call_parser": "mistral", "enable_auto_tool_choice": True},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
    for name in ("get_weather", "get_forecast")
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and the forecast for Lyon?"}]
OUTPUT = (
    'I will check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    '[TOOL_CALLS]get_forecast[ARGS]{"city": "Lyon", "days": 3}'
)
CALLS = [("get_weather", {"city": "Paris"}), ("get_forecast", {"city": "Lyon", "days": 3})]
FORCE = {"structured_outputs": {"regex": re.escape(OUTPUT).replace('\\"', '"')}, "temperature": 0, "max_tokens": 96}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("tool_parsers"), config=VllmConfig.model_validate(SETTINGS))
    yield d
    d.stop()


def test_mistral_calls_stream_through_the_sdk_helper(daemon):
    c = daemon.client()
    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, extra_body=FORCE)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "I will check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == CALLS
    assert all(len(t.id) == 9 and t.id.isalnum() for t in msg.tool_calls)  # Mistral's id format

    pieces: dict[int, list[str]] = {0: [], 1: []}
    with c.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, extra_body=FORCE) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces[event.index].append(event.arguments_delta)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == CALLS
    assert all(len(p) > 1 for p in pieces.values())  # arguments arrive in pieces, per call
