"""Runs a `Supervisor` on a YAML config file with the fake children (tests/supervisor/fakes).

``python harness.py CONFIG.yaml``: the file is read and validated at start and again on each
reload, standing in for the config engineer's Hydra composition (a broken file makes the
reload fail exactly as a broken /etc/pkgd layer would).

``python harness.py --config-dir DIR``: the real composition of the system tree DIR (as
``pkgd serve --config-dir DIR``: DIR/pkgd.yaml, DIR/conf.d/*.yaml over the packaged presets),
with its files passed as the supervisor's watched sources (``supervisor.watch_config``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from pkgd import log
from pkgd.config.vllm_config import VllmConfig
from pkgd.supervisor.preflight import host_problems, serve_problems
from pkgd.supervisor.supervisor import Supervisor
from pkgd.supervisor.topology import Entrypoints

FAKES = Path(__file__).parent / "fakes"
ENTRYPOINTS = Entrypoints(
    engine_core=(sys.executable, str(FAKES / "fake_engine.py")),
    api_server=(sys.executable, str(FAKES / "fake_api.py")),
)


def preflight(config: VllmConfig) -> list[str]:
    """`serve_problems`, but a ``fake:`` model source (read by the fake engine) exists."""
    if str(config.model.source).startswith("fake:"):
        return host_problems(config)
    return serve_problems(config)


def load(path: str) -> VllmConfig:
    return VllmConfig.model_validate(yaml.safe_load(Path(path).read_text()) or {})


def main() -> int:
    if sys.argv[1] == "--config-dir":
        from pkgd.config.compose import ComposeRequest, compose
        from pkgd.config.sources import ConfigSources

        request = ComposeRequest(config_dir=sys.argv[2])
        config = compose(request).config
        log.configure(config.logging, role="supervisor")
        return Supervisor(
            config,
            lambda: compose(request).config,
            entrypoints=ENTRYPOINTS,
            sources=ConfigSources.of(request),
            preflight=preflight,
        ).run()
    path = sys.argv[1]
    config = load(path)
    log.configure(config.logging, role="supervisor")
    return Supervisor(config, lambda: load(path), entrypoints=ENTRYPOINTS, preflight=preflight).run()


if __name__ == "__main__":
    sys.exit(main())
