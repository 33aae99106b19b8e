"""No silent no-ops: every field a completion or chat request parses is read somewhere in the
code that serves it, or the request is refused.

Walks the request models of ``pkgd.api.protocol`` (and the models nested in them) and looks
for a read of each field (``x.field`` or ``getattr(x, "field")``) in the modules that serve
requests. A field added to a model and never read fails here. Nested models that are handed
on whole (to the chat template, by ``model_dump``) are listed with the reason.
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

from pydantic import BaseModel

import pkgd
from pkgd.api import protocol, protocol_embeddings, protocol_responses

ROOT = Path(pkgd.__file__).parent
SERVING = [ROOT / "api", ROOT / "frontend", ROOT / "parsers"]
REQUESTS = [
    protocol.CompletionRequest,
    protocol.ChatCompletionRequest,
    protocol.TokenizeRequest,
    protocol.DetokenizeRequest,
    protocol_embeddings.EmbeddingRequest,
    protocol_responses.ResponsesRequest,
]
# Read whole: tools go to the chat template as dicts (``model_dump``), so every field reaches it.
READ_WHOLE = {protocol.ChatTool, protocol.FunctionDefinition}


def _models(model: type[BaseModel], seen: set) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        for arg in _flatten(field.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                _models(arg, seen)


def _flatten(tp) -> list:
    args = typing.get_args(tp)
    if not args:
        return [tp]
    return [t for a in args for t in _flatten(a)]


def _reads() -> set[str]:
    names: set[str] = set()
    for folder in SERVING:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    names.add(node.attr)
                elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
                    if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                        names.add(node.args[1].value)
    return names


def _getattr_tables() -> set[str]:
    """Field names read through ``getattr(body, name)`` over a table of names."""
    from pkgd.api import structured

    src = inspect.getsource(structured)
    return {n for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if f'"{n}"' in src}


def test_every_parsed_request_field_is_read():
    models: set = set()
    for m in REQUESTS:
        _models(m, models)
    reads = _reads() | _getattr_tables()
    unread = sorted(f"{m.__name__}.{name}" for m in models - READ_WHOLE for name in m.model_fields if name not in reads)
    assert not unread, f"parsed and never read (implement them or refuse them with a 400): {unread}"


def test_the_walk_finds_an_unread_field():
    class Probe(protocol.OpenAIModel):
        surely_nobody_reads_this_field: int = 0

    assert "surely_nobody_reads_this_field" not in _reads()
    assert Probe.model_fields
