"""OpenAI and vLLM request fields → one structured-output constraint, and tool calls back out.

Every way a client can constrain the output becomes one `StructuredOutputsParams` (the engine
knows only that type):

* ``response_format``: ``json_object`` (any JSON object), ``json_schema`` (the schema; with
  ``strict: false`` properties it does not list are allowed, as JSON Schema allows them;
  otherwise none), ``text`` (no constraint);
* vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar`` fields;
* ``tool_choice`` ``"required"`` or a named function (chat only): the output is a call of
  the chosen tool(s) as JSON, arguments valid against the tool's ``parameters`` schema. A
  named function's output is its arguments object; ``"required"`` writes an array of
  ``{"name", "parameters"}`` objects (one item when ``parallel_tool_calls`` is false), as
  vLLM does. `tool_calls_of` turns that text into OpenAI ``tool_calls``.

Two sources at once is a 400 naming both. Used by the API routes and by ``pkgd run-batch``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from pkgd.api.protocol import ChatCompletionRequest, SamplingFields, StructuredOutputsRequest
from pkgd.sampling_params import StructuredOutputsParams


@dataclasses.dataclass
class Constraint:
    """The request's constraint, the request field it came from (for error messages), and
    for a forced tool choice the mode (``named`` / ``required``) and the tool names."""

    params: StructuredOutputsParams
    field: str
    tool_mode: str | None = None
    tool_names: list[str] = dataclasses.field(default_factory=list)


def request_constraint(body: SamplingFields) -> Constraint | None:
    """The constraint of a completion or chat request, None when the output is free.

    Raises:
        ValueError: two constraint sources, or a tool choice that names no given tool
            (the message starts with the field).
    """
    found: list[Constraint] = []
    if body.structured_outputs is not None:
        found.append(Constraint(_from_vllm(body.structured_outputs), "structured_outputs"))
    for name, kw in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(body, name)
        if value is not None:
            found.append(Constraint(StructuredOutputsParams(**{kw: value}), name))
    if isinstance(body, ChatCompletionRequest):
        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            found.append(Constraint(StructuredOutputsParams(json_object=True), "response_format"))
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
            so = StructuredOutputsParams(json=schema, json_strict=rf.json_schema.strict is not False)
            found.append(Constraint(so, f"response_format.json_schema ({rf.json_schema.name})"))
        tool = tool_constraint(body)
        if tool is not None:
            found.append(tool)
    if len(found) > 1:
        raise ValueError(
            f"{found[1].field.split(' ')[0]}: give one constraint, not both {found[0].field.split(' ')[0]} "
            f"and {found[1].field.split(' ')[0]}"
        )
    return found[0] if found else None


def _from_vllm(so: StructuredOutputsRequest) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=so.json_,
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
        json_object=bool(so.json_object),
        disable_any_whitespace=so.disable_any_whitespace,
    )


def tool_constraint(body: ChatCompletionRequest) -> Constraint | None:
    """The constraint of ``tool_choice`` ``"required"`` or a named function, else None."""
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    # OpenAI: "omitting parameters defines a function with an empty parameter list", so such a
    # call's arguments are {} (an open object let the model invent arguments until max_tokens)
    no_parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    tools = {t.function.name: t.function.parameters or no_parameters for t in body.tools or ()}
    if not tools:
        raise ValueError("tool_choice: a required or named tool choice needs tools")
    if choice == "required":
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": params},
                    "required": ["name", "parameters"],
                }
                for name, params in tools.items()
            ]
        }
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
        return Constraint(StructuredOutputsParams(json=schema), "tool_choice", "required", list(tools))
    name = choice.function.name  # type: ignore[union-attr]
    if name not in tools:
        raise ValueError(f"tool_choice: the function {name!r} is not among the tools ({', '.join(tools)})")
    return Constraint(StructuredOutputsParams(json=tools[name]), "tool_choice", "named", [name])


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_of(constraint: Constraint, text: str) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` from the output of a forced tool choice; [] when the text is not
    a complete call (cut by ``max_tokens``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if constraint.tool_mode == "named":
        calls: list[tuple[Any, Any]] = [(constraint.tool_names[0], value)]
    elif isinstance(value, list):
        calls = [(c.get("name"), c.get("parameters", {})) for c in value if isinstance(c, dict)]
    else:
        return []
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
        }
        for name, args in calls
        if isinstance(name, str)
    ]
