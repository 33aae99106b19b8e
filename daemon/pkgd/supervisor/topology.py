"""Which children a config asks for, with their command lines (pure: nothing is started).

Every child gets ``--parent-pid`` (the supervisor's pid): it sets ``PR_SET_PDEATHSIG`` and then
exits at once if its parent is already gone, closing the window in which the supervisor could
die before the child asked to die with it.

The serve plan (`VllmConfig.serve_plan`, vLLM's ``ServeSubcommand.cmd`` modes) decides the
counts; this module wires them together:

* engine cores: one per local DP rank (``dp_start_rank`` … ``+ dp_local``). On one node they
  listen on ``ipc://RUNTIME_DIR/engine-<generation>-<rank>.sock``; headless cores listen on
  ``tcp://dp_address:dp_rpc_port + rank`` so another pkgd's API servers reach them.
* API servers: ``single``/``multi_api`` — every server on the shared listener, talking to every
  local engine core plus ``parallel.remote_engines``; ``hybrid_lb`` — the same over the
  node-local cores only; ``external_lb`` — ``api_server_count`` servers per local DP rank, on
  that rank's listener (``port + rank``), talking to that rank's core only; ``headless`` — none.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping

from pkgd.config.vllm_config import ServePlan, VllmConfig
from pkgd.supervisor.children import ChildSpec
from pkgd.supervisor.notify import SYSTEMD_ONLY_ENV
from pkgd.supervisor.runtime import RuntimeDir
from pkgd.supervisor.sockets import Listener


@dataclasses.dataclass(frozen=True)
class Entrypoints:
    """Command prefixes of the two child programs (tests substitute their own)."""

    engine_core: tuple[str, ...] = (sys.executable, "-m", "pkgd.engine.core_proc")
    api_server: tuple[str, ...] = (sys.executable, "-m", "pkgd.api.server")


def child_env(environ: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The supervisor's environment minus systemd's main-process variables, plus ``extra``."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in SYSTEMD_ONLY_ENV}
    env.update(extra)
    return env


def local_ranks(plan: ServePlan) -> range:
    return range(plan.dp_start_rank, plan.dp_start_rank + plan.dp_local)


def engine_address(config: VllmConfig, plan: ServePlan, runtime: RuntimeDir, generation: int, rank: int) -> str:
    """The ZeroMQ address engine core ``rank`` binds (see module docstring)."""
    if plan.mode == "headless":
        return f"tcp://{config.parallel.dp_address}:{config.parallel.dp_rpc_port + rank}"
    return runtime.engine_ipc_address(generation, rank)


def engine_specs(
    config: VllmConfig,
    plan: ServePlan,
    runtime: RuntimeDir,
    generation: int,
    entry: Entrypoints,
    env: Mapping[str, str],
) -> list[ChildSpec]:
    """One engine core per local DP rank."""
    specs = []
    for rank in local_ranks(plan):
        address = engine_address(config, plan, runtime, generation, rank)
        argv = (
            *entry.engine_core,
            "--engine-index", str(rank),
            "--address", address,
            "--parent-pid", str(os.getpid()),
        )  # fmt: skip
        specs.append(ChildSpec("engine-core", rank, generation, argv, env, (), address))
    return specs


def api_specs(
    config: VllmConfig,
    plan: ServePlan,
    runtime: RuntimeDir,
    listeners: list[Listener],
    engines: Mapping[int, str],
    generation: int,
    entry: Entrypoints,
    env: Mapping[str, str],
) -> list[ChildSpec]:
    """The API servers; ``engines`` maps each local DP rank to its engine core's address."""
    if plan.api_server_count == 0:
        return []
    if plan.mode == "external_lb":
        groups = [(listener, [engines[listener.spec.rank]]) for listener in listeners if listener.spec.rank is not None]
    elif plan.mode == "hybrid_lb":
        groups = [(listeners[0], list(engines.values()))]
    else:
        groups = [(listeners[0], [*engines.values(), *config.parallel.remote_engines])]
    specs: list[ChildSpec] = []
    for listener, addresses in groups:
        for _ in range(plan.api_server_count):
            index = len(specs)
            argv = [
                *entry.api_server,
                "--listen-fd", str(listener.fileno()),
                "--server-index", str(index),
                "--parent-pid", str(os.getpid()),
            ]  # fmt: skip
            for address in addresses:
                argv += ["--engine-address", address]
            specs.append(
                ChildSpec("api-server", index, generation, tuple(argv), env, (listener.fileno(),), listener.url)
            )
    return specs
