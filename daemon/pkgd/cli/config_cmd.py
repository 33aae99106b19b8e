"""``pkgd config show|validate|keys|schema|diff``: the configuration without serving anything.

None of these imports torch. ``show`` prints the composed tree (secrets redacted), with
``--sources`` the layer of each value; ``validate PATH…`` checks config trees for a GitOps
CI (exit 0, or 2 with one line per problem; with ``--check-host`` also against this host, as
``pkgd serve`` does before it starts anything); ``keys [SECTION]`` prints the key reference
(`pkgd.cli.keys`; ``--format markdown`` is ``docs/configuration.md``); ``schema`` prints the
JSON schema;
``diff A B`` says which leaves differ and what a reload from A to B would restart (exit 0
when equal, 1 when they differ, 2 when either is invalid, like diff(1)).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from pkgd.cli.base import CLISubcommand, add_config_source_args
from pkgd.config.errors import ConfigError

_PATH_HELP = (
    "A directory is used as --config-dir (DIR/pkgd.yaml, DIR/conf.d/*.yaml, DIR/GROUP/*.yaml); "
    "a file F.yaml as --config-dir $(dirname F) --config-name F, exactly as the daemon would read it"
)


class ConfigSubcommand(CLISubcommand):
    name = "config"
    help = "show, validate or diff the configuration; list its keys; print its JSON schema"

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(
            self.name,
            help=self.help,
            description="Inspect the configuration. Overrides, vLLM flags and --config-dir / "
            "--config-name apply as for serve.",
        )
        add_config_source_args(parser)
        actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
        show = actions.add_parser("show", help="print the composed configuration (secrets redacted)")
        show.add_argument("--sources", action="store_true", help="add the layer that set each value")
        show.add_argument("--format", choices=("yaml", "json"), default="yaml", help="output format")
        validate = actions.add_parser(
            "validate",
            help="check config trees or files; exit 0 if all are valid, else 2",
            description=f"Compose each PATH as the daemon would and report every problem. {_PATH_HELP}. "
            "Without PATH, checks the default tree (/etc/pkgd or --config-dir).",
        )
        validate.add_argument(
            "paths", nargs="*", metavar="PATH", help="config tree or file; default: /etc/pkgd or --config-dir"
        )
        validate.add_argument(
            "--check-host",
            action="store_true",
            help="also check each tree against this host, as pkgd serve does before it starts: the model "
            "source and chat template files exist, a CUDA torch for parallel.device cuda, "
            "cache.kv_cache_memory_bytes within this host's memory. Off by default, so a CI runner can "
            "validate configs for other machines",
        )
        keys = actions.add_parser(
            "keys",
            help="every config key with its type, default, vLLM flag and meaning",
            description="The configuration keys from the schema: type, default, vLLM flags, what a "
            "reload does when the key changes, and what it means.",
        )
        keys.add_argument(
            "section",
            nargs="?",
            metavar="SECTION",
            help="only this section or key (model, frontend.cors, parallel.tp); default: all",
        )
        keys.add_argument(
            "--format",
            choices=("text", "markdown"),
            default="text",
            help="markdown: the reference as docs/configuration.md holds it",
        )
        schema_cmd = actions.add_parser(
            "schema",
            help="print the JSON schema of the configuration (or of the YAML files that build it)",
            description="Print the JSON schema of the validated tree (schemas/vllm_config.schema.json). "
            "--file: of a whole-tree YAML file (pkgd.yaml, conf.d/*.yaml, profiles; schemas/pkgd-file.schema.json); "
            "--group SECTION: of an option file of that config group (schemas/groups/SECTION.schema.json).",
        )
        kind = schema_cmd.add_mutually_exclusive_group()
        kind.add_argument("--file", action="store_true", help="the schema of a whole-tree YAML file")
        kind.add_argument("--group", metavar="SECTION", help="the schema of a group option file, e.g. parallel")
        diff = actions.add_parser(
            "diff",
            help="what differs between two configs and what a reload would restart",
            description=f"Compare two configurations leaf by leaf and say what a reload from A to B "
            f"would restart: nothing, the API servers, the engine cores, or the whole daemon. {_PATH_HELP}. "
            "Exit 0 when equal, 1 when they differ, 2 when either is invalid (like diff).",
        )
        diff.add_argument("a", metavar="A", help="the config tree or file of now")
        diff.add_argument("b", metavar="B", help="the config tree or file to reload into")
        return parser

    def cmd(self, args: argparse.Namespace) -> int:
        action = {"show": _show, "validate": _validate, "keys": _keys, "schema": _schema, "diff": _diff}[
            args.config_command
        ]
        return action(args)


def cmd_init() -> list[CLISubcommand]:
    return [ConfigSubcommand()]


def _show(args: argparse.Namespace) -> int:
    from pkgd.config.compose import compose

    composed = compose(args.compose_request)
    data = composed.config.to_json_dict()
    for warning in composed.warnings:
        print(f"pkgd: warning: {warning}", file=sys.stderr)
    if args.format == "json":
        payload = {"config": data, "sources": composed.sources} if args.sources else data
        print(json.dumps(payload, indent=2))
    else:
        print(render_yaml(data, composed.sources if args.sources else None), end="")
        print(f"# {describe_plan(composed)}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from pkgd.cli import keys

    if args.format == "markdown":
        if args.section:
            print(
                "pkgd config keys: error: --format markdown prints the whole reference; leave out SECTION",
                file=sys.stderr,
            )
            return 2
        sys.stdout.write(keys.keys_markdown())
        return 0
    try:
        print(keys.keys_text(args.section))
    except ConfigError as e:
        print(f"pkgd config keys: error: {e.problems[0]}", file=sys.stderr)
        return 2
    return 0


def _schema(args: argparse.Namespace) -> int:
    from pkgd.config import file_schemas
    from pkgd.config.errors import closest
    from pkgd.config.schema import schema_text

    if args.group is not None:
        sections = file_schemas.group_sections()
        if args.group not in sections:
            match = closest(args.group, sections)
            hint = f"; did you mean {match}?" if match else ""
            print(
                f"pkgd: config schema --group {args.group}: no such section{hint} ({', '.join(sections)})",
                file=sys.stderr,
            )
            return 2
        sys.stdout.write(json.dumps(file_schemas.group_schema(args.group), indent=2) + "\n")
    elif args.file:
        sys.stdout.write(json.dumps(file_schemas.file_schema(), indent=2) + "\n")
    else:
        sys.stdout.write(schema_text())
    return 0


def _validate(args: argparse.Namespace) -> int:
    from pkgd.config.compose import compose

    failed = False
    for path in args.paths or [None]:
        label = path or args.compose_request.config_dir or "configuration"
        try:
            composed = compose(request_for(path, args.compose_request))
        except ConfigError as e:
            failed = True
            for line in e.problems:
                print(f"{label}: {line}", file=sys.stderr)
            continue
        for warning in composed.warnings:
            print(f"{label}: warning: {warning}", file=sys.stderr)
        if problems := (_host_problems(composed.config) if args.check_host else []):
            failed = True
            for line in problems:
                print(f"{label}: {line}", file=sys.stderr)
            continue
        print(f"{label}: ok ({describe_plan(composed)})")
    return 2 if failed else 0


def _host_problems(config: Any) -> list[str]:
    """What ``pkgd serve`` refuses on this host before starting anything (`pkgd.cli.serve`,
    `pkgd.supervisor.preflight`)."""
    from pkgd.model_files.resolve import model_source_problems
    from pkgd.supervisor.preflight import host_problems

    return model_source_problems(config.model) + host_problems(config)


def _diff(args: argparse.Namespace) -> int:
    from pkgd.config.compose import compose
    from pkgd.config.reload import plan_reload

    composed, problems = {}, []
    for path in (args.a, args.b):
        try:
            composed[path] = compose(request_for(path, args.compose_request))
        except ConfigError as e:
            problems += [f"{path}: {line}" for line in e.problems]
    if problems:
        raise ConfigError(problems)
    plan = plan_reload(composed[args.a].config, composed[args.b].config)
    for change in plan.changes:
        print(f"{change.key}: {_flow(change.old)} -> {_flow(change.new)}  [{change.reload.value}]")
    if plan.is_noop:
        print("no differences; a reload would do nothing")
        return 0
    print(f"sections: {', '.join(plan.sections)}")
    print(f"reload: {plan.reload_class.value}: {plan.effect}")
    return 1


def request_for(path: str | None, base: Any) -> Any:
    """``base`` (a `ComposeRequest`) pointed at the config tree or file ``path``."""
    if path is None:
        return base
    p = Path(path)
    if p.is_dir():
        return dataclasses.replace(base, config_dir=str(p), config_name=None)
    if p.is_file():
        if p.suffix != ".yaml":
            raise ConfigError([f"{path}: expected a directory or a .yaml file"])
        return dataclasses.replace(base, config_dir=str(p.parent), config_name=p.stem)
    raise ConfigError([f"{path}: no such file or directory"])


def describe_plan(composed: Any) -> str:
    """One line on the serve mode and process counts of a composed config."""
    plan = composed.plan
    return (
        f"serve mode {plan.mode}: {plan.api_server_count} API server(s), {plan.dp_local} engine "
        f"core(s) here of data-parallel size {plan.dp_size}, tensor-parallel size {composed.config.parallel.tp}"
    )


def _flow(value: Any) -> str:
    """A value as one line of YAML (flow style)."""
    import yaml

    if isinstance(value, str) and "\n" in value:
        return json.dumps(value)  # a JSON string is a valid YAML double-quoted scalar
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True).rstrip("\n")
    return text.removesuffix("\n...")


def render_yaml(data: dict[str, Any], sources: dict[str, str] | None = None) -> str:
    """The tree as block YAML, one leaf per line; with ``sources``, a ``# layer`` comment each."""
    from pkgd.config import schema

    sections = schema.sections()
    lines: list[str] = []

    def walk(node: dict[str, Any], prefix: str, depth: int) -> None:
        for name, value in node.items():
            key = prefix + name
            if key in sections:
                lines.append(f"{'  ' * depth}{name}:")
                walk(value, key + ".", depth + 1)
                continue
            line = f"{'  ' * depth}{name}: {_flow(value)}"
            lines.append(f"{line}  # {sources.get(key, 'default')}" if sources is not None else line)

    walk(data, "", 0)
    return "\n".join(lines) + "\n"
