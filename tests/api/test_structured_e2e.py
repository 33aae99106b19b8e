"""Structured outputs and forced tool choice through real processes (an engine core serving
SmolLM2-135M-Instruct and an API server), driven by the official ``openai`` client and by
LangChain's ``ChatOpenAI``. One daemon for the module; generations are short."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import pytest
from pydantic import BaseModel, Field

from pkgd.config.vllm_config import VllmConfig

from .test_serving_e2e import MODEL, Daemon

pytestmark = pytest.mark.slow
PERSON = [{"role": "user", "content": "Describe a person as JSON: their name and age."}]

# 15 schemas: nested objects, arrays with min/max items, enums, anyOf, required/optional,
# string formats and patterns, bounded numbers.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 12}},
                        "required": ["city"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["person"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 3}
        },
        "required": ["tags"],
    },
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {
            "id": {
                "anyOf": [
                    {"type": "integer", "minimum": 1, "maximum": 999},
                    {"type": "string", "pattern": "^[a-z]{3}$"},
                ]
            }
        },
        "required": ["id"],
    },
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "nickname": {"type": "string", "maxLength": 10}},
        "required": ["name"],
    },
    {
        "type": "object",
        "properties": {"email": {"type": "string", "format": "email", "maxLength": 30}},
        "required": ["email"],
    },
    {"type": "object", "properties": {"born": {"type": "string", "format": "date"}}, "required": ["born"]},
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
    },
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}},
        "required": ["ok", "count"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "integer", "maximum": 99}, "y": {"type": "integer", "maximum": 99}},
                    "required": ["x", "y"],
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["points"],
    },
    {
        "type": "object",
        "properties": {"status": {"const": "done"}, "note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["status", "note"],
    },
    {
        "$defs": {
            "pet": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog"]},
                    "legs": {"type": "integer", "minimum": 0, "maximum": 4},
                },
                "required": ["kind", "legs"],
            }
        },
        "type": "object",
        "properties": {"pet": {"$ref": "#/$defs/pet"}},
        "required": ["pet"],
    },
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a time zone",
            "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"]},
        },
    },
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGS_SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(
        tmp_path_factory.mktemp("structured"),
        config=VllmConfig.model_validate(
            # float32 on the dequantized weights (quantization none): the mixed-batch test compares
            # greedy tokens batched against alone, which bf16's batch-shape-dependent rounding (auto
            # picks bf16 on some hosts) does not promise, and the float path's greedy answers are
            # what the assertions expect (the quantized path is tested in its own tests)
            {"model": {"max_model_len": 2048, "dtype": "float32", "quantization": "none"}}
        ),
    )
    yield d
    d.stop()


def _compact(**kw):
    return {"extra_body": {"structured_outputs": kw}} if kw else {}


def test_json_object_and_fifteen_schemas_validate(daemon):
    c = daemon.client()
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Return {"ok": true} as JSON.'}],
        response_format={"type": "json_object"},
        max_tokens=48,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)

    def ask(schema):
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
        return c.chat.completions.create(
            model=MODEL, messages=PERSON, response_format=fmt, max_tokens=64, temperature=0
        ).choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(SCHEMAS)) as pool:
        choices = list(pool.map(ask, SCHEMAS))
    stopped = 0
    for schema, choice in zip(SCHEMAS, choices, strict=True):
        if choice.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(choice.message.content), schema, format_checker=jsonschema.FormatChecker())
    assert stopped >= 12, [ch.message.content for ch in choices]


def test_parse_with_a_pydantic_model(daemon):
    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=120)

    r = daemon.client().chat.completions.parse(
        model=MODEL, messages=PERSON, response_format=Person, max_tokens=48, temperature=0
    )
    assert isinstance(r.choices[0].message.parsed, Person)


def test_regex_choice_and_grammar_on_completions(daemon):
    c = daemon.client()
    pattern = r"\d{3}-\d{4}"
    r = c.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=16,
        temperature=0.8,
        seed=1,
        logprobs=2,
        extra_body={"guided_regex": pattern},
    )
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, r.choices[0].text)
    lp = r.choices[0].logprobs  # of the masked distribution: every sampled token was allowed
    assert "".join(lp.tokens).startswith(r.choices[0].text) and all(x > -9999 for x in lp.token_logprobs)
    choices = ["yes", "no", "it depends"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = c.completions.create(
            model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=1.0, n=3, seed=2, extra_body=body
        )
        assert all(ch.text in choices and ch.finish_reason == "stop" for ch in r.choices)
    r = c.chat.completions.create(
        model=MODEL,
        messages=WEATHER,
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= "It is " ("sunny" | "rainy") "."'}},
    )
    assert r.choices[0].message.content in ("It is sunny.", "It is rainy.")


def _check_calls(calls, names):
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), ARGS_SCHEMA[name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_always_call(daemon, stream):
    c = daemon.client()
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names, finish in (
        ("required", {"get_weather", "get_time"}, "tool_calls"),
        (named, {"get_time"}, "stop"),
    ):
        kw = dict(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=choice, max_tokens=64, temperature=0)
        if not stream:
            r = c.chat.completions.create(**kw).choices[0]
            assert r.finish_reason == finish and r.message.content is None
            _check_calls([(tc.function.name, tc.function.arguments) for tc in r.message.tool_calls], names)
            continue
        calls: dict[int, list] = {}
        last = None
        pieces = 0
        for chunk in c.chat.completions.create(**kw, stream=True, parallel_tool_calls=False):
            for tc in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(tc.index, [None, ""])
                if tc.id:
                    assert entry[0] is None and tc.function.name
                    entry[0] = tc.function.name
                entry[1] += tc.function.arguments or ""
                pieces += 1
            last = chunk.choices[0].finish_reason or last
        assert last == finish and list(calls) == [0] and pieces > 2  # one call (parallel_tool_calls false), in pieces
        _check_calls([tuple(v) for v in calls.values()], names)


def test_langchain_with_structured_output_all_three_methods(daemon):
    langchain_openai = pytest.importorskip("langchain_openai")

    class Answer(BaseModel):
        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{daemon.url}/v1", api_key="none", temperature=0, max_tokens=64, max_retries=0
    )
    question = "Which city is the capital of France? Answer in JSON with keys city and country."
    for method in ("json_schema", "function_calling", "json_mode"):
        out = llm.with_structured_output(Answer, method=method).invoke(question)
        assert isinstance(out, Answer), method


def test_mixed_batch_leaves_unconstrained_requests_as_they_are_alone(daemon):
    c = daemon.client()
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def free(prompt):
        return c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    alone = [free(p) for p in prompts]

    def constrained(i):
        schema = {"type": "object", "properties": {f"n{i}": {"type": "integer", "maximum": 99}}, "required": [f"n{i}"]}
        r = c.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0, extra_body={"guided_json": schema}
        )
        return r.choices[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        free_futures = [pool.submit(free, p) for p in prompts]
        constrained_futures = [pool.submit(constrained, i) for i in range(8)]
        together = [f.result() for f in free_futures]
        forced = [f.result() for f in constrained_futures]
    assert together == alone
    for i, choice in enumerate(forced):
        if choice.finish_reason == "stop":
            assert list(json.loads(choice.text)) == [f"n{i}"]
