"""Entry point of ``pkgd serve`` (called by ``cli/serve.py`` after the config composed).

``run`` is deliberately thin: the supervisor works on plain objects (a validated
`VllmConfig` and a function that composes it again), so tests drive `Supervisor` directly.
"""

from __future__ import annotations

from typing import Any

from pkgd import log
from pkgd.supervisor.supervisor import Supervisor


def run(composed: Any, request: Any) -> int:
    """Serve ``composed.config`` until stopped; the process exit status.

    ``composed`` is `pkgd.config.compose.ComposedConfig`, ``request`` the
    `pkgd.config.compose.ComposeRequest` it came from: SIGHUP composes the same request
    again (same layers, files re-read), and so does a change of those files under
    ``supervisor.watch_config``. Exit status: 0 after SIGTERM/SIGINT, 1 when children
    failed to start or crashed too often, 2 when a socket or the runtime dir is unusable.
    """
    from pkgd.config.compose import compose  # Hydra: only the supervisor and the CLI import it
    from pkgd.config.sources import ConfigSources

    log.configure(composed.config.logging, role="supervisor")
    sources = ConfigSources.of(request)
    return Supervisor(composed.config, lambda: compose(request).config, sources=sources).run()
