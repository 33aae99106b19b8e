"""`ConfigError` and the wording of config problems.

Every problem is one line that names the dotted path, the bad value, what was expected and,
for unknown keys, enum values and group options, the closest valid name (difflib), e.g.::

    parallel.tpp: unknown key (set by cli parallel.tpp=2); did you mean parallel.tp?
    frontend.port: bad value 70000 (set by env PKGD_FRONTEND__PORT); expected less than or equal to 65535

Secret values (``frontend.api_keys``) are never echoed, nor are the values of unknown keys
(``frontend.api_key=sk-…`` is most likely a secret under a misspelt name): the line then says
``(set by cli frontend.api_key=…)``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError

REDACTED = "**********"


class ConfigError(Exception):
    """An invalid configuration; ``problems`` holds one line per problem.

    The CLI prints the lines and exits 2; the daemon logs them on a bad SIGHUP and keeps
    serving the old configuration.
    """

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems: list[str] = list(problems)
        super().__init__("\n".join(self.problems))


class ModelConfigMismatch(ValueError):
    """A config value the model itself rules out, found only once the model is read (a
    ``model.max_model_len`` above the model's limit, a ``parallel.tp`` that does not divide its
    heads). The message starts with the dotted path. The engine core reports it as a usage
    error, so the daemon exits 2, as for any invalid config, and systemd does not restart it.
    """


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (difflib ratio at least 0.6), or None."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def did_you_mean(word: str, candidates: Iterable[str], *, prefix: str = "") -> str:
    """``"; did you mean PREFIX+match?"`` for the closest candidate, or ``""``."""
    match = closest(word, candidates)
    return f"; did you mean {prefix}{match}?" if match else ""


def show_value(value: Any) -> str:
    """A value as a problem line quotes it: short, on one line."""
    text = repr(value) if isinstance(value, str) else _compact(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _compact(value: Any) -> str:
    import json

    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def origin_of(path: str, origins: Mapping[str, str]) -> str | None:
    """Where the value at ``path`` (or the nearest enclosing key set as a whole) came from."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        found = origins.get(".".join(parts[:n]))
        if found:
            return found
    below = sorted(key for key in origins if key.startswith(path + "."))
    return origins[below[0]] if below else None


def without_value(origin: str) -> str:
    """``"cli key=value"`` → ``"cli key=…"``: an origin as a problem line may show it when the
    value could be a secret (other origins carry no value)."""
    head, eq, _ = origin.partition("=")
    return f"{head}=…" if eq and origin.startswith("cli ") else origin


def validation_problems(err: ValidationError, origins: Mapping[str, str]) -> list[str]:
    """One line per pydantic error of validating the composed tree.

    ``origins`` maps a dotted key to the layer that set it, with detail (``"env
    PKGD_FRONTEND__PORT"``, ``"cli --port"``, ``"system:conf.d/10-port.yaml"``).
    """
    from pkgd.config import schema

    problems: list[str] = []
    for e in err.errors(include_url=False):
        loc = [str(p) for p in e["loc"] if isinstance(p, (str, int))]
        path = ".".join(loc)
        if not path:  # a cross-section rule of VllmConfig: its message names the paths
            problems += e["msg"].removeprefix("Value error, ").splitlines()
            continue
        origin = origin_of(path, origins)
        parent, _, name = path.rpartition(".")
        leaf = schema.leaves().get(path) or schema.leaves().get(parent)
        if e["type"] == "extra_forbidden" or (leaf is not None and leaf.secret):
            origin = origin and without_value(origin)
        where = f" (set by {origin})" if origin else ""
        if e["type"] == "extra_forbidden":
            valid = schema.children(parent)
            hint = did_you_mean(name, valid, prefix=f"{parent}." if parent else "")
            if not hint and valid:
                hint = f"; valid keys{' of ' + parent if parent else ''}: {', '.join(valid)}"
            problems.append(f"{path}: unknown key{where}{hint}")
            continue
        value = REDACTED if leaf is not None and leaf.secret else show_value(e["input"])
        if e["type"] == "model_type" and path in schema.sections():
            expected = f"a mapping of the keys of {path}: {', '.join(schema.children(path))}"
        else:
            expected = _expected(e["msg"])
        hint = ""
        if e["type"] == "literal_error" and leaf is not None and isinstance(e["input"], str):
            hint = did_you_mean(e["input"], [str(v) for v in leaf.enum])
        problems.append(f"{path}: bad value {value}{where}; expected {expected}{hint}")
    return problems


def _expected(msg: str) -> str:
    """What was expected, from pydantic's message: "Input should be X" gives "X"; a field
    validator's ``ValueError`` (worded "expected …" in pkgd's models) is taken as is."""
    if msg.startswith("Input should be "):
        return msg[len("Input should be ") :]
    msg = msg.removeprefix("Value error, ").removeprefix("expected ")
    return msg[:1].lower() + msg[1:]
