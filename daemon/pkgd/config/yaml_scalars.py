"""Plain YAML scalars that YAML 1.1 and YAML 1.2 read differently, refused in config files.

OmegaConf, and with it Hydra, loads YAML with PyYAML's YAML 1.1 resolvers, so ``1:30`` is the
base-60 number 90, ``0755`` the octal 493, ``no`` the boolean false and ``1_000`` the number
1000, where YAML 1.2 (and most editors, linters and people) read ``1:30``, ``no`` and
``1_000`` as text and ``0755`` as 755. pkgd cannot hand Hydra another loader without changing
OmegaConf for the whole process, so a config file is loaded as OmegaConf loads it and every
plain scalar whose YAML 1.1 value differs from its YAML 1.2 core-schema value is a problem
naming its dotted path and asking for quotes (or for the value written out).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

_INT, _FLOAT, _BOOL = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"

# YAML 1.2.2 core schema, section 10.3.2 (null and str need no check: YAML 1.1 agrees on null)
_CORE_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_CORE_INT10 = re.compile(r"[-+]?[0-9]+")
_CORE_INT8 = re.compile(r"0o[0-7]+")
_CORE_INT16 = re.compile(r"0x[0-9a-fA-F]+")
_CORE_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_CORE_INF = re.compile(r"[-+]?\.(inf|Inf|INF)")
_CORE_NAN = re.compile(r"\.(nan|NaN|NAN)")


def core_value(text: str) -> Any:
    """The value of a plain scalar under the YAML 1.2 core schema (bool, int, float or the
    text itself; null is left out: YAML 1.1 reads the same words as null)."""
    if text in _CORE_BOOL:
        return _CORE_BOOL[text]
    if _CORE_INT10.fullmatch(text):
        return int(text)
    if _CORE_INT8.fullmatch(text):
        return int(text[2:], 8)
    if _CORE_INT16.fullmatch(text):
        return int(text[2:], 16)
    if _CORE_FLOAT.fullmatch(text):
        return float(text)
    if _CORE_INF.fullmatch(text):
        return -math.inf if text.startswith("-") else math.inf
    if _CORE_NAN.fullmatch(text):
        return math.nan
    return text


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):  # True == 1, but a boolean is not a number
        return False
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _reading(text: str, value: Any) -> str:
    """What YAML 1.1 made of ``text``, in words."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    digits = text.lstrip("+-")
    if ":" in text:
        kind = "base-60 number"
    elif digits.startswith("0b"):
        kind = "binary number"
    elif isinstance(value, int) and len(digits) > 1 and digits.startswith("0") and digits[1] != "x":
        kind = "octal number"
    else:
        kind = "number"
    return f"the {kind} {value}"


def ambiguous_scalars(text: str, where: str, package: str = "") -> list[str]:
    """One problem per plain scalar of the YAML document ``text`` that YAML 1.1 (as OmegaConf
    loads it) and YAML 1.2 read differently; ``where`` names the file in each line, ``package``
    the section the file's keys sit in (a group option's). The text must already have loaded
    (YAML syntax errors are reported by the loader). A secret's text is not shown."""
    import yaml
    from omegaconf._utils import get_yaml_loader  # the loader OmegaConf.load and Hydra use

    from pkgd.config import schema
    from pkgd.config.errors import REDACTED

    loader = get_yaml_loader()(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    problems = []
    for path, node in _plain_scalars(root, package):
        if node.tag not in (_INT, _FLOAT, _BOOL):
            continue
        yaml11 = loader.construct_object(node)
        if _same(yaml11, core_value(node.value)):
            continue
        at = f"({where}:{node.start_mark.line + 1}:{node.start_mark.column + 1})"
        leaf = schema.leaves().get(path) or schema.leaves().get(path.rpartition(".")[0])
        if leaf is not None and leaf.secret:
            kind = "a boolean" if isinstance(yaml11, bool) else "a number"
            problems.append(f"{path}: the value {REDACTED} is {kind} to YAML 1.1 {at}; quote it")
            continue
        written = yaml.safe_dump(yaml11, default_flow_style=True).removesuffix("\n...\n").strip()
        problems.append(
            f"{path or node.value}: {node.value} is {_reading(node.value, yaml11)} to YAML 1.1 {at}; "
            f"quote it ('{node.value}') to mean the text, or write {written}"
        )
    return problems


def _plain_scalars(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(dotted path, node) of every unquoted scalar under ``node``, keys included."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = f"{path}.{key.value}" if path else str(key.value)
            if isinstance(key, yaml.ScalarNode) and key.style is None:
                yield name, key
            yield from _plain_scalars(value, name)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _plain_scalars(item, f"{path}.{i}" if path else str(i))
    elif isinstance(node, yaml.ScalarNode) and node.style is None:
        yield path, node
