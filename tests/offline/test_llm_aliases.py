"""Every vLLM flag of the schema's alias table works the same as an `LLM()` keyword.

Generated from `pkgd.config.schema.alias_index`: for each ``--flag``, a value the leaf accepts
is given once on the command line (`compose`) and once as ``LLM(flag_name=value)``
(`build_llm_config`); both must set the leaf to the same value, or both must refuse it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pkgd.config import schema
from pkgd.config.compose import ComposeRequest, compose
from pkgd.config.errors import ConfigError
from pkgd.offline.llm_config import build_llm_config


def _sample(leaf: schema.Leaf) -> Any:
    """A value the leaf accepts, other than its default where the type allows."""
    bounds = dict(leaf.bounds)
    if leaf.enum:
        others = [v for v in leaf.enum if v != leaf.default]
        return others[-1] if others else leaf.enum[0]
    if leaf.is_list:
        return ["8.8.8.8"] if leaf.item_type == "string" else [1]
    if "integer" in leaf.types:
        low = bounds.get("minimum", bounds.get("exclusiveMinimum", 0))
        value = (leaf.default if isinstance(leaf.default, int) else low) + 1
        high = bounds.get("maximum")
        return min(max(value, low + 1), high) if high is not None else max(value, low + 1)
    if "number" in leaf.types:
        high = bounds.get("maximum", 1.0)
        return min(0.5, high)
    return "x-value"


def _get(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _cli(flag: str, leaf: schema.Leaf, const: str | None, value: Any) -> Any:
    if const is not None:
        tokens: tuple[str, ...] = (flag,)
    else:
        tokens = (flag, json.dumps(value) if isinstance(value, list) else str(value))
    return _get(compose(ComposeRequest(flags=tokens, env={})).config, leaf.key)


FLAGS = sorted(f for f in schema.alias_index() if f.startswith("--"))


@pytest.mark.parametrize("flag", FLAGS)
def test_flag_and_keyword_agree(flag):
    leaf, const = schema.alias_index()[flag]
    keyword = flag[2:].replace("-", "_")
    value = True if const is not None else _sample(leaf)
    try:
        want = _cli(flag, leaf, const, value)
    except ConfigError:
        with pytest.raises((TypeError, ValueError)):
            build_llm_config(**{keyword: value})
        return
    got = _get(build_llm_config(**{keyword: value}), leaf.key)
    assert got == want, f"{flag} sets {leaf.key}={want!r}, LLM({keyword}=...) set {got!r}"
