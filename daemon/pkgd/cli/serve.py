"""``pkgd serve [MODEL]``: compose and validate, then hand over to the supervisor daemon.

An invalid configuration exits 2 before anything heavy is imported or started. The daemon
itself is `pkgd.supervisor.daemon.run(composed, request) -> int`; it gets the
`ComposeRequest` too, so it can compose again on SIGHUP.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from typing import Any

from pkgd.cli.base import CLISubcommand, add_config_source_args

SUPERVISOR_MODULE = "pkgd.supervisor.daemon"


class ServeSubcommand(CLISubcommand):
    name = "serve"
    help = "serve the configured model over the OpenAI-compatible API (default)"

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser:
        from pkgd.cli.keys import common_flags_text

        parser = subparsers.add_parser(
            self.name,
            help=self.help,
            usage="pkgd serve [MODEL] [KEY=VALUE | +GROUP=OPTION | ~KEY | --vllm-flag [VALUE]] ...",
            description="Serve the model of the composed configuration: bind the socket, start the\n"
            "engine cores and the API servers, and supervise them (SIGHUP reloads).",
            epilog=common_flags_text() + "\n\nexamples:\n"
            "  pkgd serve                               the default model on 127.0.0.1:8000\n"
            "  pkgd serve /models/Qwen3-0.6B --port 9000 --max-model-len 4096\n"
            "  pkgd serve +model=qwen frontend.api_server_count=2",
        )
        parser.add_argument(
            "model_tag",
            nargs="?",
            metavar="MODEL",
            help="model to serve: a Hugging Face directory, a .gguf file or pkg:PACKAGE/FILE "
            "(sets model.source and beats every other setting of it, like vLLM's positional model)",
        )
        add_config_source_args(parser)
        return parser

    def validate(self, args: argparse.Namespace) -> None:
        """Compose the configuration and check the model source exists (a `ConfigError`
        exits 2 before anything starts)."""
        from pkgd.config.compose import compose

        if args.model_tag:
            request = args.compose_request
            args.compose_request = dataclasses.replace(request, flags=(*request.flags, "--model", args.model_tag))
        args.composed = compose(args.compose_request)
        from pkgd.config.errors import ConfigError
        from pkgd.model_files.resolve import model_source_problems

        problems = model_source_problems(args.composed.config.model)
        if problems:  # exit 2 like any config error, so systemd does not restart in a loop
            raise ConfigError(problems)

    def cmd(self, args: argparse.Namespace) -> int:
        from pkgd import log
        from pkgd.cli.main import module_exists

        composed = args.composed
        log.configure(composed.config.logging, role="supervisor")
        logger = log.get_logger(__name__)
        for warning in composed.warnings:
            logger.warning("config_warning", warning=warning)
        if not module_exists(SUPERVISOR_MODULE):
            print("pkgd: serving is not implemented yet", file=sys.stderr)
            return 1
        daemon = importlib.import_module(SUPERVISOR_MODULE)
        return int(daemon.run(composed, args.compose_request))


def cmd_init() -> list[CLISubcommand]:
    return [ServeSubcommand()]
