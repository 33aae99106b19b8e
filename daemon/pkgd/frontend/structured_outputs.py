"""Checking a structured-output constraint before it reaches the engine (frontend side).

A bad constraint must be a 400 naming the field and the reason, never an engine error later
(`pkgd.engine.structured_output` compiles what passes here). The check builds the constraint's
grammar with xgrammar itself, so "valid here" means "compiles there"; on top of that, a JSON
schema is checked against its meta-schema (`jsonschema`), and keywords xgrammar would
silently not enforce (``not``, ``if``/``then``/``else``, ``uniqueItems``, ...) and a few
schemas no value can satisfy are refused, so every output that finishes with ``"stop"``
validates against the schema it was asked for.

API servers never import torch, and the ``xgrammar`` package's ``__init__`` imports it (for
its matcher and kernels, which only the engine needs). `load_xgrammar` therefore loads, in a
process without torch, only xgrammar's native binding and its ``grammar`` module (what
``Grammar.from_json_schema`` / ``from_regex`` / ``from_ebnf`` need), with torch's import
blocked while its FFI layer probes for it. Processes that already have torch (the engine,
the offline `LLM`) get the whole package.

`ConstraintValidator` runs checks on a small thread pool (they are CPU work and must not
stall an API server's event loop), caches verdicts by constraint, and bounds the work: at most
``max_pending`` checks wait at once, and constraints above ``max_bytes`` are refused.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import importlib.abc
import importlib.util
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

from pkgd.sampling_params import StructuredOutputsParams, build_grammar, constraint_error

# JSON-schema keywords the grammar cannot enforce: refused rather than silently ignored.
# (Checked against xgrammar 0.2.8: these accept values the schema rejects.)
UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependentRequired",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
)
MAX_CONSTRAINT_BYTES = 256 * 1024
# JSON objects and arrays nested in a schema: the meta-schema check and the walk below recurse
# once or more per level, and Python's default recursion limit ran out near 128 nested arrays
# (100 nested properties, 200 deep) as schemas; real ones nest a few levels. A schema within
# the bound that still runs out of stack is refused all the same (check_json_schema)
MAX_SCHEMA_DEPTH = 100
_lock = threading.Lock()
_xgr: Any = None


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is not imported in an API server")
        return None


@contextlib.contextmanager
def _torch_blocked() -> Iterator[None]:
    blocker = _NoTorch()
    sys.meta_path.insert(0, blocker)
    try:
        yield
    finally:
        sys.meta_path.remove(blocker)


def load_xgrammar() -> Any:
    """An object with xgrammar's ``Grammar`` (the full module where torch is loaded)."""
    global _xgr
    with _lock:
        if _xgr is not None:
            return _xgr
        if (
            "torch" in sys.modules
            or isinstance(sys.modules.get("xgrammar"), types.ModuleType)
            and hasattr(sys.modules["xgrammar"], "GrammarMatcher")
        ):
            import xgrammar

            _xgr = xgrammar
            return _xgr
        spec = importlib.util.find_spec("xgrammar")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("xgrammar is not installed")
        shell = types.ModuleType("xgrammar")
        shell.__path__ = list(spec.submodule_search_locations)
        shell.__spec__ = spec
        sys.modules["xgrammar"] = shell  # the package without its __init__ (which needs torch)
        with _torch_blocked():
            importlib.import_module("xgrammar.load_binding")
            grammar = importlib.import_module("xgrammar.grammar")
        _xgr = types.SimpleNamespace(Grammar=grammar.Grammar)
        return _xgr


def check(
    so: StructuredOutputsParams, field: str = "structured_outputs", *, max_bytes: int = MAX_CONSTRAINT_BYTES
) -> None:
    """Raise `ValueError` ("``field``: reason") when the constraint is invalid, cannot be
    enforced, admits no output, or is larger than ``max_bytes`` as text. ``field`` is the
    request field it came from."""
    try:
        so.verify()
        kind, text, _, _ = so.key()
    except ValueError as exc:
        raise ValueError(_renamed(exc, field)) from None
    _check_size(text, field, max_bytes)
    if kind == "json":
        schema = so.json if isinstance(so.json, dict) else __import__("json").loads(text)
        check_json_schema(schema, field)
    xgr = load_xgrammar()
    try:
        build_grammar(xgr, so)
    except Exception as exc:  # xgrammar raises RuntimeError subclasses with the reason
        raise ValueError(f"{field}: {_what(kind)}: {constraint_error(exc)}") from None


def _check_size(text: str, field: str, max_bytes: int) -> None:
    size = len(text.encode())
    if size > max_bytes:
        raise ValueError(
            f"{field}: the constraint is {size} bytes, more than frontend.limits.max_constraint_bytes allows "
            f"({max_bytes})"
        )


def _renamed(exc: ValueError, field: str) -> str:
    """A `StructuredOutputsParams` shape error under the request field it came from."""
    return field + str(exc).removeprefix("structured_outputs")


def _what(kind: str) -> str:
    return {
        "json": "invalid JSON schema",
        "regex": "invalid regex",
        "grammar": "invalid grammar",
        "choice": "invalid choice",
        "json_object": "invalid JSON object constraint",
    }[kind]


def check_json_schema(schema: Any, field: str) -> None:
    """Meta-schema validity, then the keywords the grammar does not enforce and the
    schemas that no value satisfies. Raises `ValueError` naming ``field`` and the path."""
    import jsonschema

    if not isinstance(schema, dict | bool):
        raise ValueError(
            f"{field}: invalid JSON schema: a schema is an object or a boolean, got {type(schema).__name__}"
        )
    if (depth := _nesting(schema)) > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"{field}: invalid JSON schema: objects and arrays nested {depth} deep, more than {MAX_SCHEMA_DEPTH}"
        )
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
        _walk(schema, field, "#")
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ValueError(f"{field}: invalid JSON schema at {where}: {exc.message}") from None
    except RecursionError:  # within the depth bound but on a deep stack: still the request's schema
        raise ValueError(f"{field}: invalid JSON schema: nested too deeply to check") from None


def _nesting(value: Any) -> int:
    """How deep JSON objects and arrays nest in ``value`` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


def _walk(node: Any, field: str, path: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, field, f"{path}/{i}")
        return
    if not isinstance(node, dict):
        return
    for kw in UNENFORCED_KEYWORDS:
        if kw in node and not (kw == "uniqueItems" and node[kw] is False):
            raise ValueError(
                f"{field}: JSON schema keyword {kw!r} at {path} is not supported (it cannot be enforced "
                "while generating)"
            )
    if isinstance(node.get("pattern"), str):  # xgrammar ignores what it cannot enforce in a pattern
        try:
            load_xgrammar().Grammar.from_regex(node["pattern"])
        except Exception as exc:
            raise ValueError(f"{field}: JSON schema pattern at {path}: {constraint_error(exc)}") from None
    if "multipleOf" in node and node.get("type") != "integer":
        raise ValueError(f"{field}: JSON schema keyword 'multipleOf' at {path} is only supported with type 'integer'")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise ValueError(
            f"{field}: JSON schema 'allOf' with more than one schema at {path} is not supported; merge them into one"
        )
    props = node.get("properties")
    if node.get("additionalProperties") is False and isinstance(node.get("required"), list):
        missing = [r for r in node["required"] if not isinstance(props, dict) or r not in props]
        if missing:
            raise ValueError(
                f"{field}: the JSON schema at {path} can never be satisfied: it requires {missing[0]!r}, "
                "which its properties do not allow (additionalProperties is false)"
            )
    if "const" in node and "type" in node and not _has_type(node["const"], node["type"]):
        raise ValueError(
            f"{field}: the JSON schema at {path} can never be satisfied: const {node['const']!r} is not of "
            f"type {node['type']!r}"
        )
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):
            continue
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, field, f"{path}/{key}/{name}")
        elif isinstance(value, dict | list):
            _walk(value, field, f"{path}/{key}")


_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}


def _has_type(value: Any, types_: Any) -> bool:
    for t in types_ if isinstance(types_, list) else [types_]:
        if t in ("number", "integer"):
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and (t == "number" or float(value).is_integer())
            ):
                return True
        elif t in _TYPES and isinstance(value, _TYPES[t]):
            return True
    return False


class ConstraintValidator:
    """Runs `check` off the event loop, bounded, with verdicts cached by constraint.

    `check` (async) runs it on the validator's own threads; `check_blocking` in the calling
    thread, for callers already off the event loop (the API server's request pool).

    Args:
        max_workers: threads checking at once (`check`).
        max_pending: checks admitted at once (running or queued); more are refused with a
            `ValueError` asking to retry, so a flood of huge schemas cannot queue up without bound.
        max_cached: verdicts kept (LRU by constraint key).
        max_bytes: largest constraint (schema, regex, grammar or choices as text) checked;
            larger ones are refused (``frontend.limits.max_constraint_bytes`` in an API server).
    """

    def __init__(
        self,
        *,
        max_workers: int = 2,
        max_pending: int = 64,
        max_cached: int = 1024,
        max_bytes: int = MAX_CONSTRAINT_BYTES,
    ) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="pkgd-constraint"
        )
        self._pending = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()  # the verdict cache is shared by the checking threads
        self._verdicts: collections.OrderedDict[tuple, str | None] = collections.OrderedDict()
        self._max_cached = max_cached
        self.max_bytes = max_bytes

    async def check(self, so: StructuredOutputsParams, field: str) -> None:
        """Raise `ValueError` ("``field``: reason") for a bad constraint."""
        self._admit(field)
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._check_admitted, so, field, self.max_bytes
            )
        finally:
            self._pending.release()

    def check_blocking(self, so: StructuredOutputsParams, field: str, *, max_bytes: int | None = None) -> None:
        """`check` in the calling thread (which must not be an event loop's); ``max_bytes``
        overrides the validator's for this call (a reloaded limit)."""
        self._admit(field)
        try:
            self._check_admitted(so, field, self.max_bytes if max_bytes is None else max_bytes)
        finally:
            self._pending.release()

    def _admit(self, field: str) -> None:
        if not self._pending.acquire(blocking=False):
            raise ValueError(f"{field}: too many constraints are being checked at once; retry shortly")

    def _check_admitted(self, so: StructuredOutputsParams, field: str, max_bytes: int) -> None:
        try:
            key = (field, *so.key())
        except ValueError as exc:
            raise ValueError(_renamed(exc, field)) from None
        _check_size(key[2], field, max_bytes)  # before the cache: the limit may change on reload
        with self._lock:
            cached = key in self._verdicts
            if cached:
                self._verdicts.move_to_end(key)
                verdict = self._verdicts[key]
        if not cached:
            verdict = _verdict(so, field, max_bytes)
            with self._lock:
                self._verdicts[key] = verdict
                while len(self._verdicts) > self._max_cached:
                    self._verdicts.popitem(last=False)
        if verdict is not None:
            raise ValueError(verdict)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _verdict(so: StructuredOutputsParams, field: str, max_bytes: int) -> str | None:
    try:
        check(so, field, max_bytes=max_bytes)
    except ValueError as exc:
        return str(exc)
    return None
