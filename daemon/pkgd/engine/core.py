"""`EngineCore`: the model, the KV cache and the scheduler behind one synchronous `step()`.

vLLM v1's ``EngineCore`` without the process around it: the engine-core process
(``engine/core_proc.py``) runs ``receive → step() → send`` around this object, and the offline
`LLM` calls it in-process. One step is ``Scheduler.schedule()`` → ``ModelRunner.execute_model()``
→ ``Scheduler.update_from_output()``.

Start-up: the model is loaded through the runner (``pkgd.runner``), the KV cache is sized
from ``cache.num_blocks``, else ``cache.kv_cache_memory_bytes`` (default 448 MiB on CPU, 90 %
of free device memory on CUDA) ÷ the runner's bytes per block, and must hold at least one
``max_model_len`` sequence.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from pkgd.config.vllm_config import VllmConfig
from pkgd.engine.kv_cache_manager import KVCacheManager
from pkgd.engine.request import Request
from pkgd.engine.scheduler import Scheduler
from pkgd.engine.scheduler_output import SchedulerOutput
from pkgd.ipc.messages import PROTOCOL_VERSION, EngineCoreOutput, EngineCoreRequest, SchedulerStats
from pkgd.runner.output import ModelRunnerOutput

# 448 MiB: SmolLM2's float32 engine stays under 1.5 GB resident (issue 3's target) while a
# 256 x (128 -> 128) batch keeps ~40 sequences' context (637 blocks of 16 tokens).
DEFAULT_CPU_KV_CACHE_BYTES = 448 * 1024 * 1024
CUDA_FREE_MEMORY_FRACTION = 0.9


class ModelRunnerLike(Protocol):
    """What `EngineCore` needs of ``pkgd.runner.model_runner.ModelRunner``.

    ``model_info`` has ``max_model_len`` (effective, tokens), ``vocab_size`` and
    ``eos_token_id`` (None when the model has none).
    """

    model_info: Any

    def kv_cache_bytes_per_block(self, block_size: int) -> int: ...

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


# (config) -> (ModelFiles with .name and .model_dir, a loaded runner)
RunnerFactory = Callable[[VllmConfig], "tuple[Any, ModelRunnerLike]"]


def default_cpu_threads(config: VllmConfig) -> int:
    """Torch threads per engine worker (tensor-parallel rank): ``parallel.cpu_threads``, else
    the cores left after reserving one for the API servers (vLLM's CPU build does the same),
    shared among the ``parallel.tp`` ranks, at least 1."""
    if config.parallel.cpu_threads is not None:
        return config.parallel.cpu_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, (cores - 1) // config.parallel.tp)


def load_model_runner(config: VllmConfig) -> tuple[Any, ModelRunnerLike]:
    """Resolve ``model.source`` and load it (imports torch): a `ModelRunner`, or with
    ``parallel.tp > 1`` a `TPExecutor` whose worker processes hold the other ranks.

    Sets torch's intra-op thread count first (`default_cpu_threads`): the runner leaves
    threads to the process owner, and loading already runs on them.
    """
    import torch

    from pkgd.runner.loader.resolve import resolve_model
    from pkgd.runner.model_runner import ModelRunner, resolve_device

    threads = default_cpu_threads(config)
    torch.set_num_threads(threads)
    model_files = resolve_model(config.model)
    if config.parallel.tp > 1:
        from pkgd.runner.tp_executor import TPExecutor

        device = resolve_device(config.parallel.device)
        return model_files, TPExecutor(config, model_files, threads=threads, device=device)
    return model_files, ModelRunner(config, model_files)


def determine_num_kv_blocks(config: VllmConfig, bytes_per_block: int, *, free_device_bytes: int | None = None) -> int:
    """KV blocks for this engine: ``cache.num_blocks`` when set, else the memory budget ÷
    ``bytes_per_block``.

    The budget is ``cache.kv_cache_memory_bytes`` when set, else 90 % of
    ``free_device_bytes`` (CUDA, measured after the weights are loaded) or 448 MiB (CPU).
    Raises `ValueError` when the budget holds no block.
    """
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    if bytes_per_block <= 0:
        raise ValueError(f"the runner reports {bytes_per_block} bytes per KV block")
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif free_device_bytes is not None:
        budget = int(free_device_bytes * CUDA_FREE_MEMORY_FRACTION)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"cache.kv_cache_memory_bytes: {budget} bytes hold no KV block of {bytes_per_block} bytes "
            f"(block_size {cache.block_size}); raise it or lower cache.block_size"
        )
    return num_blocks


def mem_available_bytes() -> int | None:
    """Linux's estimate of memory available to new allocations without swapping
    (``MemAvailable`` in /proc/meminfo), or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_host_memory(runner: Any, kv_bytes: int) -> None:
    """Refuse a host-memory (CPU) KV cache larger than the memory available now, rather than
    let its zeroing drive the machine out of memory (and systemd restart it into the same).

    Raises:
        ValueError: ``kv_bytes`` exceeds ``MemAvailable``.
    """
    device = getattr(runner, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        return
    available = mem_available_bytes()
    if available is not None and kv_bytes > available:
        raise ValueError(
            f"the KV cache needs {kv_bytes / 2**30:.2f} GiB of memory but only {available / 2**30:.2f} GiB is "
            "available (MemAvailable); lower cache.kv_cache_memory_bytes or cache.num_blocks"
        )


class EngineCore:
    """One engine: loaded model, paged KV cache, scheduler.

    Args:
        config: the validated tree (``model``, ``cache``, ``scheduler``, ``parallel``).
        engine_index: data-parallel rank, reported in the handshake and outputs.
        runner_factory: loads the model; default `load_model_runner`. Tests pass a fake.

    Raises:
        ValueError: ``model.max_model_len`` is above the model's own limit (refused, as vLLM
            refuses it: positions past the trained range give garbage), the KV cache cannot
            hold one ``max_model_len`` sequence, or (on CPU) needs more memory than is available.
        Whatever the runner raises for a missing or unsupported model.
    """

    def __init__(self, config: VllmConfig, *, engine_index: int = 0, runner_factory: RunnerFactory | None = None) -> None:
        self.config = config
        self.engine_index = engine_index
        self.model_files, self.model_runner = (runner_factory or load_model_runner)(config)
        info = self.model_runner.model_info
        configured = config.model.max_model_len
        if configured is not None and configured > info.max_model_len:
            raise ValueError(
                f"model.max_model_len {configured} is greater than the model's limit of {info.max_model_len} "
                "tokens (max_position_embeddings in its config); lower model.max_model_len or leave it null"
            )
        self.max_model_len: int = info.max_model_len
        self.vocab_size: int = info.vocab_size
        self.eos_token_id: int | None = info.eos_token_id
        self.model_name = config.model.name or getattr(self.model_files, "name", None) or config.model.source
        self.block_size = config.cache.block_size
        bytes_per_block = self.model_runner.kv_cache_bytes_per_block(self.block_size)
        self.num_kv_blocks = determine_num_kv_blocks(
            config, bytes_per_block, free_device_bytes=_free_cuda_bytes(self.model_runner)
        )
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_kv_blocks * self.block_size} tokens "
                f"({self.num_kv_blocks} blocks of {self.block_size}), less than one sequence of "
                f"max_model_len {self.max_model_len}; lower model.max_model_len or raise "
                "cache.num_blocks / cache.kv_cache_memory_bytes"
            )
        _check_host_memory(self.model_runner, bytes_per_block * self.num_kv_blocks)
        self.model_runner.initialize_kv_cache(self.num_kv_blocks, self.block_size)
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, self.block_size, enable_caching=config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, max_model_len=self.max_model_len)
        self.kv_cache_bytes = bytes_per_block * self.num_kv_blocks

    # ---- requests -------------------------------------------------------------------------

    def validate_request(self, request: EngineCoreRequest) -> None:
        """Raise `ValueError` (changing nothing) for a request that can never run."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")
        request.sampling_params.verify(max_logprobs=self.vocab_size, vocab_size=self.vocab_size)
        max_tokens = request.sampling_params.max_tokens
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, which leaves no room to generate within "
                f"max_model_len {self.max_model_len}"
            )
        if max_tokens is not None and len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: "
                f"{len(prompt) + max_tokens} exceeds max_model_len {self.max_model_len}"
            )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a tokenized request; raises `ValueError` (changing nothing) when it can never
        run: empty prompt, token ids outside the vocabulary, prompt + max_tokens beyond
        ``max_model_len``, invalid sampling parameters, or an id already live."""
        self.validate_request(request)
        req = Request.from_engine_core_request(request, max_model_len=self.max_model_len)
        if req.arrival_time == 0.0:
            req.arrival_time = time.time()
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End these requests now and free their blocks; unknown ids are ignored. No output
        is produced for them (the frontend ends its side itself)."""
        self.scheduler.finish_requests(request_ids)

    # ---- stepping ---------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Run one schedule → execute → update step; returns the outputs of requests that got
        tokens (finished ones carry ``finish_reason``). Empty when there is nothing to do."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Nothing fits (cannot happen while the cache holds a max_model_len sequence);
            # keep the finished ids for the next step the runner sees.
            self.scheduler.finished_req_ids |= scheduler_output.finished_req_ids
            return []
        runner_output = self.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def stats(self) -> SchedulerStats:
        """Running/waiting counts, KV usage and cumulative prefix-cache and preemption counters."""
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes; False while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def handshake_info(self) -> dict[str, Any]:
        """The fields of ``ipc.messages.Handshake`` for this engine."""
        return {
            "version": PROTOCOL_VERSION,
            "engine_index": self.engine_index,
            "pid": os.getpid(),
            "model_name": self.model_name,
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
        }

    def shutdown(self) -> None:
        """Abort everything and release the runner (idempotent)."""
        self.scheduler.finish_requests(list(self.scheduler.requests))
        close = getattr(self.model_runner, "shutdown", None)
        if close is not None:
            close()


def _free_cuda_bytes(runner: ModelRunnerLike) -> int | None:
    device = getattr(runner, "device", None)
    if device is None or getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return free


__all__ = ["EngineCore", "ModelRunnerLike", "RunnerFactory", "default_cpu_threads", "determine_num_kv_blocks", "load_model_runner"]
