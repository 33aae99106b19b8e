"""Tensor parallelism over worker processes: `TPExecutor` (rank 0, in the caller's process)
and the worker loop (ranks 1..tp-1, `python -m pkgd.runner.tp_worker`).

Every rank holds a `ModelRunner` with its shard of the weights (`pkgd.runner.layers`) and runs
every step; the layers' collectives (all-reduce after row-parallel layers, all-gather of the
vocabulary-parallel logits) go through ``torch.distributed`` (gloo on CPU, NCCL on CUDA). Each
step rank 0 broadcasts the step itself as a msgpack frame carried in a uint8 tensor (length
first, then the bytes) over the same process group, so no second channel exists and nothing is
pickled. All ranks sample the same tokens (identical gathered logits and generators); rank 0's
`ModelRunnerOutput` is the answer.

Workers are spawned with `subprocess` and get their start-up spec as one JSON line on stdin;
they die with their parent (``PR_SET_PDEATHSIG``) and a worker that fails to start makes rank
0's rendezvous or first broadcast fail instead of hang (gloo notices the closed connection;
``TP_TIMEOUT`` bounds the rest).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from pkgd.config.vllm_config import VllmConfig
from pkgd.lora_request import LoRARequest
from pkgd.model_files.resolve import ModelFiles
from pkgd.runner.model_runner import ModelRunner
from pkgd.runner.models.config import load_arch_config
from pkgd.runner.models.llama import check_tp_size
from pkgd.runner_output import ModelRunnerOutput
from pkgd.scheduler_output import SchedulerOutput

TP_TIMEOUT = datetime.timedelta(seconds=300)


class InitKVCache(msgspec.Struct, tag="init_kv"):
    num_blocks: int
    block_size: int


class ExecuteStep(msgspec.Struct, tag="step"):
    scheduler_output: SchedulerOutput


class ShutdownWorkers(msgspec.Struct, tag="shutdown"):
    pass


class Sleep(msgspec.Struct, tag="sleep"):
    level: int


class WakeUp(msgspec.Struct, tag="wake_up"):
    tags: list[str]


class AddLoRA(msgspec.Struct, tag="add_lora"):
    request: LoRARequest


class RemoveLoRA(msgspec.Struct, tag="remove_lora"):
    lora_int_id: int


TPFrame = InitKVCache | ExecuteStep | ShutdownWorkers | Sleep | WakeUp | AddLoRA | RemoveLoRA
_decoder = msgspec.msgpack.Decoder(TPFrame)
_encoder = msgspec.msgpack.Encoder()


def broadcast_frame(frame: TPFrame | None) -> TPFrame:
    """Rank 0 passes a frame, other ranks None; every rank returns the frame."""
    if frame is not None:
        payload = torch.frombuffer(bytearray(_encoder.encode(frame)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    if frame is None:
        payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0)
    return frame if frame is not None else _decoder.decode(payload.numpy().tobytes())


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TPExecutor:
    """A `ModelRunner` look-alike spanning ``config.parallel.tp`` ranks.

    ``threads`` is each rank's torch thread count (the process owner's choice for rank 0 is
    left alone). Call `shutdown` when done (also on errors): it stops the workers and
    destroys the process group.

    Raises (constructor): `RuntimeError` when a worker fails to start, plus whatever
    `ModelRunner` raises for rank 0.
    """

    def __init__(
        self, config: VllmConfig, model_files: ModelFiles, *, threads: int = 1, device: torch.device | None = None
    ) -> None:
        p = config.parallel
        self.world_size = p.tp
        check_tp_size(load_arch_config(model_files.model_dir), p.tp, p.enable_expert_parallel)  # fail before spawning
        port = p.master_port or free_port(p.master_addr)
        spec: dict[str, Any] = {
            "config": config.to_json_dict(reveal_secrets=True),
            "model_files": {k: str(v) if v is not None else None for k, v in vars(model_files).items()},
            "world_size": self.world_size,
            "init_method": f"tcp://{p.master_addr}:{port}",
            "threads": threads,
            "device": str(device) if device else None,
        }
        self.workers: list[subprocess.Popen] = []
        for rank in range(1, self.world_size):
            proc = subprocess.Popen([sys.executable, "-m", "pkgd.runner.tp_worker"], stdin=subprocess.PIPE, text=True)
            assert proc.stdin is not None  # stdin=PIPE
            proc.stdin.write(json.dumps({**spec, "rank": rank}) + "\n")
            proc.stdin.flush()
            self.workers.append(proc)
        try:
            backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
            if p.backend != "auto":
                backend = p.backend
            dist.init_process_group(
                backend, init_method=spec["init_method"], rank=0, world_size=self.world_size, timeout=TP_TIMEOUT
            )
            self.runner = ModelRunner(config, model_files, device=device, rank=0, world_size=self.world_size)
            dist.barrier()  # every rank loaded
        except BaseException:
            self.shutdown()
            raise
        self.model_info = self.runner.model_info

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Per rank (each rank holds its share of the KV heads)."""
        return self.runner.kv_cache_bytes_per_block(block_size)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        broadcast_frame(InitKVCache(num_blocks, block_size))
        self.runner.initialize_kv_cache(num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        broadcast_frame(ExecuteStep(scheduler_output))
        return self.runner.execute_model(scheduler_output)

    def sleep(self, level: int) -> None:
        broadcast_frame(Sleep(level))
        self.runner.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        broadcast_frame(WakeUp(list(tags)))
        self.runner.wake_up(tags)

    def add_lora(self, request: LoRARequest) -> bool:
        """Rank 0 checks the adapter first (a bad one goes no further), then every rank loads
        its shard of it."""
        self.runner.add_lora(request)
        broadcast_frame(AddLoRA(request))
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        broadcast_frame(RemoveLoRA(lora_int_id))
        return self.runner.remove_lora(lora_int_id)

    def shutdown(self) -> None:
        if dist.is_initialized():
            try:
                broadcast_frame(ShutdownWorkers())
            except Exception:  # noqa: BLE001 - a dead worker: still tear down
                pass
        for proc in self.workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main() -> None:
    """Entry of ``python -m pkgd.runner.tp_worker``: one JSON spec line on stdin."""
    _die_with_parent()
    spec = json.loads(sys.stdin.readline())
    torch.set_num_threads(spec["threads"])
    config = VllmConfig.model_validate(spec["config"])
    mf = spec["model_files"]
    files = ModelFiles(
        source=mf["source"],
        model_dir=Path(mf["model_dir"]),
        name=mf["name"],
        tokenizer_dir=Path(mf["tokenizer_dir"]),
        gguf_path=Path(mf["gguf_path"]) if mf.get("gguf_path") else None,
    )
    device = torch.device(spec["device"]) if spec["device"] else None
    rank, world = spec["rank"], spec["world_size"]
    backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    if config.parallel.backend != "auto":
        backend = config.parallel.backend
    dist.init_process_group(backend, init_method=spec["init_method"], rank=rank, world_size=world, timeout=TP_TIMEOUT)
    runner = ModelRunner(config, files, device=device, rank=rank, world_size=world)
    dist.barrier()
    while True:
        frame = broadcast_frame(None)
        if isinstance(frame, ShutdownWorkers):
            break
        if isinstance(frame, InitKVCache):
            runner.initialize_kv_cache(frame.num_blocks, frame.block_size)
        elif isinstance(frame, Sleep):
            runner.sleep(frame.level)
        elif isinstance(frame, WakeUp):
            runner.wake_up(frame.tags)
        elif isinstance(frame, AddLoRA):
            runner.add_lora(frame.request)
        elif isinstance(frame, RemoveLoRA):
            runner.remove_lora(frame.lora_int_id)
        else:
            runner.execute_model(frame.scheduler_output)
    dist.destroy_process_group()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() == 1:  # the parent already died before prctl took effect
        os._exit(1)
