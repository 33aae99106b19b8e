"""Checks of a validated config against this host, made before any child starts.

`pkgd config validate` checks a tree anywhere (a GitOps runner has neither the model files nor
the GPU), so what depends on the serving host is checked here, at ``pkgd serve``: a mistake an
operator must fix is exit 2 at once (systemd's ``RestartPreventExitStatus=2`` then stops
retrying), not an engine loaded for seconds and a failure with exit 1 that systemd restarts.
"""

from __future__ import annotations

import importlib.metadata

from pkgd.config.vllm_config import VllmConfig
from pkgd.frontend.tokenizer import TokenizerError, resolve_chat_template


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
    return problems


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_is_cpu_build() -> bool:
    """Whether torch's wheel is a CPU-only build (PyTorch tags those ``+cpu``)."""
    return _torch_version().endswith("+cpu")
