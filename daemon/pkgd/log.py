"""structlog set-up shared by every pkgd process (docs/operations.md for what the logs say).

One event per line, each with ``pid``, ``role`` (supervisor / engine-core / api-server / cli),
``dp_rank`` and, where one is bound with `bind_request`, ``request_id``. JSON lines when
``logging.format`` is ``json``, or ``auto`` and stderr is not a TTY or systemd's journal is
attached (``JOURNAL_STREAM`` set); readable console lines otherwise.

Usage::

    from pkgd import log
    log.configure(cfg.logging, role="engine-core", dp_rank=0)
    logger = log.get_logger(__name__)
    logger.info("engine_ready", num_kv_blocks=1024)
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from pkgd.config.sections import LoggingConfig

_console: bool | None = None  # what the last configure() chose; None: not configured yet

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def wants_json(fmt: str) -> bool:
    """Whether ``logging.format`` resolves to JSON lines here."""
    if fmt != "auto":
        return fmt == "json"
    return bool(os.environ.get("JOURNAL_STREAM")) or not sys.stderr.isatty()


def configure(
    cfg: LoggingConfig | None = None,
    *,
    role: str,
    dp_rank: int | None = None,
    stream: Any = None,
    stdlib: bool = True,
) -> None:
    """Configure structlog (and, with ``stdlib``, stdlib logging, so library logs share the
    format).

    Call once per process, as early as possible; call again to change the level live.
    """
    global _console
    level_name = cfg.level if cfg is not None else "info"
    fmt = cfg.format if cfg is not None else "auto"
    level = _LEVELS[level_name]
    stream = stream or _CurrentStderr()
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(pid=os.getpid(), role=role)
    if dp_rank is not None:
        structlog.contextvars.bind_contextvars(dp_rank=dp_rank)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    _console = not wants_json(fmt) and stream.isatty()
    if wants_json(fmt):
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        # plain_traceback: rich's pretty tracebacks took seconds per error under load.
        renderer = structlog.dev.ConsoleRenderer(
            colors=stream.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write per line (text and newline together): processes sharing stderr never
        # split each other's lines, even unbuffered (PYTHONUNBUFFERED, print() writes twice).
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    if not stdlib:
        return
    # Library logs (hypercorn, asyncio …) go through the same renderer, so a JSON journal
    # never gets a plain-text line; StreamHandler also writes each line in one call.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level, logging.WARNING))
    # The HTTP server's own lines (vLLM's --uvicorn-log-level); "trace" is uvicorn's level
    # below debug, which hypercorn does not have.
    http_level = cfg.http_server_level if cfg is not None else "warning"
    logging.getLogger("hypercorn").setLevel(_LEVELS.get(http_level, logging.DEBUG))


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of each write (not the object it was
    at `configure` time, which a test harness or a redirect may have closed since)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def ensure_configured(role: str) -> None:
    """`configure` structlog with the defaults unless it is set up already (by pkgd or by
    the program embedding it), leaving stdlib logging to that program: the offline `LLM`
    logs its start-up to stderr, never into stdout."""
    if _console is None and not structlog.is_configured():
        configure(None, role=role, stdlib=False)


def is_console() -> bool:
    """Whether this process logs readable lines to a terminal (then progress bars and the
    ready headline are shown); before `configure`, whether stderr is a terminal outside
    systemd's journal."""
    if _console is None:
        return not wants_json("auto")
    return _console


def set_level(level_name: str) -> None:
    """Change the level in place (a live SIGHUP reload of ``logging.level``)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level_name]))


def get_logger(name: str | None = None) -> Any:
    """A structlog logger; ``name`` is bound as ``logger_name``."""
    return structlog.get_logger() if name is None else structlog.get_logger(logger_name=name)


def bind_request(request_id: str) -> Any:
    """Context manager binding ``request_id`` to every log line inside it."""
    return structlog.contextvars.bound_contextvars(request_id=request_id)
