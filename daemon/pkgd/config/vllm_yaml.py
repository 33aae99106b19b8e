"""vLLM's ``--config FILE``: a YAML mapping of flag names to values, read as a layer.

vLLM turns each key into command-line arguments before parsing (``port: 8000`` is ``--port
8000``; ``enable-prefix-caching: true`` is ``--enable-prefix-caching``, ``false`` its negative
form; a list gives one flag with several values; a mapping is passed as JSON). pkgd does the
same and sends the tokens through the flag table (`pkgd.config.overrides.parse_flags`), so a
key means what its flag means, unsupported ones are refused with the same one line, and keys
may use dashes or underscores. Its values apply before the other command-line arguments, so
an explicit flag or override beats the file (as in vLLM); every other layer is below it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pkgd.config import schema, vllm_flags
from pkgd.config.overrides import ValueOp, parse_flags


def _negative(flag: str) -> str | None:
    """The flag that sets ``flag``'s switch false, where there is one."""
    candidates = [f"--no-{flag[2:]}"]
    for prefix, inverse in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
        if flag.startswith(prefix):
            candidates.insert(0, inverse + flag.removeprefix(prefix))
    for name in candidates:
        if name in schema.alias_index() or vllm_flags.answer(name) or name in vllm_flags.reference_nargs():
            return name
    return None


def tokens_of(data: dict[str, Any]) -> list[str]:
    """The flag tokens vLLM would build from a loaded ``--config`` mapping."""
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                tokens.append(flag)
            elif (negative := _negative(flag)) is not None:
                tokens.append(negative)
        elif isinstance(value, list):
            if value:
                tokens += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            tokens += [flag, json.dumps(value)]
        elif value is None:
            tokens += [flag, "null"]
        else:
            tokens += [flag, str(value)]
    return tokens


def load(path: str) -> tuple[list[ValueOp], list[str]]:
    """Value ops of the ``--config`` file at ``path``; (ops, problems), each problem naming it."""
    import yaml

    where = f"--config {path}"
    file = Path(path).expanduser()
    if file.suffix not in (".yaml", ".yml"):
        return [], [f"{where}: expected a .yaml or .yml file (vLLM's config file of flags)"]
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        return [], [f"{where}: cannot read: {exc.strerror}"]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        return [], [f"{where}{at}: YAML syntax error: {getattr(exc, 'problem', None) or exc}"]
    if data is None:
        return [], []
    if not isinstance(data, dict):
        return [], [f"{where}: expected a mapping of vLLM flag names to values, got {type(data).__name__}"]
    ops, problems = parse_flags(tokens_of(data))
    origin = f"{where}"
    return [ValueOp(op.key, op.value, op.delete, f"{origin} ({op.origin.removeprefix('cli ')})") for op in ops], [
        f"{where}: {p}" for p in problems
    ]
