"""``pkgd collect-env``: what a bug report needs about this host and this configuration
(vLLM's ``vllm collect-env``).

Versions (pkgd, Python, torch and its CUDA build, Triton, the serving libraries), the OS, the
CPU (model, cores this process may use, the feature flags the kernels choose by: AVX2,
AVX-512, its BF16/VNNI extensions, AMX), memory, GPUs, the kernels the engine would use here
(the C kernels for CPU decode, loaded or why not; Triton on CUDA; the dtype ``model.dtype`` resolves
to) and the composed configuration: its digest, the group options chosen and which keys are
set by which layer. No value of the configuration is printed (API keys stay private), nor
any environment variable's value except the few that change the engine's behaviour.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

from pkgd.cli.base import CLISubcommand

DESCRIPTION = """\
What a bug report needs about this host and this configuration (as vllm collect-env): versions
of pkgd, Python, torch (and its CUDA build), Triton and the serving libraries; the OS; the CPU
(model, usable cores, AVX2 / AVX-512 / BF16 / VNNI / AMX); memory and huge pages; GPUs; the
kernels the engine would use here and the dtype auto resolves to; and the composed
configuration's digest, chosen group options and which keys each layer set. No configuration
value is printed (API keys stay private)."""

LIBRARIES = (
    "pkgd",
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "gguf",
    "numpy",
    "fastapi",
    "starlette",
    "hypercorn",
    "pydantic",
    "hydra-core",
    "pyzmq",
    "msgspec",
    "prometheus_client",
    "xgrammar",
    "openai",
)
X86_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
ARM_FLAGS = ("asimd", "sve", "bf16", "i8mm")
ENV_SHOWN = (
    "THP_MEM_ALLOC_ENABLE",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "TRITON_INTERPRET",
    "CC",
    "PROMETHEUS_MULTIPROC_DIR",
)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Processor"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("MemTotal", "MemAvailable", "HugePages_Total", "AnonHugePages"):
                    out[key] = int(value.split()[0]) * (1024 if "kB" in value else 1)
    except OSError:
        pass
    return out


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def host_report() -> dict[str, Any]:
    """Versions, OS, CPU and memory (no torch import)."""
    from pkgd import host
    from pkgd.runner.loader.dtype import cpu_flags

    flags = cpu_flags()
    mem = _meminfo()
    return {
        "versions": {"python": sys.version.split()[0], **{lib: _version(lib) for lib in LIBRARIES}},
        "os": (
            f"{platform.system()} {platform.release()} ({platform.machine()}), "
            f"{platform.libc_ver()[0]} {platform.libc_ver()[1]}"
        ).strip(),
        "cpu": {
            "model": _cpu_model(),
            "logical_cpus": os.cpu_count(),
            "cores_available": host.available_cores(),
            "flags": {f: f in flags for f in (ARM_FLAGS if platform.machine() in ("aarch64", "arm64") else X86_FLAGS)},
        },
        "memory": {
            "total_bytes": mem.get("MemTotal"),
            "available_bytes": mem.get("MemAvailable"),
            "transparent_hugepages": _thp(),
        },
        "environment": {k: os.environ[k] for k in ENV_SHOWN if k in os.environ},
    }


def kernels_report(config: Any) -> dict[str, Any]:
    """torch, CUDA, the kernels and the dtype the engine would run with under ``config``."""
    import torch

    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "torch_threads": torch.get_num_threads(),
    }
    if cuda:
        out["gpus"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
            }
            for i in range(torch.cuda.device_count())
        ]
    device = config.parallel.device
    device = ("cuda" if cuda else "cpu") if device == "auto" else device
    out["engine_device"] = device
    out["dtype"] = _dtype_report(config, device)
    if device == "cuda":
        out["kernels"] = "Triton kernels (pkgd_kernels: paged attention, RMSNorm, rotary, SiLU-and-mul, sampling)"
    else:
        out["kernels"] = _cpu_kernels()
    return out


def _dtype_report(config: Any, device: str) -> dict[str, Any]:
    """What ``model.dtype`` resolves to for the configured model on this host, and why
    (`pkgd.runner.loader.dtype.DtypeChoice`): the same choice, and on CPU the same bf16
    measurement, the engine makes at start-up. Needs the model's config.json (a GGUF is
    converted once, as at start-up); a model that does not resolve gives its error instead."""
    from pkgd.model_files.errors import ModelSourceError
    from pkgd.model_files.resolve import default_cache_dir, resolve_model
    from pkgd.runner.loader.dtype import MeasurementCache, choose_dtype, probe_cpu_dtype
    from pkgd.runner.models.config import load_arch_config

    try:
        arch = load_arch_config(resolve_model(config.model).model_dir)
    except (ModelSourceError, OSError, ValueError) as exc:
        return {"requested": config.model.dtype, "error": f"the model does not resolve: {exc}"}
    if device == "cuda":
        return choose_dtype(config.model.dtype, arch.checkpoint_dtype, "cuda").as_dict()
    kernels = None
    try:
        from pkgd_kernels.cpu import CpuKernelsUnavailable, load

        kernels = load() if config.parallel.cpu_kernels else None
    except (ImportError, CpuKernelsUnavailable):
        pass
    cache = MeasurementCache(default_cache_dir(config.model.cache_dir) / "dtype-choice")
    return probe_cpu_dtype(arch, config.parallel.tp, kernels, requested=config.model.dtype, cache=cache).as_dict()


def _cpu_kernels() -> str:
    try:
        from pkgd_kernels.cpu import CpuKernelsUnavailable, load
    except ImportError as exc:
        return f"PyTorch ops (pkgd_kernels.cpu cannot be imported: {exc})"
    try:
        kernels = load()
    except CpuKernelsUnavailable as exc:
        return f"PyTorch ops (the C kernels are unavailable: {exc})"
    return (
        f"C kernels for CPU decode (matvec, paged decode attention, RMSNorm, one-call decode) from {kernels.path}; "
        "PyTorch ops for prefill"
    )


def config_report(composed: Any) -> dict[str, Any]:
    """The composed configuration without its values: digest, group options, keys per layer."""
    set_by: dict[str, list[str]] = {}
    for key, layer in composed.sources.items():
        if layer != "default":
            set_by.setdefault(layer, []).append(key)
    return {
        "digest": composed.config.digest(),
        "groups": composed.choices,
        "system_dir": composed.system_dir,
        "serve_mode": composed.plan.mode,
        "keys_set_by_layer": set_by,
    }


def _lines(report: dict[str, Any], indent: str = "") -> list[str]:
    lines = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines += _lines(value, indent + "  ")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            lines.append(f"{indent}{key}:")
            for item in value:
                lines.append(f"{indent}  - " + ", ".join(f"{k}: {v}" for k, v in item.items()))
        elif isinstance(value, list):
            lines.append(f"{indent}{key}: {', '.join(map(str, value)) or '-'}")
        else:
            lines.append(f"{indent}{key}: {value}")
    return lines


class CollectEnvSubcommand(CLISubcommand):
    name = "collect-env"
    help = "print the versions, hardware, kernels and configuration digest a bug report needs"

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=DESCRIPTION)
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        return parser

    def cmd(self, args: argparse.Namespace) -> int:
        from pkgd.config.compose import compose

        composed = compose(args.compose_request)  # an invalid configuration exits 2 (ConfigError)
        report = {"host": host_report(), "engine": kernels_report(composed.config), "config": config_report(composed)}
        if args.json:
            print(json.dumps(report, indent=2, default=str))
        else:
            print("\n".join(_lines(report)))
        return 0


def cmd_init() -> list[CLISubcommand]:
    return [CollectEnvSubcommand()]
