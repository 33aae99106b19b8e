"""``pkgd`` command line entry point: a thin dispatcher over lazily imported subcommands.

``pkgd [CONFIG ARGS] [COMMAND] [ARGS]``; COMMAND defaults to ``serve``. Configuration
arguments (Hydra overrides, vLLM flags, ``--config-dir``/``--config-name``) may stand
anywhere; see `pkgd.cli.flags`. Exit status: the command's, 2 for an invalid configuration or
usage (one line per problem, no traceback), 130 on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from pkgd.cli.base import CLISubcommand, add_config_source_args  # noqa: E402
from pkgd.cli.flags import split_argv  # noqa: E402
from pkgd.cli.parser import ArgumentParser  # noqa: E402
from pkgd.config.errors import ConfigError, closest  # noqa: E402

# name -> (module whose cmd_init() returns it, one line for --help). Modules are imported only
# when their command runs; a module that does not exist (yet) is not listed at all.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pkgd.cli.serve", "serve the configured model over the OpenAI-compatible API (default)"),
    "config": ("pkgd.cli.config_cmd", "show, validate or diff the configuration; list its keys; print its JSON schema"),
    # Written by other parts of pkgd on `pkgd.cli.base.CLISubcommand`:
    "bench": ("pkgd.cli.bench", "benchmark offline throughput or latency, or a running server"),
    "run-batch": ("pkgd.cli.run_batch", "run a JSONL file of OpenAI requests offline"),
    "status": ("pkgd.cli.ctl", "show the running daemon's processes and configuration"),
    "reload": ("pkgd.cli.ctl", "make the running daemon compose its configuration again"),
    "collect-env": (
        "pkgd.cli.collect_env",
        "print the versions, hardware, kernels and config digest a bug report needs",
    ),
    "launch": ("pkgd.cli.launch", "launch render: print the prompt a chat request becomes, without an engine"),
}
DEFAULT_SUBCOMMAND = "serve"
_HELP = ("-h", "--help")

DESCRIPTION = """\
pkgd serves an LLM over an OpenAI-compatible API as a config-driven daemon: the packaged
presets, the system tree (/etc/pkgd or --config-dir), PKGD_SECTION__FIELD environment
variables and the command line compose into one validated configuration."""

EXAMPLES = """\
examples:
  pkgd                                     serve the default model on 127.0.0.1:8000
  pkgd --port 9000 --api-key sk-local      another port, clients need the key
  pkgd serve /models/Qwen3-0.6B --tensor-parallel-size 2
  pkgd +model=qwen parallel.tp=2           choose a preset, set a key
  pkgd config show --sources               the composed tree and each value's layer
  pkgd config keys frontend                the keys of one section, with flags and defaults
  pkgd serve --help=max-model-len          the keys a word or vLLM flag names (--help=all: every key)
  pkgd config validate ./deploy            check a config tree (exit 0 or 2)
  pkgd bench throughput --num-prompts 64   offline throughput of the engine"""


def module_exists(name: str) -> bool:
    """Whether module ``name`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def available_subcommands() -> dict[str, tuple[str, str]]:
    """The entries of `SUBCOMMANDS` whose module exists."""
    return {name: entry for name, entry in SUBCOMMANDS.items() if module_exists(entry[0])}


class UsageError(Exception):
    """A command line argparse cannot word well; printed as ``pkgd: error: …``, exit 2."""


def _command_of(rest: list[str], names: Sequence[str]) -> tuple[list[str], str | None]:
    """The subcommand named in ``rest``, inserting the default one when none is.

    Raises:
        UsageError: the first word is no command but close to one (``confg``) and names no
            file (so it is no model for ``serve`` either).
    """
    first = next((t for t in rest if not t.startswith("-")), None)
    if first in names:
        return rest, first
    if first is None and any(t in (*_HELP, "--version") for t in rest):
        return rest, None  # pkgd --help / --version
    if first is not None and not os.path.exists(first) and (match := closest(first, names)):
        raise UsageError(f"unknown command {first!r}; did you mean {match}?")
    return [DEFAULT_SUBCOMMAND, *rest], DEFAULT_SUBCOMMAND


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pkgd")
    except PackageNotFoundError:
        return "unknown"


def build_parser(
    command: str | None, *, with_help_text: bool = True
) -> tuple[ArgumentParser, dict[str, CLISubcommand]]:
    """The ``pkgd`` parser, with the real subparser of ``command`` only (others are listed).

    ``with_help_text``: build the texts only ``--help`` / ``--version`` show (the common flags
    need the JSON schema, the version a metadata lookup: ~60 ms together).
    """
    epilog = None
    if with_help_text:
        from pkgd.cli.keys import common_flags_text

        epilog = common_flags_text() + "\n\n" + EXAMPLES
    parser = ArgumentParser(
        prog="pkgd",
        usage="pkgd [COMMAND] [KEY=VALUE | +GROUP=OPTION | ~KEY | --vllm-flag [VALUE]] ...",
        description=DESCRIPTION,
        epilog=epilog,
    )
    parser.add_argument("--version", action="version", version=f"pkgd {_version() if with_help_text else ''}")
    add_config_source_args(parser)
    # prog: argparse would derive the commands' names from the custom usage line
    subparsers = parser.add_subparsers(
        dest="subcommand", metavar="COMMAND", title="commands (default: serve)", prog="pkgd"
    )
    table = available_subcommands()
    commands: dict[str, CLISubcommand] = {}
    if command in table:
        for cmd in importlib.import_module(table[command][0]).cmd_init():
            commands[cmd.name] = cmd
    for name, (_, help_line) in table.items():
        if name in commands:
            commands[name].subparser_init(subparsers)
        else:
            subparsers.add_parser(name, help=help_line)
    for name, cmd in commands.items():
        if name not in table:
            cmd.subparser_init(subparsers)
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pkgd`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    from pkgd.config.compose import ComposeRequest

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = ["--help" if t == "--help=" else t for t in argv]  # an empty topic: the usual help
    try:
        if topic := next((t.partition("=")[2] for t in argv if t.startswith("--help=")), None):
            return _help_topic(argv, topic)
        split = split_argv(argv, commands=available_subcommands())
        rest, command = _command_of(split.rest, list(available_subcommands()))
        wants_help = any(t in (*_HELP, "--version") for t in rest)
        parser, commands = build_parser(command, with_help_text=wants_help)
        args = parser.parse_command_line(rest)
        args.compose_request = ComposeRequest(
            config_dir=split.config_dir,
            config_name=split.config_name,
            vllm_config=split.vllm_config,
            overrides=tuple(split.overrides),
            flags=tuple(split.flags),
        )
        cmd = commands[args.subcommand]
        cmd.validate(args)
        return int(cmd.cmd(args) or 0)
    except ConfigError as e:
        print_problems(e.problems)
        return 2
    except UsageError as e:
        print(f"pkgd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pkgd config show | head`: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _help_topic(argv: list[str], topic: str) -> int:
    """vLLM's ``vllm serve --help=all|GROUP|KEYWORD``: ``all`` is the command's ``--help``
    followed by every key; other topics print their keys (`pkgd.cli.keys.help_topic_text`)."""
    from pkgd.cli.keys import help_topic_text

    try:
        text = help_topic_text(topic)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if topic == "all":
        with contextlib.suppress(SystemExit):  # argparse exits after printing the help
            main([t for t in argv if not t.startswith("--help=")] + ["--help"])
        print()
    print(text)
    return 0


def print_problems(problems: Sequence[str], *, file: TextIO | None = None) -> None:
    """Print a `ConfigError`'s problems, one per line, to stderr."""
    out = file or sys.stderr
    print(f"pkgd: invalid configuration ({len(problems)} problem{'s' if len(problems) != 1 else ''}):", file=out)
    for line in problems:
        print(f"  {line}", file=out)


if __name__ == "__main__":
    # `python -m pkgd.cli.main`: run the module as imported under its own name, so the
    # `UsageError` the subcommands import from it is the class `main` catches (exit 2, not 1).
    from pkgd.cli.main import main as _main

    sys.exit(_main())
