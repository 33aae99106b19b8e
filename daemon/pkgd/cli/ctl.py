"""``pkgd status`` and ``pkgd reload``: talk to a running daemon over its control socket.

The daemon listens on ``RUNTIME_DIR/control.sock`` (`pkgd.supervisor.control`). Which runtime
directory: ``--runtime-dir``, else ``supervisor.runtime_dir`` composed from the same layers
as the daemon's (``--config-dir``, ``/etc/pkgd``, ``PKGD_SUPERVISOR__RUNTIME_DIR``,
overrides), else ``$RUNTIME_DIRECTORY`` (set by systemd), else the first of the defaults the
daemon would pick whose control socket accepts a connection (the default for this user, see
`pkgd.supervisor.runtime`, then ``/run/pkgd``, the systemd unit's ``RuntimeDirectory=``); a
socket file a killed daemon left behind is skipped. When that configuration does not compose
the command stops with its problems (exit 2) instead of guessing: talking to whichever
daemon sits at a default directory would act on another daemon.

Light on purpose: no torch; Hydra only to read ``supervisor.runtime_dir``. Exit status: 0
success; 1 the daemon answered with a failure (reload rejected or failed); 2 no daemon
reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from pkgd.cli.base import CLISubcommand
from pkgd.supervisor.control import ControlError, send_command
from pkgd.supervisor.runtime import CONTROL_SOCKET, ROOT_RUNTIME_DIR, default_runtime_dir, resolve_runtime_dir


def find_runtime_dir(
    explicit: str | None, environ: dict[str, str] | None = None, configured: str | None = None
) -> Path:
    """The runtime directory to use (see module docstring); ``configured`` is
    ``supervisor.runtime_dir`` of the composed configuration."""
    env = dict(os.environ) if environ is None else environ
    if explicit:
        return Path(explicit)
    if configured:
        return resolve_runtime_dir(configured, env)
    if env.get("PKGD_SUPERVISOR__RUNTIME_DIR"):
        return Path(env["PKGD_SUPERVISOR__RUNTIME_DIR"])
    if env.get("RUNTIME_DIRECTORY"):
        return default_runtime_dir(env)
    candidates = list(dict.fromkeys([default_runtime_dir(env), Path(ROOT_RUNTIME_DIR)]))
    for candidate in candidates:
        if _accepts_connections(candidate / CONTROL_SOCKET):
            return candidate
    return candidates[0]


def _accepts_connections(path: Path) -> bool:
    """Whether a daemon listens on the Unix socket ``path`` (False for a stale socket file)."""
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime-dir",
        metavar="DIR",
        help="runtime directory of the daemon (holds control.sock); default: found as the daemon resolves it",
    )
    parser.add_argument("--json", action="store_true", help="print the daemon's JSON reply")


def _configured_runtime_dir(args: argparse.Namespace) -> str | None:
    """``supervisor.runtime_dir`` as the daemon composes it (same layers: ``--config-dir``,
    ``/etc/pkgd``, environment, overrides); None when unset.

    Raises `ConfigError` (exit 2) when the configuration does not compose: which daemon it
    belongs to is then unknown, and a default guess could reach another one.
    """
    request = getattr(args, "compose_request", None)
    if request is None or args.runtime_dir:
        return None
    from pkgd.config.compose import compose
    from pkgd.config.errors import ConfigError

    try:
        return compose(request).config.supervisor.runtime_dir
    except ConfigError as exc:
        raise ConfigError(
            [
                *exc.problems,
                f"pkgd {args.command_name}: not sent: this configuration does not compose, so its daemon "
                "(supervisor.runtime_dir) is unknown; fix it, or name the daemon with --runtime-dir DIR",
            ]
        ) from None


def _ask(args: argparse.Namespace, command: str) -> dict[str, Any] | None:
    path = find_runtime_dir(args.runtime_dir, configured=_configured_runtime_dir(args)) / CONTROL_SOCKET
    try:
        return send_command(path, command)
    except ControlError as exc:
        print(f"pkgd {command}: {exc}", file=sys.stderr)
        return None


class _ControlCommand(CLISubcommand):
    """A subcommand that sends ``name`` to the daemon's control socket and prints the reply."""

    description: str  # each command's --help text

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.description)
        _add_common(parser)
        return parser

    def cmd(self, args: argparse.Namespace) -> int:
        args.command_name = self.name
        reply = _ask(args, self.name)
        if reply is None:
            return 2
        print(json.dumps(reply, indent=2) if args.json else self.format(reply))
        return self.exit_status(reply)

    def format(self, reply: dict[str, Any]) -> str:
        raise NotImplementedError

    def exit_status(self, reply: dict[str, Any]) -> int:
        return 0


class StatusCommand(_ControlCommand):
    """``pkgd status``: children, PIDs, uptime, config hash, serve mode, endpoint health."""

    name = "status"
    help = "show the running daemon's processes and configuration"
    description = (
        "Show the running daemon's children (PIDs, state, uptime, restarts), serve mode, config hash and "
        "endpoint health."
    )

    def format(self, reply: dict[str, Any]) -> str:
        return format_status(reply["status"])


class ReloadCommand(_ControlCommand):
    """``pkgd reload``: re-compose and apply the config, as SIGHUP does, and wait for the outcome."""

    name = "reload"
    help = "make the running daemon compose its configuration again"
    description = (
        "Make the running daemon compose its configuration again and apply the difference, as SIGHUP does; "
        "waits for the outcome and exits 2 when the new configuration does not validate (nothing changed), "
        "1 when it failed to start (the previous one keeps serving)."
    )

    def format(self, reply: dict[str, Any]) -> str:
        return format_reload(reply)

    def exit_status(self, reply: dict[str, Any]) -> int:
        """0 applied or unchanged; 2 rejected (an invalid tree, as every pkgd command exits on
        one); 1 otherwise (failed to start, refused while stopping)."""
        if reply.get("ok"):
            return 0
        return 2 if reply.get("result") == "rejected" else 1


def cmd_init() -> list[CLISubcommand]:
    """The subcommands this module adds to ``pkgd``."""
    return [StatusCommand(), ReloadCommand()]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_status(s: dict[str, Any]) -> str:
    """Human-readable ``pkgd status``."""
    lines = [
        f"pkgd pid {s['pid']}  {s['state']}  mode {s['mode']}  "
        f"up {_duration(s['uptime_s'])}  config {s['config_hash']}",
        f"model    {s['model']}",
    ]
    health = {h["url"]: h for h in s["health"]}
    for url in s["urls"]:
        h = health.get(url)
        shown = (
            "not probed yet"
            if h is None
            else ("healthy" if h["healthy"] else f"unhealthy ({h['status'] or h['error']})")
        )
        lines.append(f"listen   {url}  {shown}")
    lines.append(f"{'ROLE':<12} {'INDEX':>5} {'PID':>8}  {'STATE':<10} {'UPTIME':>8} {'RESTARTS':>8}  ADDRESS")
    for c in s["children"]:
        lines.append(
            f"{c['role']:<12} {c['index']:>5} {c['pid']:>8}  {c['state']:<10} {_duration(c['uptime_s']):>8} "
            f"{c['restarts']:>8}  {c['address']}"
        )
    for g in s.get("draining", []):
        limit = g["reload_drain_timeout"]
        lines.append(
            f"draining generation {g['generation']}: {g['connections']} connection(s), {len(g['children'])} "
            f"child(ren), {g['draining_s']:.0f} s of " + ("no limit" if limit is None else f"{limit:g} s")
        )
    if s.get("retiring") and not s.get("draining"):
        lines.append(f"retiring {s['retiring']} replaced child(ren), draining")
    if s.get("last_reload"):
        lines.append("last reload: " + format_reload(s["last_reload"]))
    return "\n".join(lines)


def format_reload(r: dict[str, Any]) -> str:
    """One line (plus one per problem) describing a reload outcome."""
    text = r["result"]
    if r.get("reload_class"):
        text += f" ({r['reload_class']}: {', '.join(r['changed'])})"
    if "duration_s" in r:
        text += f" in {r['duration_s']:.2f} s"
    return "\n".join([text, *(f"  {p}" for p in r.get("problems", []))])
