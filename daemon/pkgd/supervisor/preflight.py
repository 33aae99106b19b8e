"""Checks of a validated config against this host, made before any child starts.

`pkgd config validate` checks a tree anywhere (a GitOps runner has neither the model files nor
the GPU nor the serving host's memory), so what depends on the serving host is checked here, at
``pkgd serve`` (and by ``pkgd config validate --check-host`` on the serving host): a mistake an
operator must fix is exit 2 at once (systemd's ``RestartPreventExitStatus=2`` then stops
retrying), not an engine loaded for seconds and a failure with exit 1 that systemd restarts.
"""

from __future__ import annotations

import importlib.metadata
import os

from pkgd import host
from pkgd.config.vllm_config import VllmConfig
from pkgd.frontend.tokenizer import TokenizerError, resolve_chat_template
from pkgd.model_files.resolve import model_source_problems


def serve_problems(config: VllmConfig) -> list[str]:
    """Everything ``pkgd serve`` refuses a tree for on this host: a ``model.source`` /
    ``model.tokenizer`` that names nothing here, then `host_problems`. Run by the supervisor
    before it starts and before a reload starts a new generation."""
    return model_source_problems(config.model) + lora_module_problems(config) + host_problems(config)


def lora_module_problems(config: VllmConfig) -> list[str]:
    """A ``lora.lora_modules`` entry whose directory holds no PEFT adapter: found here, before the
    engine spends its load on it (the engine checks the adapter's contents when it loads it)."""
    problems = []
    for i, module in enumerate(config.lora.lora_modules):
        if not os.path.isfile(os.path.join(os.path.expanduser(module.path), "adapter_config.json")):
            problems.append(
                f"lora.lora_modules.{i} ({module.name}): {module.path} holds no adapter_config.json "
                "(a PEFT LoRA adapter directory is needed)"
            )
    return problems


def host_problems(config: VllmConfig) -> list[str]:
    """One line per setting this host cannot serve (empty when none). Reads files the config
    names; never imports torch (the supervisor stays light)."""
    problems = []
    if config.model.chat_template is not None:
        try:
            resolve_chat_template(config.model.chat_template)
        except TokenizerError as exc:
            problems.append(str(exc))
    if config.parallel.device == "cuda" and _torch_is_cpu_build():
        problems.append(
            "parallel.device: cuda, but the installed torch is a CPU-only build "
            f"({_torch_version()}); use parallel.device=cpu or auto, or install a CUDA build of torch"
        )
    if problem := kv_cache_memory_problem(config, host.mem_total_bytes(), host.mem_available_bytes()):
        problems.append(problem)
    return problems


def kv_cache_memory_problem(config: VllmConfig, total: int | None, available: int | None) -> str | None:
    """Why ``cache.kv_cache_memory_bytes`` cannot fit in this host's memory (``total``, MemTotal;
    ``available``, MemAvailable, is only reported), or None.

    Each engine worker of this node (``parallel.dp_local`` engine cores x ``parallel.tp``
    ranks) allocates the whole budget in host memory when it runs on the CPU. The budget alone,
    before any weights, is compared with all of the host's memory, not with what is available
    now: that refuses only a size no start could ever serve (a typo, a config for a bigger
    server), never one that memory other processes hold at the moment rules out; the engine core
    checks that against MemAvailable once its weights are loaded.
    """
    budget = config.cache.kv_cache_memory_bytes
    if budget is None or config.cache.num_blocks is not None or total is None or not _kv_cache_on_cpu(config):
        return None
    workers = config.serve_plan().dp_local * config.parallel.tp
    need = budget * workers
    if need <= total:
        return None
    each = (
        f" x {workers} engine workers on this node (parallel.dp_local x parallel.tp) = {_gib(need)}"
        if workers > 1
        else ""
    )
    now = f", {_gib(available)} available now" if available is not None else ""
    return (
        f"cache.kv_cache_memory_bytes: {_gib(budget)} of KV cache{each} is more than this host's {_gib(total)} of "
        f"memory (MemTotal{now}), before any weights are loaded; lower cache.kv_cache_memory_bytes"
    )


def _kv_cache_on_cpu(config: VllmConfig) -> bool:
    """Whether the engine cores will keep their KV cache in host memory: ``parallel.device``
    cpu, or auto on a host without a CUDA driver or with a CPU-only torch (auto picks cuda
    only where torch sees a GPU; the supervisor never imports torch to ask)."""
    device = config.parallel.device
    return device == "cpu" or (device == "auto" and (_torch_is_cpu_build() or not os.path.exists("/dev/nvidiactl")))


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_is_cpu_build() -> bool:
    """Whether torch's wheel is a CPU-only build (PyTorch tags those ``+cpu``)."""
    return _torch_version().endswith("+cpu")
