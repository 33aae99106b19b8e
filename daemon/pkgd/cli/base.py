"""The subcommand abstraction of the ``pkgd`` command line (vLLM's ``CLISubcommand``).

A subcommand module exposes ``cmd_init() -> list[CLISubcommand]`` and is listed, with its
command names, in `pkgd.cli.main.SUBCOMMANDS`; `main` imports only the module of the command
being run, so a heavy module costs nothing to ``pkgd --help`` or another command.

Before argparse sees argv, `main` takes out the configuration arguments wherever they stand
(Hydra overrides such as ``parallel.tp=2`` / ``+model=qwen`` / ``~frontend.cors``, the vLLM
flags of the schema such as ``--tensor-parallel-size 2``, and ``--config-dir`` /
``--config-name``) and hands them to every subcommand as ``args.compose_request``, a
`pkgd.config.compose.ComposeRequest`. A subcommand that needs the configuration calls
``compose(args.compose_request)``; a `ConfigError` it lets through is printed one problem
per line and exits 2. So a subcommand must not define options named like those flags
(a test checks every registered subcommand).
"""

from __future__ import annotations

import argparse
from typing import Any


class CLISubcommand:
    """One ``pkgd`` subcommand.

    ``name``: the word on the command line; ``help``: one line for ``pkgd --help``.
    ``subparser_init`` adds the subcommand's parser to ``subparsers`` and returns it;
    ``validate`` checks parsed arguments before ``cmd`` runs (raise `ConfigError` or call
    ``parser.error``); ``cmd`` does the work and returns the exit status (None = 0).
    """

    name: str = ""
    help: str = ""

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser:
        raise NotImplementedError

    def validate(self, args: argparse.Namespace) -> None:  # noqa: B027 - optional hook
        """Check ``args`` before `cmd`; the default accepts everything."""

    def cmd(self, args: argparse.Namespace) -> int | None:
        raise NotImplementedError


def add_config_source_args(parser: argparse.ArgumentParser) -> None:
    """Document ``--config-dir`` / ``--config-name`` on ``parser`` (`main` reads them anywhere)."""
    group = parser.add_argument_group("configuration files")
    group.add_argument(
        "--config-dir",
        metavar="DIR",
        help="system config tree (DIR/NAME.yaml, DIR/conf.d/*.yaml, DIR/GROUP/OPTION.yaml); "
        "default /etc/pkgd when it exists",
    )
    group.add_argument(
        "--config-name", metavar="NAME", help="root file of the system tree: DIR/NAME.yaml (default pkgd)"
    )
