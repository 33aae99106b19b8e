"""The command-line layer (5): Hydra overrides and vLLM-style flags, as the same operations.

Hydra overrides are parsed with Hydra's own override grammar. In pkgd they mean:

* ``GROUP=OPTION``, ``+GROUP=OPTION``: choose an option of a config group (``+model=qwen``;
  with or without ``+``, since every packaged group is in the defaults list); ``~GROUP``
  removes the group's option.
* ``KEY=VALUE``, ``+KEY=VALUE``, ``++KEY=VALUE``: set a dotted key (``parallel.tp=2``). Keys are
  checked against the schema after merging, so ``+`` is not needed to add a key the YAML
  files did not mention (the pydantic defaults are the base of the tree).
* ``~KEY``: reset a key or a section to its default (``~frontend.cors``).

vLLM-style flags (``--tensor-parallel-size 2``, ``--port=9000``, ``--headless``,
``--no-enable-prefix-caching``) are read from each leaf's ``x-cli-aliases`` in the schema and
become the same set operations. A flag of a list field appends one value per occurrence (or
takes a JSON list); ``null`` sets a nullable field to null. Two switches setting one field to
different values (``--data-parallel-external-lb --data-parallel-hybrid-lb``) are an error,
as in vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from pkgd.config import schema, vllm_flags
from pkgd.config.errors import closest, did_you_mean


@dataclasses.dataclass(frozen=True)
class GroupChoice:
    """Choose ``option`` of config group ``group`` (None = no option); ``origin`` says who."""

    group: str
    option: str | None
    origin: str


@dataclasses.dataclass(frozen=True)
class ValueOp:
    """Set dotted ``key`` to ``value`` (or delete it, back to its default)."""

    key: str
    value: Any = None
    delete: bool = False
    origin: str = "cli"


def parse_overrides(
    overrides: Iterable[str], groups: Collection[str]
) -> tuple[list[GroupChoice], list[ValueOp], list[str]]:
    """Split Hydra overrides into group choices and value operations (in order).

    ``groups`` are the names of the config groups. Returns ``(choices, ops, problems)``; a
    malformed override is a problem naming it and Hydra's parse error.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    choices: list[GroupChoice] = []
    ops: list[ValueOp] = []
    problems: list[str] = []
    for text in overrides:
        try:
            ov = parser.parse_override(text)
        except HydraException as e:
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            problems.append(f"{text}: malformed override ({detail}); expected KEY=VALUE, +GROUP=OPTION or ~KEY")
            continue
        key = ov.key_or_group
        if ov.is_sweep_override():
            problems.append(
                f"{text}: a sweep is not a config value; quote it ({key}='…') or write a list ({key}=[a,b])"
            )
        elif ov.package is not None:
            problems.append(f"{text}: '@PACKAGE' is not supported on the pkgd command line")
        elif key in groups:
            option = None if ov.is_delete() else ov.value()
            if option is not None and not isinstance(option, str):
                problems.append(f"{text}: choose one option of group {key} ({key}=OPTION)")
            else:
                choices.append(GroupChoice(key, option, f"cli {text}"))
        elif ov.is_delete():
            ops.append(ValueOp(key, delete=True, origin=f"cli {text}"))
        else:
            ops.append(ValueOp(key, ov.value(), origin=f"cli {text}"))
    return choices, ops, problems


_OPTIMIZATION_LEVEL = re.compile(r"^-O(\d)$")  # vLLM's "-O3" for "--optimization-level 3"


def normalize_flag(token: str) -> str:
    """A flag token as the alias tables spell it: vLLM's parser also takes underscores
    (``--max_model_len=2048`` is ``--max-model-len=2048``) and ``-O3``."""
    if m := _OPTIMIZATION_LEVEL.match(token):
        return f"--optimization-level={m.group(1)}"
    name, eq, value = token.partition("=")
    if name.startswith("--") and "_" in name:
        name = name.replace("_", "-")
    return name + eq + value


def flag_arity(token: str) -> int | str | None:
    """For an argv token: None if it is no config flag, else how many values follow it.

    0 for a switch or a ``--flag=value`` token; 1 for one value; ``"+"`` for one or more (a
    list key's flag, as vLLM's ``nargs="+"``: ``--served-model-name a b``; also vLLM flags
    that pkgd answers and vLLM gives ``nargs="+"``); ``"?"`` for an optional one
    (``--hf-token``). vLLM flags without a config key count too (`pkgd.config.vllm_flags`), so
    their values never reach argparse and their one-line answer is the only error.
    """
    name, eq, _ = normalize_flag(token).partition("=")
    entry = schema.alias_index().get(name)
    if entry is not None:
        leaf, const = entry
        if eq or const is not None:
            return 0
        return "+" if leaf.is_list else 1
    if name in schema.section_aliases():
        return 0 if eq else 1
    if name == VLLM_CONFIG_FLAG or name.partition(".")[0] in vllm_flags.reference_nargs() or vllm_flags.answer(name):
        if eq:
            return 0
        nargs = vllm_flags.reference_nargs().get(name.partition(".")[0], 1)
        return 1 if nargs is None else nargs
    return None


def flag_takes_value(token: str) -> bool | None:
    """For an argv token: None if it is no config flag, else whether values follow it."""
    arity = flag_arity(token)
    return None if arity is None else arity != 0


def parse_flags(tokens: Sequence[str]) -> tuple[list[ValueOp], list[str]]:
    """Translate vLLM-style flag tokens (``["--port", "9000", "--headless"]``) to value ops.

    Each flag takes as many of the following tokens as `flag_arity` says (``+``: up to the
    next one starting with ``-``), as `split_argv` put them there. A vLLM flag that no config key
    maps is answered by `pkgd.config.vllm_flags`: accepted without an op when satisfied,
    else a problem line.
    """
    if not tokens:
        return [], []
    index = schema.alias_index()
    ops: list[ValueOp] = []
    problems: list[str] = []
    lists: dict[str, int] = {}  # list leaf -> index of its op in ops
    switches: dict[str, tuple[str, str]] = {}  # leaf -> (flag, constant) of enum switches
    i = 0
    while i < len(tokens):
        token = normalize_flag(tokens[i])
        name, eq, inline = token.partition("=")
        values, i = _take_values(tokens, i + 1, flag_arity(token), bool(eq))
        if eq:
            values = [inline, *values]
        if name not in index:
            problems += _unmapped_flag(name, values, ops)
            continue
        leaf, const = index[name]
        if const is not None and not leaf.is_bool:
            if values:
                problems.append(f"{token}: {name} is a switch and takes no value")
                continue
            previous = switches.setdefault(leaf.key, (name, const))
            if previous[1] != const:
                problems.append(f"{previous[0]} and {name} are mutually exclusive (both set {leaf.key})")
                continue
            value: Any = const
        elif const is not None:
            value = values[0] if eq else const
        elif values:
            value = values[0]
        else:
            problems.append(f"{name}: expects a value ({leaf.key}: {leaf.type_label})")
            continue
        if isinstance(value, str) and leaf.nullable and value.lower() in ("null", "none"):
            value = None
        origin = f"cli {name}"
        if leaf.is_list and values:
            items: list[Any] = []
            for text in values:
                found = _json_list(text)
                items += [text] if found is None else found
            if leaf.key in lists:
                j = lists[leaf.key]
                ops[j] = dataclasses.replace(ops[j], value=ops[j].value + items)
                continue
            lists[leaf.key] = len(ops)
            value = items
        ops.append(ValueOp(leaf.key, value, origin=origin))
    return ops, problems


def _take_values(tokens: Sequence[str], i: int, arity: int | str | None, inline: bool) -> tuple[list[str], int]:
    """The values of the flag before ``tokens[i]`` and the index after them."""
    if arity is None:  # an unknown flag: the next word is most likely its value
        skip = not inline and i < len(tokens) and not tokens[i].startswith("-")
        return [], i + skip
    if arity == 1 and i < len(tokens):
        return [tokens[i]], i + 1  # "-1" too
    values: list[str] = []
    if arity in ("+", "?"):
        while i < len(tokens) and not tokens[i].startswith("-") and not (arity == "?" and values):
            values.append(tokens[i])
            i += 1
    return values, i


VLLM_CONFIG_FLAG = "--config"  # vLLM's YAML of flags: a layer of its own (`pkgd.config.vllm_yaml`)


def _unmapped_flag(name: str, values: list[str], ops: list[ValueOp]) -> list[str]:
    """A flag that no leaf maps: a section's JSON flag, an answered vLLM flag, or unknown."""
    section = schema.section_aliases().get(name)
    if section is not None:
        if len(values) != 1:
            return [f"{name}: expects one JSON object of {section} keys"]
        return _section_ops(name, section, values[0], ops)
    base = name.partition(".")[0]  # vLLM's --json-flag.key VALUE form
    found = vllm_flags.answer(base)
    if found is not None:
        problem = found.problem(values[0] if values else None)
        return [problem] if problem else []
    if base in vllm_flags.reference_nargs():
        return [f"{name}: a vLLM flag pkgd does not support"]  # a newer vLLM flag without an answer yet
    candidates = [*schema.alias_index(), *schema.section_aliases()]
    return [f"{name}: unknown option{did_you_mean(name, candidates)}"]


# vLLM's generation_config.json / --override-generation-config spelling of pkgd's keys
_GENERATION_NAMES = {"max_new_tokens": "max_tokens"}


def _section_ops(flag: str, section: str, text: str, ops: list[ValueOp]) -> list[str]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        return [f"{flag}: expects a JSON object of {section} keys ({exc})"]
    if not isinstance(data, dict):
        return [f"{flag}: expects a JSON object of {section} keys, got {type(data).__name__}"]
    for key, value in data.items():
        key = _GENERATION_NAMES.get(key, key) if section == "model.generation" else key
        ops.append(ValueOp(f"{section}.{key}", value, origin=f"cli {flag}"))
    return []


def _json_list(text: str) -> list[Any] | None:
    if not text.lstrip().startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, list) else None


def unknown_delete(key: str) -> str:
    """The problem line for ``~KEY`` naming no key of the tree."""
    parent, _, name = key.rpartition(".")
    hint = did_you_mean(name, schema.children(parent), prefix=f"{parent}." if parent else "")
    return f"~{key}: unknown key{hint}"


def keyword_ops(kwargs: Mapping[str, Any]) -> tuple[list[ValueOp], list[str]]:
    """Translate Python keyword arguments (``LLM(tensor_parallel_size=2, ...)``) to value ops.

    The same table as the flags (`schema.alias_index`): a keyword is a flag without its dashes
    (``allowed_origins`` for ``--allowed-origins``, ``no_enable_prefix_caching``), a leaf's
    own name where it names one leaf only (``tp``, ``num_blocks``), a dotted key
    (``**{"cache.block_size": 32}``), or a section given as a dict (``cache={...}``). Values
    are Python values, not strings. A boolean switch takes the value given
    (``enable_prefix_caching=False`` sets false); an enum switch sets its constant when the
    value is true (``data_parallel_external_lb=True``). Returns ``(ops, problems)``; an unknown
    keyword's problem reads ``an unknown option 'X'; did you mean 'Y'?``.
    """
    index = {flag[2:].replace("-", "_"): entry for flag, entry in schema.alias_index().items() if flag.startswith("--")}
    by_name: dict[str, list[schema.Leaf]] = {}
    for leaf in schema.leaves().values():
        by_name.setdefault(leaf.key.rpartition(".")[2], []).append(leaf)
    names = {name: found[0] for name, found in by_name.items() if len(found) == 1}
    sections = set(schema.children(""))
    # a section's JSON flag as a keyword taking a dict (``speculative_config={...}``, as vLLM's LLM)
    section_keywords = {
        flag[2:].replace("-", "_"): section
        for flag, section in schema.section_aliases().items()
        if flag.startswith("--")
    }
    ops: list[ValueOp] = []
    problems: list[str] = []
    for name, value in kwargs.items():
        origin = f"keyword {name}"
        if name in sections and isinstance(value, Mapping):
            ops.extend(ValueOp(key, v, origin=origin) for key, v in _flatten(value, name))
        elif name in section_keywords and isinstance(value, Mapping):
            ops.extend(ValueOp(key, v, origin=origin) for key, v in _flatten(value, section_keywords[name]))
        elif "." in name and name.split(".", 1)[0] in sections:
            ops.append(ValueOp(name, value, origin=origin))
        elif name in index:
            leaf, const = index[name]
            if leaf.is_bool and const is not None:
                ops.append(ValueOp(leaf.key, bool(value) == (const == "true"), origin=origin))
            elif const is not None:
                if value:
                    ops.append(ValueOp(leaf.key, const, origin=origin))
            else:
                ops.append(ValueOp(leaf.key, value, origin=origin))
        elif name in names:
            ops.append(ValueOp(names[name].key, value, origin=origin))
        else:
            match = closest(name, [*index, *names, *sections])
            problems.append(f"an unknown option {name!r}" + (f"; did you mean {match!r}?" if match else ""))
    return ops, problems


def _flatten(node: Mapping[str, Any], section: str) -> Iterable[tuple[str, Any]]:
    """``cors={"allowed_origins": [...]}`` under ``frontend`` -> ``("frontend.cors.allowed_origins",
    [...])``; a dict under a key that is a leaf (not a section) stays one value."""
    for key, value in node.items():
        path = f"{section}.{key}"
        if isinstance(value, Mapping) and schema.children(path):
            yield from _flatten(value, path)
        else:
            yield path, value
