"""The JSON schema of `VllmConfig` and the table of its leaves.

The schema is the one source of the command line's flag surface (``x-cli-aliases``), of the
``--help`` text, of reload planning (``x-reload``) and of the did-you-mean hints: everything
here is read from ``VllmConfig.model_json_schema()``, never from a second list. The checked-in
``schemas/vllm_config.schema.json`` is this schema (``pkgd config schema``); a test fails when
they drift.

A *leaf* is a field that is not itself a section: ``parallel.tp``, ``frontend.api_keys`` (a
list is one leaf), ``model.generation.temperature``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from pkgd.config.fields import ReloadClass
from pkgd.config.vllm_config import VllmConfig

_TYPE_NAMES = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}


@functools.cache
def json_schema() -> dict[str, Any]:
    """``VllmConfig``'s JSON schema (pydantic's, with the ``x-`` extensions)."""
    return VllmConfig.model_json_schema()


def schema_text() -> str:
    """The schema as ``pkgd config schema`` prints it and the checked-in file holds it."""
    return json.dumps(json_schema(), indent=2) + "\n"


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One settable key of the tree, as the schema describes it.

    ``types`` are JSON-schema type names (``("integer", "null")``); ``item_type`` is the
    element type of an array; ``enum`` the allowed values of a ``Literal``; ``default`` the
    JSON value of the field's default; ``aliases`` the vLLM-style flags (``"--flag=CONST"`` =
    a switch setting ``CONST``); ``secret`` marks values never printed.
    """

    key: str
    types: tuple[str, ...]
    default: Any
    description: str
    aliases: tuple[str, ...]
    reload: ReloadClass
    enum: tuple[Any, ...] = ()
    item_type: str | None = None
    secret: bool = False
    bounds: tuple[tuple[str, Any], ...] = ()

    @property
    def section(self) -> str:
        """The dotted path of the section holding this leaf (``"frontend.cors"``)."""
        return self.key.rpartition(".")[0]

    @property
    def is_list(self) -> bool:
        return "array" in self.types

    @property
    def is_bool(self) -> bool:
        return "boolean" in self.types

    @property
    def nullable(self) -> bool:
        return "null" in self.types

    @property
    def type_label(self) -> str:
        """Short human type: ``int``, ``int | null``, ``auto|json|console``, ``list[str]``."""
        if self.enum:
            base = "|".join(str(v) for v in self.enum)
        elif self.is_list:
            base = f"list[{_TYPE_NAMES.get(self.item_type or '', 'str')}]"
        else:
            base = " | ".join(_TYPE_NAMES.get(t, t) for t in self.types if t != "null")
        return f"{base} | null" if self.nullable else base


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None and len(node.get("allOf", ())) == 1:
        ref = node["allOf"][0].get("$ref")
    return defs[ref.rsplit("/", 1)[1]] if ref else node


def _leaf(key: str, prop: dict[str, Any], default: Any) -> Leaf:
    variants = prop.get("anyOf", [prop])
    types: list[str] = []
    enum: tuple[Any, ...] = ()
    item_type = None
    secret = False
    bounds: list[tuple[str, Any]] = []
    for v in variants:
        types.append(v.get("type", "string"))
        enum = enum or tuple(v.get("enum", ()))
        items = v.get("items") or {}
        item_type = item_type or items.get("type")
        secret = secret or items.get("format") == "password" or v.get("format") == "password"
        for name in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength"):
            if name in v:
                bounds.append((name, v[name]))
    return Leaf(
        key=key,
        types=tuple(dict.fromkeys(types)),
        default=default,
        description=prop.get("description", ""),
        aliases=tuple(prop.get("x-cli-aliases", ())),
        reload=ReloadClass(prop.get("x-reload", ReloadClass.ENGINE.value)),
        enum=enum,
        item_type=item_type,
        secret=secret,
        bounds=tuple(bounds),
    )


@functools.cache
def _walk() -> tuple[dict[str, Leaf], dict[str, tuple[str, ...]], dict[str, str], dict[str, str]]:
    from pkgd.config.vllm_config import default_config

    schema = json_schema()
    defs = schema.get("$defs", {})
    defaults = default_config().to_json_dict()  # also right for fields with a default_factory
    leaves: dict[str, Leaf] = {}
    children: dict[str, tuple[str, ...]] = {}
    descriptions: dict[str, str] = {}
    section_flags: dict[str, str] = {}

    def walk(node: dict[str, Any], prefix: str, values: dict[str, Any]) -> None:
        props = node.get("properties", {})
        children[prefix] = tuple(props)
        for name, prop in props.items():
            key = f"{prefix}.{name}" if prefix else name
            target = _resolve(prop, defs)
            if "properties" in target:
                descriptions[key] = prop.get("description") or target.get("description", "")
                for alias in prop.get("x-cli-aliases", ()):
                    section_flags[alias] = key
                walk(target, key, values[name])
            else:
                leaves[key] = _leaf(key, prop, values[name])

    walk(schema, "", defaults)
    return leaves, children, descriptions, section_flags


@functools.cache
def leaf_keys() -> tuple[str, ...]:
    """The dotted keys of `leaves`, from the models' fields (without generating the schema)."""
    from pydantic import BaseModel

    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        keys = []
        for name, info in model.model_fields.items():
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                keys += walk(ann, f"{prefix}{name}.")
            else:
                keys.append(prefix + name)
        return keys

    return tuple(walk(VllmConfig, ""))


def leaves() -> dict[str, Leaf]:
    """Every leaf by dotted key, in schema order (sections in declaration order)."""
    return _walk()[0]


def sections() -> dict[str, str]:
    """Every section's dotted path (``"model"``, ``"model.generation"``) → its description."""
    return _walk()[2]


def children(path: str) -> tuple[str, ...]:
    """Field names directly under the section ``path`` (``""`` = the root); ``()`` if none."""
    return _walk()[1].get(path, ())


def section_aliases() -> dict[str, str]:
    """vLLM flag → the section its JSON-object value sets (``--override-generation-config`` →
    ``model.generation``)."""
    return _walk()[3]


_INVERSE_PREFIXES = {"--enable-": "--disable-", "--disable-": "--enable-"}


@functools.cache
def alias_index() -> dict[str, tuple[Leaf, str | None]]:
    """vLLM-style flag → (leaf, constant or None).

    ``"--data-parallel-external-lb=external"`` in a leaf's aliases gives
    ``{"--data-parallel-external-lb": (lb.mode, "external")}``: a switch. A plain alias takes
    a value (``None`` here). Boolean leaves are switches setting true; their ``--no-`` form
    sets false (argparse's ``BooleanOptionalAction``), and so does the inverse of an
    ``--enable-X`` / ``--disable-X`` flag (``--disable-X`` / ``--enable-X``, vLLM's
    ``EnableDisableAction``).

    Raises:
        ValueError: two leaves declare the same flag (a bug in the models; a test checks it).
    """
    index: dict[str, tuple[Leaf, str | None]] = {}

    def add(flag: str, entry: tuple[Leaf, str | None]) -> None:
        if flag in index:
            raise ValueError(f"flag {flag} is declared by both {index[flag][0].key} and {entry[0].key}")
        index[flag] = entry

    for leaf in leaves().values():
        for alias in leaf.aliases:
            flag, eq, const = alias.partition("=")
            if eq:
                add(flag, (leaf, const))
            elif leaf.is_bool:
                add(flag, (leaf, "true"))
                if flag.startswith("--"):
                    add("--no-" + flag[2:], (leaf, "false"))
                for prefix, inverse in _INVERSE_PREFIXES.items():
                    if flag.startswith(prefix):
                        add(inverse + flag.removeprefix(prefix), (leaf, "false"))
            else:
                add(flag, (leaf, None))
    return index
