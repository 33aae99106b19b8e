"""The line a person reads when the daemon is ready (on a terminal, before the structured
``ready`` line; under systemd only the structured line is written)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pkgd.config.vllm_config import VllmConfig


def served_model(config: VllmConfig, engines: Sequence[Any]) -> str:
    """The first name clients may use: as configured, else the name the engine cores report
    in their handshake (``engines``: ready `Child` objects), else ``model.source``."""
    names = list(config.frontend.served_model_names) or ([config.model.name] if config.model.name else [])
    for child in engines:
        if not names and child.ready.done() and child.ready.exception() is None:
            names = [getattr(child.ready.result(), "model_name", "")]
    return names[0] if names and names[0] else config.model.source


def ready_headline(config: VllmConfig, urls: Sequence[str], engines: Sequence[Any]) -> str:
    """E.g. ``pkgd ready: http://127.0.0.1:8000 (SmolLM2-135M-Instruct, 1 engine core, 1 API
    server) — try: curl http://127.0.0.1:8000/v1/models``; ``engines`` are the engine-core
    `Child` objects (``spec.address``, ``ready``)."""

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    model = served_model(config, engines)
    cores = count(len(engines), "engine core")
    if not urls:  # headless: engine cores only, for another pkgd's API servers
        where = ", ".join(c.spec.address for c in engines)
        return (
            f"pkgd ready: {cores} of {model} on {where} (headless) — the API servers of another pkgd "
            "reach them through parallel.remote_engines"
        )
    servers = count(config.serve_plan().api_server_count, "API server")
    url = urls[0]
    auth = "-H 'Authorization: Bearer <key>' " if config.frontend.api_keys else ""
    if url.startswith("unix:"):
        target = f"--unix-socket {url.removeprefix('unix:')} {auth}http://localhost/v1/models"
    else:
        target = f"{auth}{url}/v1/models"
    also = f" (also {', '.join(urls[1:])})" if len(urls) > 1 else ""
    return f"pkgd ready: {url}{also} ({model}, {cores}, {servers}) — try: curl {target}"
