"""`EngineCore`: the model, the KV cache and the scheduler behind one synchronous `step()`.

vLLM v1's ``EngineCore`` without the process around it: the engine-core process
(``engine/core_proc.py``) runs ``receive → step() → send`` around this object, and the offline
`LLM` calls it in-process. One step is ``Scheduler.schedule()`` → ``ModelRunner.execute_model()``
→ ``Scheduler.update_from_output()``.

Start-up: the model is loaded through the runner (``pkgd.runner``), the KV cache is sized
from ``cache.num_blocks``, else ``cache.kv_cache_memory_bytes`` (default on CPU: 4 GiB or half
the memory available after the weights load, whichever is less, shared by the node's engine
workers; on CUDA what ``cache.gpu_memory_utilization`` of the device leaves after loading) ÷
the runner's bytes per block, and must hold at least one ``max_model_len`` sequence.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from pkgd import host
from pkgd.config.errors import ModelConfigMismatch
from pkgd.config.vllm_config import VllmConfig
from pkgd.engine.errors import EngineBusyError, EngineSleepingError
from pkgd.engine.kv_cache_manager import KVCacheManager
from pkgd.engine.lora import LoRARegistry
from pkgd.engine.request import Request
from pkgd.engine.scheduler import Scheduler
from pkgd.engine.spec_decode import Speculator
from pkgd.engine.structured_output import StructuredOutputManager
from pkgd.engine.threads import ThreadGovernor
from pkgd.ipc.messages import PROTOCOL_VERSION, EngineCoreOutput, EngineCoreRequest, SchedulerStats
from pkgd.runner_output import ModelRunnerOutput
from pkgd.scheduler_output import SchedulerOutput

# The CPU default budget: vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE, 4 GiB), capped at this
# share of MemAvailable. The CPU cache is resident only where blocks are written and the block
# pool reuses warm blocks first, so the budget bounds the worst case (a full cache must still
# fit next to everything else) while memory follows the blocks the workload holds at once.
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
CPU_AVAILABLE_MEMORY_FRACTION = 0.5
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

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str]) -> None: ...


SLEEP_TAGS = ("weights", "kv_cache")


# (config) -> (ModelFiles with .name and .model_dir, a loaded runner)
RunnerFactory = Callable[[VllmConfig], "tuple[Any, ModelRunnerLike]"]


def engine_workers_on_node(config: VllmConfig) -> int:
    """Engine processes on this node that compute: local engine cores x tensor-parallel ranks."""
    p = config.parallel
    engines = p.dp_local if p.dp_local else max(1, -(-p.dp // p.nnodes))
    return engines * p.tp


def default_cpu_threads(config: VllmConfig) -> int:
    """Torch threads per engine worker (tensor-parallel rank): ``parallel.cpu_threads``, else
    every core this process may use, shared among the node's workers (`engine_workers_on_node`),
    at least 1.

    No core is held back for the API servers, as vLLM's CPU build binds its worker to every
    core when it runs one (``VLLM_CPU_NUM_OF_RESERVED_CPU`` unset): an API process needs a few
    percent of a core, which the OS scheduler gives it between the engine's threads, while a
    reserved core would mostly idle (the measurement is in the README, "Memory and speed on a
    CPU")."""
    if config.parallel.cpu_threads is not None:
        return config.parallel.cpu_threads
    return max(1, host.available_cores() // engine_workers_on_node(config))


def load_model_runner(config: VllmConfig) -> tuple[Any, ModelRunnerLike]:
    """Resolve ``model.source`` and load it (imports torch): a `ModelRunner`, or with
    ``parallel.tp > 1`` a `TPExecutor` whose worker processes hold the other ranks.

    Sets torch's intra-op thread count first (`default_cpu_threads`): the runner leaves
    threads to the process owner, and loading already runs on them.
    """
    import torch

    from pkgd.model_files.resolve import resolve_model
    from pkgd.runner.model_runner import ModelRunner, resolve_device

    threads = default_cpu_threads(config)
    torch.set_num_threads(threads)
    model_files = resolve_model(config.model)
    if config.parallel.tp > 1:
        from pkgd.runner.tp_executor import TPExecutor

        device = resolve_device(config.parallel.device)
        return model_files, TPExecutor(config, model_files, threads=threads, device=device)
    return model_files, ModelRunner(config, model_files)


def load_draft_model(config: VllmConfig, target: Any) -> Any:
    """The draft model of ``speculative.method: draft_model`` (`pkgd.runner.draft_model`),
    loaded beside ``target`` (imports torch). Raises `ValueError` when its vocabulary differs."""
    from pkgd.runner.draft_model import DraftModelProposer

    info = target.model_info
    limit = (
        info.max_model_len
        if config.model.max_model_len is None
        else min(config.model.max_model_len, info.max_model_len)
    )
    return DraftModelProposer.load(config, info.vocab_size, limit)


def default_cpu_kv_cache_bytes(config: VllmConfig, available_bytes: int | None) -> int:
    """The CPU KV budget of one engine worker when ``cache.kv_cache_memory_bytes`` is unset:
    ``min(4 GiB, CPU_AVAILABLE_MEMORY_FRACTION x available_bytes / workers)``, where workers =
    this node's engine cores (``parallel.dp_local``, else ``dp / nnodes``) x ``parallel.tp``
    ranks; 4 GiB when ``available_bytes`` is unknown (None)."""
    if available_bytes is None:
        return DEFAULT_CPU_KV_CACHE_BYTES
    share = int(available_bytes * CPU_AVAILABLE_MEMORY_FRACTION) // engine_workers_on_node(config)
    return min(DEFAULT_CPU_KV_CACHE_BYTES, share)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory after the weights are loaded, in bytes: ``free`` and ``total``
    (``torch.cuda.mem_get_info``) and ``used`` by this process (``memory_reserved``)."""

    free: int
    total: int
    used: int


def determine_num_kv_blocks(
    config: VllmConfig,
    bytes_per_block: int,
    *,
    device_memory: DeviceMemory | None = None,
    host_available_bytes: int | None = None,
    max_model_len: int | None = None,
) -> int:
    """KV blocks for this engine: ``cache.num_blocks`` when set, else the memory budget ÷
    ``bytes_per_block``.

    The budget is ``cache.kv_cache_memory_bytes`` when set; on CUDA (``device_memory``) it is
    vLLM's ``gpu_memory_utilization`` × total − what this process already holds, capped at
    90 % of the free memory (other processes' allocations and activations need the rest);
    on CPU it is `default_cpu_kv_cache_bytes` of ``host_available_bytes`` (MemAvailable after
    the weights are loaded), capped at what the scheduler can ever hold at once,
    ``scheduler.max_num_seqs`` sequences of ``max_model_len`` tokens (the block pool takes a
    never-used block only when every used one is held, so further blocks would never be
    touched). Raises `ValueError` when the budget holds no block.
    """
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    if bytes_per_block <= 0:
        raise ValueError(f"the runner reports {bytes_per_block} bytes per KV block")
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device_memory is not None:
        share = int(device_memory.total * cache.gpu_memory_utilization) - device_memory.used
        budget = min(share, int(device_memory.free * CUDA_FREE_MEMORY_FRACTION))
        if budget < bytes_per_block:
            raise ValueError(
                f"cache.gpu_memory_utilization: {cache.gpu_memory_utilization} of "
                f"{device_memory.total / 2**30:.1f} GiB "
                f"leaves no room for the KV cache after the model's {device_memory.used / 2**30:.1f} GiB; raise it"
            )
    else:
        budget = default_cpu_kv_cache_bytes(config, host_available_bytes)
        if max_model_len is not None:
            most = config.scheduler.max_num_seqs * -(-max_model_len // cache.block_size)
            budget = min(budget, most * bytes_per_block)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"cache.kv_cache_memory_bytes: {budget} bytes hold no KV block of {bytes_per_block} bytes "
            f"(block_size {cache.block_size}); raise it or lower cache.block_size"
        )
    return num_blocks


def _check_host_memory(runner: Any, kv_bytes: int) -> None:
    """Refuse a host-memory (CPU) KV cache larger than the memory available now, rather than
    let its zeroing drive the machine out of memory (and systemd restart it into the same).

    Raises:
        ValueError: ``kv_bytes`` exceeds ``MemAvailable``.
    """
    device = getattr(runner, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        return
    available = host.mem_available_bytes()
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

    def __init__(
        self, config: VllmConfig, *, engine_index: int = 0, runner_factory: RunnerFactory | None = None
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        self.model_files, self.model_runner = (runner_factory or load_model_runner)(config)
        info = self.model_runner.model_info
        configured = config.model.max_model_len
        if configured is not None and configured > info.max_model_len:
            raise ModelConfigMismatch(
                f"model.max_model_len: {configured} is greater than the model's limit of {info.max_model_len} "
                "tokens (max_position_embeddings in its config); lower model.max_model_len or leave it null"
            )
        self.max_model_len: int = info.max_model_len
        self.vocab_size: int = info.vocab_size
        self.eos_token_id: int | None = info.eos_token_id
        self.model_name = config.model.name or getattr(self.model_files, "name", None) or config.model.source
        self.block_size = config.cache.block_size
        # speculative.method: draft_model: the draft's KV shares the target's block ids, so
        # every block costs both models' bytes.
        self.draft_model = (
            load_draft_model(config, self.model_runner) if config.speculative.method == "draft_model" else None
        )
        bytes_per_block = self.model_runner.kv_cache_bytes_per_block(self.block_size)
        if self.draft_model is not None:
            bytes_per_block += self.draft_model.kv_cache_bytes_per_block(self.block_size)
        cuda_memory = _cuda_memory(self.model_runner)
        self.num_kv_blocks = determine_num_kv_blocks(
            config,
            bytes_per_block,
            device_memory=cuda_memory,
            host_available_bytes=host.mem_available_bytes() if cuda_memory is None else None,
            max_model_len=self.max_model_len,
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
        if self.draft_model is not None:
            self.draft_model.initialize_kv_cache(self.num_kv_blocks, self.block_size)
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, self.block_size, enable_caching=config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache_manager,
            max_model_len=self.max_model_len,
            speculator=Speculator(
                config.speculative.method,
                config.speculative.num_speculative_tokens,
                config.speculative.lookup_range(),
                draft_model=self.draft_model,
                max_model_len=self.max_model_len,
            ),
            max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
        )
        self.loras = LoRARegistry(self._runner_call("add_lora"), self._runner_call("remove_lora"))
        for module in config.lora.lora_modules:  # config-time checks made enable_lora true
            self.loras.add(module.name, module.path, module.base_model_name)
        self.kv_cache_bytes = bytes_per_block * self.num_kv_blocks
        self.runner_type: str = getattr(info, "runner", "generate")
        self.hidden_size: int = getattr(info, "hidden_size", 0)
        self.pooling_type: str = getattr(info, "pooling_type", "last")
        self.matryoshka: bool = getattr(info, "matryoshka", False)
        labels = getattr(info, "labels", None)
        self.labels: list[str] | None = list(labels) if labels else None  # a sequence classifier's
        self.use_sep_token: bool = getattr(info, "use_sep_token", True)
        dims = getattr(info, "matryoshka_dimensions", None)
        self.matryoshka_dimensions: list[int] | None = list(dims) if dims else None
        self.sleep_level = 0  # 0 = awake
        self.asleep: set[str] = set()  # of SLEEP_TAGS, released and not yet restored
        self.structured_output = StructuredOutputManager(
            getattr(self.model_files, "tokenizer_dir", None) or config.model.tokenizer,
            self.vocab_size,
            tuple(getattr(info, "eos_token_ids", None) or ([] if self.eos_token_id is None else [self.eos_token_id])),
        )
        # Constrained requests whose grammar is still compiling: outside the scheduler, so
        # nothing waits for a compile (pkgd.engine.structured_output).
        self.awaiting_grammar: dict[str, Request] = {}
        # (request id, reason) of requests refused after add_request returned (a constraint
        # that failed to compile); the caller reports them (core_proc, LLM).
        self.failed_requests: list[tuple[str, str]] = []
        self.thread_governor = _thread_governor(config, self.model_runner)

    # ---- requests -------------------------------------------------------------------------

    def validate_request(self, request: EngineCoreRequest) -> None:
        """Raise `ValueError` (changing nothing) for a request that can never run, or
        `EngineSleepingError` while the engine sleeps."""
        if self.asleep:
            raise EngineSleepingError(f"engine core {self.engine_index} is in sleep mode; wake it with POST /wake_up")
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")
        if (request.sampling_params is None) == (request.pooling_params is None):
            raise ValueError("a request needs exactly one of sampling_params and pooling_params")
        if request.lora_request is not None:
            self._validate_lora(request)
        if request.pooling_params is not None:
            self._validate_pooling(request)
            return
        if self.runner_type == "pooling":
            raise ValueError(
                "this model is served as a pooling model (model.runner: pooling): it computes embeddings and "
                "does not generate"
            )
        assert request.sampling_params is not None  # exactly one of the two (checked above)
        request.sampling_params.verify(max_logprobs=self.vocab_size, vocab_size=self.vocab_size)
        bad = [t for t in request.prediction_token_ids or () if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prediction token id {bad[0]} is out of range [0, {self.vocab_size})")
        # The frontend validates the prompt and max_tokens against max_model_len with the
        # user-facing message (pkgd.frontend.input_processor); this one cheap guard keeps a
        # wire client that skipped it from overrunning a request's block table.
        max_tokens = request.sampling_params.max_tokens
        if len(prompt) + (max_tokens or 1) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, which leaves no room to generate within "
                f"max_model_len {self.max_model_len}"
                if max_tokens is None
                else f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: "
                f"{len(prompt) + max_tokens} exceeds max_model_len {self.max_model_len}"
            )

    def _validate_lora(self, request: EngineCoreRequest) -> None:
        if not self.config.lora.enable_lora:
            raise ValueError("LoRA adapters are not enabled: start the engine with lora.enable_lora (--enable-lora)")
        if request.pooling_params is not None:
            raise ValueError("LoRA adapters apply to generation requests only")
        assert request.lora_request is not None
        self.loras.ensure(request.lora_request)

    # ---- LoRA adapters (utility calls; the registry is the engine's) -----------------------

    def add_lora(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> dict:
        """Load and serve an adapter (``POST /v1/load_lora_adapter``); returns its
        `LoRARequest` fields. Raises ``ValueError`` naming the problem, changing nothing."""
        if not self.config.lora.enable_lora:
            raise ValueError("LoRA adapters are not enabled: start the engine with lora.enable_lora (--enable-lora)")
        r = self.loras.add(lora_name, lora_path, base_model_name)
        return {"lora_name": r.lora_name, "lora_int_id": r.lora_int_id, "lora_path": r.lora_path}

    def remove_lora(self, lora_name: str) -> bool:
        """Stop serving an adapter (``POST /v1/unload_lora_adapter``); raises
        `LoRANotFoundError` for a name not served."""
        self.loras.remove(lora_name)
        return True

    def list_loras(self) -> list[dict]:
        """Every adapter served: ``lora_name``, ``lora_int_id``, ``lora_path``, ``base_model_name``."""
        return self.loras.list()

    def _runner_call(self, name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            method = getattr(self.model_runner, name, None)
            if method is None:
                raise ValueError("this engine's runner serves no LoRA adapters")
            return method(*args)

        return call

    def _validate_pooling(self, request: EngineCoreRequest) -> None:
        if self.runner_type != "pooling":
            raise ValueError(
                "this model is served for generation (model.runner: generate); embeddings need model.runner: pooling"
            )
        assert request.pooling_params is not None  # only called for pooling requests
        request.pooling_params.verify(
            hidden_size=self.hidden_size, matryoshka=self.matryoshka, matryoshka_dimensions=self.matryoshka_dimensions
        )
        if len(request.prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(request.prompt_token_ids)} tokens, more than max_model_len {self.max_model_len}"
            )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a tokenized request; raises `ValueError` (changing nothing) when it can never
        run: empty prompt, token ids outside the vocabulary, prompt + max_tokens beyond
        ``max_model_len``, invalid sampling or pooling parameters, a generation request to a
        pooling model or the reverse, or an id already live. Raises `EngineSleepingError`
        while the engine sleeps."""
        self.validate_request(request)
        # Mean and CLS pooling read every prompt position, so they take no prefix-cache hits.
        skip = request.pooling_params is not None and self.pooling_type != "last"
        # A prefix-cache hit changes which kernels compute the prompt's last tokens (a short
        # uncached suffix runs the small-batch GEMV / decode path, a full prefill the GEMM
        # path), and so the bits of its logits: a seeded request computes its whole prompt,
        # unless model.batch_invariant computes every token the same way anyway.
        sp = request.sampling_params
        if sp is not None and sp.seed is not None and not sp.greedy and not self.config.model.batch_invariant:
            skip = True
        req = Request.from_engine_core_request(request, max_model_len=self.max_model_len, skip_prefix_cache=skip)
        if req.arrival_time == 0.0:
            req.arrival_time = time.time()
        if req.request_id in self.awaiting_grammar:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.sampling_params is None or req.sampling_params.structured_outputs is None:
            self.scheduler.add_request(req)
            return
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.structured_output.add_request(req)
        self.awaiting_grammar[req.request_id] = req
        self._admit_compiled()

    def _admit_compiled(self) -> None:
        """Move requests whose grammar finished compiling into the scheduler (or to
        ``failed_requests`` when it failed)."""
        for rid, req in list(self.awaiting_grammar.items()):
            if not req.structured_output.ready():
                continue
            del self.awaiting_grammar[rid]
            error = req.structured_output.error()
            if error is not None:
                self.failed_requests.append((rid, f"structured_outputs: {error}"))
                continue
            self.structured_output.start_matcher(req)
            self.scheduler.add_request(req)

    def pop_failed_requests(self) -> list[tuple[str, str]]:
        """(request id, reason) of requests refused since the last call; they are gone."""
        failed, self.failed_requests = self.failed_requests, []
        return failed

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End these requests now and free their blocks; unknown ids are ignored. No output
        is produced for them (the frontend ends its side itself)."""
        request_ids = list(request_ids)
        for rid in request_ids:
            self.awaiting_grammar.pop(rid, None)
        self.scheduler.finish_requests(request_ids)

    # ---- stepping ---------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Run one schedule → execute → update step; returns the outputs of requests that got
        tokens (finished ones carry ``finish_reason``). Empty when there is nothing to do."""
        if self.awaiting_grammar:
            self._admit_compiled()
            if not self.scheduler.has_unfinished_requests():
                # Only compiles pending: wait a little for one instead of spinning.
                self.structured_output.wait_any(list(self.awaiting_grammar.values()), timeout=0.005)
                self._admit_compiled()
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        self.structured_output.fill_bitmask(scheduler_output, self.scheduler.requests)
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Nothing fits (cannot happen while the cache holds a max_model_len sequence);
            # keep the finished ids for the next step the runner sees.
            self.scheduler.finished_req_ids |= scheduler_output.finished_req_ids
            return []
        governor = self.thread_governor
        if governor is not None:
            governor.before_step()
        runner_output = self.model_runner.execute_model(scheduler_output)
        if governor is not None:
            governor.after_step(scheduler_output.total_num_scheduled_tokens, len(scheduler_output.num_scheduled_tokens))
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.awaiting_grammar) or bool(self.failed_requests)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests() + len(self.awaiting_grammar)

    def stats(self) -> SchedulerStats:
        """Running/waiting counts, KV usage, cumulative prefix-cache and preemption counters,
        and the adapters of running and waiting requests."""
        stats = self.scheduler.make_stats()
        stats.max_lora = self.scheduler.max_loras
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes (True); False, changing nothing, while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- sleep mode (vLLM's, behind model.enable_sleep_mode) ---------------------------------

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache and the weights' memory (`ModelRunner.sleep` says where the
        weights go at each level); the prefix cache is emptied with the KV cache.

        Raises:
            ValueError: sleep mode is off, ``level`` is not 1 or 2, or requests are running
                (the engine must be idle; nothing changes).
        """
        self._check_sleep_mode()
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if self.asleep:
            return
        if self.scheduler.has_unfinished_requests():
            n = self.scheduler.get_num_unfinished_requests()
            raise EngineBusyError(
                f"{n} requests are still running on engine core {self.engine_index}; sleep when it is idle"
            )
        self.kv_cache_manager.reset_prefix_cache()
        self.model_runner.sleep(level)
        if self.draft_model is not None:
            self.draft_model.runner.sleep(level)
        self.sleep_level, self.asleep = level, set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` released: ``tags`` of ``("weights", "kv_cache")``, default
        both; the engine serves again once both are back. Raises `ValueError` for an unknown
        tag or with sleep mode off."""
        self._check_sleep_mode()
        tags = list(SLEEP_TAGS) if not tags else list(tags)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; expected some of {list(SLEEP_TAGS)}")
        wanted = [t for t in tags if t in self.asleep]
        if wanted:
            self.model_runner.wake_up(wanted)
            if self.draft_model is not None:
                self.draft_model.runner.wake_up(wanted)
            self.asleep -= set(wanted)
        if not self.asleep:
            self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def _check_sleep_mode(self) -> None:
        if not self.config.model.enable_sleep_mode:
            raise ValueError(
                "sleep mode is off; start the engine with model.enable_sleep_mode: true (--enable-sleep-mode)"
            )

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
            "runner": self.runner_type,
            "hidden_size": self.hidden_size,
            "matryoshka": self.matryoshka,
            "matryoshka_dimensions": self.matryoshka_dimensions,
            "labels": self.labels,
            "use_sep_token": self.use_sep_token,
            "enable_sleep_mode": self.config.model.enable_sleep_mode,
        }

    def shutdown(self) -> None:
        """Abort everything and release the runner (idempotent)."""
        self.scheduler.finish_requests(list(self.scheduler.requests))
        self.awaiting_grammar.clear()
        self.structured_output.shutdown()
        close = getattr(self.model_runner, "shutdown", None)
        if close is not None:
            close()


def _thread_governor(config: VllmConfig, runner: Any) -> ThreadGovernor | None:
    """The governor of the step thread count (`pkgd.engine.threads`), on a CPU runner of this
    process (no tensor parallelism: the ranks' threads live in other processes) when
    ``parallel.cpu_threads_adaptive`` is on; None otherwise."""
    device = getattr(runner, "device", None)
    if not config.parallel.cpu_threads_adaptive or config.parallel.tp != 1 or getattr(device, "type", None) != "cpu":
        return None
    import torch

    governor = ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
    return governor if governor.active else None


def _cuda_memory(runner: ModelRunnerLike) -> DeviceMemory | None:
    device = getattr(runner, "device", None)
    if device is None or getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(free=free, total=total, used=torch.cuda.memory_reserved(device))


__all__ = [
    "EngineBusyError",
    "EngineCore",
    "EngineSleepingError",
    "ModelRunnerLike",
    "RunnerFactory",
    "default_cpu_kv_cache_bytes",
    "default_cpu_threads",
    "determine_num_kv_blocks",
    "engine_workers_on_node",
    "load_model_runner",
]
