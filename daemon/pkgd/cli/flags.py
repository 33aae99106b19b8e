"""Split argv into configuration arguments and the rest.

Configuration arguments may stand anywhere on the command line, before or after the
subcommand (``pkgd +model=qwen parallel.tp=2 config show``), so they are taken out before
argparse parses what is left:

* Hydra overrides: a token starting with ``+`` or ``~``, or ``KEY=VALUE`` whose KEY is a
  dotted name (``parallel.tp=2``, ``model=qwen``, ``model.source=/a/b``);
* the vLLM flags listed in the schema's ``x-cli-aliases`` (``--port 9000``, ``--port=9000``,
  ``--headless``, ``--disable-prefix-caching``, ``-tp 2``, ``--served-model-name a b``: a
  list key's flag takes the words after it up to the next option, override or command), and
  every other flag of ``vllm serve``, which `pkgd.config.vllm_flags` answers;
* ``--config-dir DIR`` and ``--config-name NAME``; ``--config FILE`` (vLLM's YAML of flags).

A ``--`` ends the scan: what follows goes to the subcommand untouched (``pkgd serve -- a=b``
serves a model directory named ``a=b``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence

from pkgd.config.errors import ConfigError

_OVERRIDE = re.compile(r"^[A-Za-z_][\w\-]*(?:[./][\w\-]+)*=")
_SOURCE_OPTIONS = ("--config-dir", "--config-name")
# Flags whose values are ``name=path`` pairs (vLLM's --lora-modules), not Hydra overrides.
_NAME_VALUE_FLAGS = frozenset({"--lora-modules"})


@dataclasses.dataclass
class SplitArgv:
    """``rest`` goes to argparse; the others build the `ComposeRequest`."""

    rest: list[str]
    overrides: list[str] = dataclasses.field(default_factory=list)
    flags: list[str] = dataclasses.field(default_factory=list)
    config_dir: str | None = None
    config_name: str | None = None
    vllm_config: str | None = None


def is_override(token: str) -> bool:
    """Whether ``token`` is a Hydra override (possibly malformed: Hydra then says why)."""
    return token.startswith(("+", "~")) or bool(_OVERRIDE.match(token))


def split_argv(argv: Sequence[str], commands: Collection[str] = ()) -> SplitArgv:
    """Take the configuration arguments out of ``argv`` (see the module docstring).

    ``commands``: subcommand names, where a flag's list of values ends.

    Raises:
        ConfigError: a config flag or ``--config-dir``/``--config-name``/``--config`` lacks
            its value.
    """
    from pkgd.config import schema
    from pkgd.config.overrides import VLLM_CONFIG_FLAG, flag_arity, normalize_flag

    out = SplitArgv(rest=[])
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            out.rest += tokens[i - 1 :]
            break
        name, eq, inline = token.partition("=")
        if name in (*_SOURCE_OPTIONS, VLLM_CONFIG_FLAG):
            if not eq:
                if i >= len(tokens):
                    raise ConfigError([f"{name}: expects a value"])
                inline, i = tokens[i], i + 1
            field = "vllm_config" if name == VLLM_CONFIG_FLAG else name[2:].replace("-", "_")
            setattr(out, field, inline)
            continue
        arity = flag_arity(token) if token.startswith("-") and token != "-" else None
        if arity is None:
            (out.overrides if is_override(token) else out.rest).append(token)
            continue
        out.flags.append(token)
        if arity == 0:
            continue
        # a config key's list stops at an override too; the values of a flag pkgd refuses
        # (``--lora-modules name=path``) are taken whole so its one-line answer is the error
        flag_name = normalize_flag(token).partition("=")[0]
        overrides_end: bool | str = flag_name in schema.alias_index()
        if flag_name in _NAME_VALUE_FLAGS:
            overrides_end = "dotted"  # ``name=path`` is a value; ``parallel.tp=2`` still ends the list
        if arity in (1, "+") and (
            i >= len(tokens) or (arity == "+" and _ends_values(tokens[i], commands, overrides_end=overrides_end))
        ):
            raise ConfigError([f"{token}: expects a value"])
        if arity == 1:
            out.flags.append(tokens[i])
            i += 1
            continue
        while i < len(tokens) and not _ends_values(tokens[i], commands, overrides_end=overrides_end):
            out.flags.append(tokens[i])
            i += 1
            if arity == "?":
                break
    return out


def _ends_values(token: str, commands: Collection[str], *, overrides_end: bool | str = True) -> bool:
    """Whether ``token`` ends a flag's list of values: an option, an override (with
    ``overrides_end="dotted"``: one setting a dotted key, or starting with ``+``/``~``), a command."""
    if token.startswith("-") or token in commands:
        return True
    if overrides_end == "dotted":
        return token.startswith(("+", "~")) or (is_override(token) and "." in token.partition("=")[0])
    return bool(overrides_end) and is_override(token)
