"""The tool-call parsers of `pkgd.parsers` on outputs recorded in each model family's format:
whole text (`extract`) and streamed in every split, char by char and in random pieces. A
stream must give the same content and calls as the whole text, the name only in a call's
first delta, and never drop text that is not a call."""

from __future__ import annotations

import json
import random

import pytest

from pkgd.parsers import load_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        },
    },
}
WRITE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "mode": {"type": ["object", "null"]},
            },
        },
    },
}
TOOLS = [WEATHER, WRITE]
PARIS = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {"tz": "Europe/Paris"})

# (parser, model output as the model writes it, content, calls as (name, arguments))
RECORDED = [
    # ---- llama3_json: Llama 3.1/3.2/3.3 with JSON tool calling ----
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}',
        None,
        [PARIS, TIME],
    ),
    (
        "llama3_json",
        "Let me look that up.\n\n"
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}\nOne moment.',
        "Let me look that up.\n\n\nOne moment.",
        [PARIS],
    ),
    (
        "llama3_json",
        'In C: `if (x) { y(); }`, and JSON {"name": "Ada", "born": 1815} or {"id": 1} are not calls.',
        'In C: `if (x) { y(); }`, and JSON {"name": "Ada", "born": 1815} or {"id": 1} are not calls.',
        [],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "São Paulo \\"SP\\" {x}", "days": [1, {"n": 2}]}}',
        None,
        [("get_weather", {"city": 'São Paulo "SP" {x}', "days": [1, {"n": 2}]})],
    ),
    # ---- mistral: pre-v11 (Mistral 7B v0.3, NeMo) and v11+ (Small 3.2, Magistral, Devstral) ----
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        None,
        [PARIS, TIME],
    ),
    (
        "mistral",
        'I will check both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
        "I will check both.",
        [PARIS, TIME],
    ),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}', None, [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', None, [PARIS]),
    (
        "mistral",
        "Use [TOOL] tags like [TOOL_CALLS ] or [TOOL_CALLS]? no.",
        "Use [TOOL] tags like [TOOL_CALLS ] or [TOOL_CALLS]? no.",
        [],
    ),
    # ---- pythonic: Llama 3.2 (pythonic template), Llama 4, ToolACE ----
    (
        "pythonic",
        "[get_weather(city=\"Paris\"), get_time(tz='Europe/Paris')]",
        None,
        [PARIS, TIME],
    ),
    (
        "pythonic",
        '<|python_start|>[get_weather(city="Paris", days=3, metric=True)]<|python_end|>',
        None,
        [("get_weather", {"city": "Paris", "days": 3, "metric": True})],
    ),
    (
        "pythonic",
        'Checking now. [write_file(path="a.py", content="x = [1, 2]\\nprint(\'),\')", mode=None)] Done.',
        "Checking now.  Done.",
        [("write_file", {"path": "a.py", "content": "x = [1, 2]\nprint('),')", "mode": None})],
    ),
    (
        "pythonic",
        "See [1], [the docs](https://x.y), [print('hi')] and [ ] for [a list].",
        "See [1], [the docs](https://x.y), [print('hi')] and [ ] for [a list].",
        [],
    ),
    ("pythonic", "[get_time()]", None, [("get_time", {})]),
    # ---- qwen3_coder: Qwen3-Coder-30B-A3B / 480B ----
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "days": 3, "metric": True})],
    ),
    (
        "qwen3_coder",
        "I'll create the file.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/app.py\n</parameter>\n"
        '<parameter=content>\ndef main():\n    print("</param>")\n\n</parameter>\n<parameter=mode>\n{"append": false}\n'
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>",
        "I'll create the file.",
        [
            (
                "write_file",
                {"path": "src/app.py", "content": 'def main():\n    print("</param>")\n', "mode": {"append": False}},
            ),
            PARIS,
        ],
    ),
    (
        "qwen3_coder",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> and <tool_c',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> and <tool_c',
        [],
    ),
    (
        "qwen3_coder",  # not in the schema, or not convertible: the text, as a string
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=unit>\n7\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        [("get_weather", {"days": "three", "unit": "7"})],
    ),
    (
        "qwen3_coder",  # the model stopped before </function>: the call ends with the text
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
        None,
        [PARIS],
    ),
    # ---- deepseek_v3: DeepSeek-V3-0324, R1-0528; and the V3.1 layout ----
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
        '```json\n{"tz": "Europe/Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        None,
        [PARIS, TIME],
    ),
    (
        "deepseek_v3",
        "Let me check the weather.\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Paris", "note": "```"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>Sure.',
        "Let me check the weather.\n\nSure.",
        [("get_weather", {"city": "Paris", "note": "```"})],
    ),
    (
        "deepseek_v3",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        None,
        [PARIS],
    ),
    (
        "deepseek_v3",
        "Tokens like <｜tool▁calls▁begin｜>oops and <｜tool▁call are text.",
        "Tokens like <｜tool▁calls▁begin｜>oops and <｜tool▁call are text.",
        [],
    ),
]

# Cut by max_tokens inside a call: whole text gives it back as content; a stream has sent it.
CUT = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"ci'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa'),
    ("pythonic", '[get_weather(city="Pa'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"ci'),
]


def _stream(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], int]:
    """(content, [(name, arguments)], number of argument deltas) of a streamed output."""
    p = load_parser("tool", name)(tools=TOOLS)
    content, calls, pieces_sent = "", {}, 0
    for piece in [*pieces, None]:
        c, deltas = p.feed(piece) if piece is not None else p.flush()
        content += c
        for d in deltas:
            assert (d.name is not None) == (d.index not in calls), "the name comes in a call's first delta only"
            if d.index not in calls:
                assert d.index == len(calls), "calls are numbered in order"
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
            pieces_sent += bool(d.arguments)
    return content, [tuple(calls[i]) for i in sorted(calls)], pieces_sent


def _check(name: str, text: str, content: str | None, calls: list, pieces: list[str]) -> None:
    got_content, got_calls, _ = _stream(name, pieces)
    assert (got_content.strip() or None) == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_whole_text(name, text, content, calls):
    got_content, got_calls = load_parser("tool", name).extract(text, TOOLS)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_streamed_in_two_at_every_cut(name, text, content, calls):
    for cut in range(len(text) + 1):
        _check(name, text, content, calls, [text[:cut], text[cut:]])


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_streamed_char_by_char_and_in_random_pieces(name, text, content, calls):
    _check(name, text, content, calls, list(text))
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        _check(name, text, content, calls, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])


@pytest.mark.parametrize("name", ["llama3_json", "mistral", "qwen3_coder", "deepseek_v3", "pythonic"])
def test_arguments_arrive_in_pieces_as_they_are_written(name):
    text = next(t for n, t, _c, calls in RECORDED if n == name and calls and len(calls) == 2)
    _content, calls, pieces_sent = _stream(name, list(text))
    assert len(calls) == 2 and pieces_sent > len(calls)


@pytest.mark.parametrize(("name", "text"), CUT)
def test_a_call_cut_by_max_tokens(name, text):
    assert load_parser("tool", name).extract(text, TOOLS) == (text, [])
    content, calls, _ = _stream(name, list(text))
    assert content == "" and [n for n, _a in calls] == ["get_weather"]


@pytest.mark.parametrize("name", ["llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3"])
def test_text_without_calls_streams_as_it_comes(name):
    """Plain text is not held back beyond a possible marker start."""
    p = load_parser("tool", name)(tools=TOOLS)
    assert p.feed("The weather in Paris is sunny") == ("The weather in Paris is sunny", [])
    assert p.flush() == ("", [])


def test_mistral_keeps_special_tokens_and_uses_its_id_format():
    cls = load_parser("tool", "mistral")
    assert cls.skip_special_tokens is False and load_parser("tool", "qwen3_coder").skip_special_tokens
    _content, calls = cls.extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', TOOLS)
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()


# (parser, text before, a look-alike of the marker, the character that shows it is not one)
LOOK_ALIKES = [
    ("llama3_json", "Use ", "{", "x"),
    ("llama3_json", "Use ", '{"', "i"),
    ("mistral", "See ", "[TOOL_CALLS", "]?"),
    ("pythonic", "See ", "[", "1"),
    ("pythonic", "See ", "[print", '("'),
    ("qwen3_coder", "Use ", "<tool_call>", "{"),
    ("deepseek_v3", "Use ", "<｜tool▁calls▁begin｜>", "x"),
]


@pytest.mark.parametrize(("name", "before", "alike", "tell"), LOOK_ALIKES)
def test_a_marker_look_alike_is_content_as_soon_as_it_is_told_apart(name, before, alike, tell):
    p = load_parser("tool", name)(tools=TOOLS)
    held, _ = p.feed(before + alike)
    assert held == before  # the look-alike could still start a call: held back
    content, deltas = p.feed(tell)
    assert deltas == [] and before + content + p.feed(" more")[0] + p.flush()[0] == before + alike + tell + " more"
    assert content.startswith(alike[0])  # released without waiting for the end of the text
