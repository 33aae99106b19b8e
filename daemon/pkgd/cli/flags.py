"""Split argv into configuration arguments and the rest.

Configuration arguments may stand anywhere on the command line, before or after the
subcommand (``pkgd +model=qwen parallel.tp=2 config show``), so they are taken out before
argparse parses what is left:

* Hydra overrides: a token starting with ``+`` or ``~``, or ``KEY=VALUE`` whose KEY is a
  dotted name (``parallel.tp=2``, ``model=qwen``, ``model.source=/a/b``);
* the vLLM flags listed in the schema's ``x-cli-aliases`` (``--port 9000``, ``--port=9000``,
  ``--headless``, ``--no-enable-prefix-caching``, ``-tp 2``);
* ``--config-dir DIR`` and ``--config-name NAME``.

A ``--`` ends the scan: what follows goes to the subcommand untouched (``pkgd serve -- a=b``
serves a model directory named ``a=b``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from pkgd.config.errors import ConfigError

_OVERRIDE = re.compile(r"^[A-Za-z_][\w\-]*(?:[./][\w\-]+)*=")
_SOURCE_OPTIONS = ("--config-dir", "--config-name")


@dataclasses.dataclass
class SplitArgv:
    """``rest`` goes to argparse; the others build the `ComposeRequest`."""

    rest: list[str]
    overrides: list[str] = dataclasses.field(default_factory=list)
    flags: list[str] = dataclasses.field(default_factory=list)
    config_dir: str | None = None
    config_name: str | None = None


def is_override(token: str) -> bool:
    """Whether ``token`` is a Hydra override (possibly malformed: Hydra then says why)."""
    return token.startswith(("+", "~")) or bool(_OVERRIDE.match(token))


def split_argv(argv: Sequence[str]) -> SplitArgv:
    """Take the configuration arguments out of ``argv`` (see the module docstring).

    Raises:
        ConfigError: a config flag or ``--config-dir``/``--config-name`` lacks its value.
    """
    from pkgd.config.overrides import flag_takes_value

    out = SplitArgv(rest=[])
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            out.rest += tokens[i - 1:]
            break
        name, eq, inline = token.partition("=")
        if name in _SOURCE_OPTIONS:
            if not eq:
                if i >= len(tokens):
                    raise ConfigError([f"{name}: expects a value"])
                inline, i = tokens[i], i + 1
            setattr(out, name[2:].replace("-", "_"), inline)
            continue
        takes_value = flag_takes_value(token) if token.startswith("-") else None
        if takes_value is None:
            (out.overrides if is_override(token) else out.rest).append(token)
            continue
        out.flags.append(token)
        if takes_value:
            if i >= len(tokens):
                raise ConfigError([f"{token}: expects a value"])
            out.flags.append(tokens[i])
            i += 1
    return out
