"""The one helper every config field is declared with.

Each leaf of the `VllmConfig` tree carries, besides its type and default, two pieces of
metadata that the rest of pkgd reads from the JSON schema:

* ``x-cli-aliases``: the vLLM-style flags that set it (``--tensor-parallel-size``). A plain
  flag takes a value; ``"--flag=CONST"`` is a switch that sets the field to ``CONST``
  (``"--data-parallel-external-lb=external"``); boolean fields also accept ``--no-<flag>``.
* ``x-reload``: what a SIGHUP reload must do when the field changes (see `ReloadClass`).

Keeping both in the schema gives the flag surface, ``--help`` and the reload planner one
source.
"""

from __future__ import annotations

import enum
import re
from typing import Any

from pydantic import Field


class ReloadClass(str, enum.Enum):
    """What a change of a field costs on SIGHUP, least disruptive first."""

    LIVE = "live"  # applied in place by the running processes
    API = "api"  # rolling restart of API servers on the held socket
    ENGINE = "engine"  # new engine cores, switch, drain the old ones
    RESTART = "restart"  # cannot be applied by reload; needs a full daemon restart


RELOAD_ORDER = [ReloadClass.LIVE, ReloadClass.API, ReloadClass.ENGINE, ReloadClass.RESTART]


def field(
    default: Any = ...,
    description: str = "",
    *,
    aliases: tuple[str, ...] | list[str] = (),
    reload: ReloadClass = ReloadClass.ENGINE,
    default_factory: Any = None,
    **constraints: Any,
) -> Any:
    """Declare a config leaf with its description, CLI aliases and reload class.

    ``constraints`` are pydantic's (``ge``, ``le``, ``min_length`` …). Prefer a plain mutable
    default (``[]``; pydantic copies it for each instance) to ``default_factory``: only a plain
    default shows in the schema and ``--help``. A test fails for any leaf without a description.
    """
    extra: dict[str, Any] = {"x-reload": reload.value}
    if aliases:
        extra["x-cli-aliases"] = list(aliases)
    if default_factory is not None:
        return Field(default_factory=default_factory, description=description, json_schema_extra=extra, **constraints)
    return Field(default, description=description, json_schema_extra=extra, **constraints)


def section(model: type, description: str, *, aliases: tuple[str, ...] = ()) -> Any:
    """Declare a nested section (a model whose own fields are the leaves).

    A section has no reload class of its own: reload planning looks at its leaves.
    ``aliases``: vLLM flags whose value is a JSON object of the section's keys
    (``--override-generation-config '{"temperature": 0.5}'``).
    """
    extra: dict[str, Any] | None = {"x-cli-aliases": list(aliases)} if aliases else None
    return Field(default_factory=model, description=description, json_schema_extra=extra)


_HUMAN_INT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT])\s*$")
_DECIMAL_EXP = {"k": 1, "m": 2, "g": 3, "t": 4}


def human_int(value: Any) -> Any:
    """vLLM's human-readable integers (its ``human_readable_int``): ``"2k"`` = 2000, ``"2K"`` =
    2048, ``"25.6k"`` = 25600 (a fraction only with a decimal multiplier). Anything else is
    returned unchanged for pydantic to validate (a plain ``"2048"`` or an int)."""
    if not isinstance(value, str) or not (m := _HUMAN_INT.match(value)):
        return value
    number, unit = m.groups()
    exp = _DECIMAL_EXP[unit.lower()]
    if unit.islower():
        scaled = float(number) * 1000**exp
        return int(scaled) if scaled.is_integer() else value
    if "." in number:
        return value  # "1.5K": pydantic rejects it with the input shown
    return int(number) * 1024**exp
