"""`LLM(**kwargs)` → a validated `VllmConfig`, torch-free.

Keyword names are looked up in the config tree's own metadata, so there is no second list of
options: a leaf's field name (``num_blocks``, ``max_model_len``, ``tp``), its vLLM flag alias
without dashes (``tensor_parallel_size``, ``num_gpu_blocks_override``,
``enable_prefix_caching``), a dotted path (``**{"cache.block_size": 32}``) or a whole section
as a dict (``cache={"num_blocks": 64}``). Unknown names raise `TypeError` with a did-you-mean;
invalid values raise `ValueError` with one line per problem and its dotted path.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

import pydantic

from pkgd import host
from pkgd.config.vllm_config import VllmConfig


@functools.cache
def _keyword_table() -> dict[str, tuple[str, str, Any]]:
    """kwarg name -> (section, field, switch constant or None)."""
    table: dict[str, tuple[str, str, Any]] = {}
    for section, sec_field in VllmConfig.model_fields.items():
        for name, f in sec_field.annotation.model_fields.items():
            table[name] = (section, name, None)
            extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
            for alias in extra.get("x-cli-aliases", []):
                if not alias.startswith("--"):
                    continue
                flag, _, const = alias[2:].partition("=")
                table.setdefault(flag.replace("-", "_"), (section, name, const or None))
    return table


def _set(tree: dict[str, Any], section: str, field: str, value: Any) -> None:
    tree.setdefault(section, {})[field] = value


def overrides_to_tree(overrides: dict[str, Any]) -> dict[str, Any]:
    """Nested ``{section: {field: value}}`` from `LLM` keyword arguments; raises `TypeError`
    for an unknown name."""
    table = _keyword_table()
    sections = set(VllmConfig.model_fields)
    tree: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in sections and isinstance(value, dict):
            tree.setdefault(key, {}).update(value)
        elif "." in key and key.split(".", 1)[0] in sections:
            section, rest = key.split(".", 1)
            node = tree.setdefault(section, {})
            *parents, leaf = rest.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        elif key in table:
            section, field, const = table[key]
            if const is not None:  # a switch alias such as data_parallel_external_lb=True
                if value:
                    _set(tree, section, field, const)
            else:
                _set(tree, section, field, value)
        else:
            close = difflib.get_close_matches(key, [*table, *sections], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"LLM() got an unknown option {key!r}{hint}")
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """One line per problem: ``dotted.path: message (got value)``."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "config"
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        lines.append(f"{path}: {err['msg']}{got}")
    return "\n".join(lines)



def build_llm_config(model: str | None = None, *, config: VllmConfig | None = None, **overrides: Any) -> VllmConfig:
    """The config of an offline `LLM`.

    Starts from ``config`` (or the defaults), sets ``model.source`` to ``model`` when given,
    applies ``overrides``, and, unless ``parallel.cpu_threads`` is set, uses every core (an
    offline engine has no API process to leave a core for), shared among the ``parallel.tp``
    ranks.

    Raises:
        TypeError: an unknown keyword.
        ValueError: a value the config rejects (one line per problem, dotted paths).
    """
    tree = config.to_json_dict(reveal_secrets=True) if config is not None else {}
    extra = overrides_to_tree(overrides)
    if model is not None:
        _set(extra, "model", "source", model)
    tree = _merge(tree, extra)
    parallel = tree.get("parallel", {})
    if parallel.get("cpu_threads") is None:
        tp = parallel.get("tp", 1) if isinstance(parallel.get("tp", 1), int) else 1
        _set(tree, "parallel", "cpu_threads", max(1, host.available_cores() // max(tp, 1)))
    try:
        return VllmConfig.model_validate(tree)
    except pydantic.ValidationError as exc:
        raise ValueError("invalid LLM configuration:\n" + format_validation_error(exc)) from None
