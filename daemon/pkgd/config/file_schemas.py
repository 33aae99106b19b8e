"""JSON schemas for the YAML files a user writes, derived from `VllmConfig`'s schema.

`schemas/vllm_config.schema.json` describes the validated tree. The files that build it are
partial, may start with a Hydra defaults list and may hold OmegaConf interpolations, so they
get schemas of their own (``pkgd config schema --file`` / ``--group GROUP``), checked in under
``schemas/`` beside it and drift-tested:

* ``pkgd-file.schema.json``: a whole-tree file: ``/etc/pkgd/pkgd.yaml``, each ``conf.d/*.yaml``,
  the packaged ``configs/pkgd.yaml`` and ``# @package _global_`` profiles
  (``configs/profile/*.yaml``);
* ``groups/<section>.schema.json``: an option file of a config group named after a section
  (``configs/parallel/tp2.yaml`` holds ``tp: 2``: Hydra places a group's file at the group's
  package, here ``parallel``).

Every key is optional and unknown keys are refused (``additionalProperties: false`` as in the
tree), so an editor or ``check-jsonschema`` flags a typo where pkgd would. Any leaf may instead
hold an interpolation string (``${oc.env:PORT}``), checked by pkgd after merging. Each
packaged YAML file names its schema in a ``yaml-language-server`` modeline.
"""

from __future__ import annotations

import copy
from typing import Any

from pkgd.config import schema

FILE_SCHEMA = "pkgd-file.schema.json"
MODELINE = "# yaml-language-server: $schema="

INTERPOLATION: dict[str, Any] = {
    "type": "string",
    "pattern": r"\$\{[^}]+\}",
    "description": "An OmegaConf interpolation (${oc.env:VAR}, ${frontend.port}), resolved after merging.",
}

_DEFAULTS_ENTRY: dict[str, Any] = {
    "anyOf": [
        {"const": "_self_"},
        {
            "type": "object",
            "minProperties": 1,
            "maxProperties": 1,
            "patternProperties": {r"^(override )?/?[A-Za-z0-9_.-]+$": {"type": ["string", "null"]}},
            "additionalProperties": False,
        },
    ]
}

DEFAULTS_LIST: dict[str, Any] = {
    "type": "array",
    "items": _DEFAULTS_ENTRY,
    "description": "Hydra defaults list: `- GROUP: OPTION` entries choosing config group options (`- model: qwen`), "
    "`_self_`, or `- override /GROUP: OPTION` in a profile.",
}

_META = ("title", "description", "default", "examples")


def _is_section(prop: dict[str, Any], defs: dict[str, Any]) -> bool:
    ref = prop.get("$ref", "")
    return ref.startswith("#/$defs/") and "properties" in defs.get(ref.rsplit("/", 1)[1], {})


def _leaf(prop: dict[str, Any]) -> dict[str, Any]:
    """A leaf that also takes an interpolation; its title/description/default stay on top."""
    core = {k: v for k, v in prop.items() if k not in _META and not k.startswith("x-")}
    out = {k: prop[k] for k in _META if k in prop}
    out["anyOf"] = [core, INTERPOLATION]
    return out


def _files_defs() -> dict[str, Any]:
    """The tree's ``$defs`` with every leaf widened for files."""
    defs = copy.deepcopy(schema.json_schema()["$defs"])
    for definition in defs.values():
        props = definition.get("properties", {})
        for name, prop in props.items():
            if not _is_section(prop, defs):
                props[name] = _leaf(prop)
    return defs


def file_schema() -> dict[str, Any]:
    """The schema of a whole-tree YAML file (system file, ``conf.d`` fragment, profile)."""
    tree = schema.json_schema()
    properties = {"defaults": DEFAULTS_LIST, **copy.deepcopy(tree["properties"])}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "pkgd configuration file",
        "description": "A YAML file of pkgd's configuration tree: any subset of the sections, "
        "optionally starting with a defaults list.",
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "$defs": _files_defs(),
    }


def group_schema(section: str) -> dict[str, Any]:
    """The schema of an option file of the config group named after ``section``.

    Raises:
        KeyError: ``section`` is no section of the tree.
    """
    tree = schema.json_schema()
    ref = tree["properties"][section]["$ref"].rsplit("/", 1)[1]
    defs = _files_defs()
    body = copy.deepcopy(defs[ref])
    body["properties"] = {"defaults": DEFAULTS_LIST, **body["properties"]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"pkgd config group option: {section}",
        "description": f"An option file of the `{section}` config group: keys of the `{section}` section.",
        **{k: v for k, v in body.items() if k not in ("title", "description")},
        "$defs": {name: defs[name] for name in sorted(_reachable(body, defs))},
    }


def _reachable(node: Any, defs: dict[str, Any], seen: set[str] | None = None) -> set[str]:
    """Names of the ``$defs`` that ``node`` refers to, directly or through other defs."""
    seen = set() if seen is None else seen
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/") and (name := ref.rsplit("/", 1)[1]) not in seen:
            seen.add(name)
            _reachable(defs[name], defs, seen)
        for value in node.values():
            _reachable(value, defs, seen)
    elif isinstance(node, list):
        for value in node:
            _reachable(value, defs, seen)
    return seen


def group_sections() -> tuple[str, ...]:
    """Sections whose config group option files get a schema of their own."""
    return schema.children("")
