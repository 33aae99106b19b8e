"""`ModelRunner`: one model replica (or one tensor-parallel rank of it) on one device.

The engine core drives it: ``model_info`` and ``kv_cache_bytes_per_block`` size the KV
cache, ``initialize_kv_cache`` allocates it, then each step ``execute_model(SchedulerOutput)
-> ModelRunnerOutput`` runs one flattened batch (contracts in
`pkgd.scheduler_output` and `pkgd.runner_output`).

A step: apply the scheduler's diffs to the per-request states -> flatten (one-token queries
first) -> model forward over all scheduled tokens -> LM head only on the rows that sample (the
last scheduled token of each request whose known tokens are all computed) and on the rows that
give prompt logprobs -> the grammar bitmask of constrained requests (`grammar_bitmask`) ->
`Sampler` -> append each sampled token to its request.

With ``model.batch_invariant`` every scheduled token is its own forward (one query token
over the cache: the decode path), and logits and sampling run per request: no kernel sees
another request's rows, nor more than one row, so a token's bits depend only on its request
(`_forward_invariant`).

Threads are the process owner's business (``torch.set_num_threads``); the runner never sets
them. With ``world_size > 1`` the owner initialises ``torch.distributed`` first; every rank
runs the same steps and samples the same tokens (same logits after the all-gather, same
generators), so any rank's output may be used.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path
from typing import Any, cast

import torch

from pkgd import log, phases
from pkgd.config.vllm_config import VllmConfig
from pkgd.logprobs import TokenLogprobs
from pkgd.lora_request import LoRARequest
from pkgd.model_files.resolve import ModelFiles, default_cache_dir, ensure_float_weights
from pkgd.runner.allocator import (
    collapse_to_huge_pages,
    lazy_zeroed_buffers,
    step_heap,
    tensor_span,
    tune_cpu_allocator,
)
from pkgd.runner.attention import AttentionMetadata
from pkgd.runner.distributed import TPGroup
from pkgd.runner.grammar_bitmask import apply_grammar_bitmask
from pkgd.runner.input_batch import RequestState, StepBatch, build_batch, update_states
from pkgd.runner.loader.dtype import DtypeChoice, MeasurementCache, choose_dtype, linear_shapes
from pkgd.runner.loader.gguf_weights import GGUFWeights, choose_quantization, load_quantized_model
from pkgd.runner.loader.packed_cache import DIRECTORY as PACKED_WEIGHTS_DIR
from pkgd.runner.loader.packed_cache import PackedWeightsCache
from pkgd.runner.loader.weights import load_model
from pkgd.runner.lora.manager import LoRAManager
from pkgd.runner.models.classifier import is_classifier, labels_of, resolve_classifier_tokens, uses_sep_token
from pkgd.runner.models.config import ArchConfig, load_arch_config
from pkgd.runner.models.llama import kv_heads_per_rank
from pkgd.runner.pooler import Pooler, matryoshka_of, resolve_pooling_type
from pkgd.runner.rejection_sampler import VerifyGroup, verify
from pkgd.runner.sampler import Sampler, SamplingRow, batch_token_logprobs
from pkgd.runner_output import ModelRunnerOutput
from pkgd.sampling_params import SamplingParams
from pkgd.scheduler_output import SchedulerOutput

logger = log.get_logger("pkgd.runner")

_DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16)  # broadcast between TP ranks by index

# Prompt-logprob rows go through the LM head in slices of this many (bounds the [n, V] logits).
# The head of each CPU KV buffer kept on 4 KiB pages (`initialize_kv_cache`): one huge page's
# worth, the blocks of the first requests (SmolLM2, bf16 KV: ~340 blocks of 16 tokens).
KV_SMALL_PAGE_HEAD_BYTES = 2 << 20
PROMPT_LOGPROBS_SLICE = 256


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about the loaded model.

    ``max_model_len`` is effective: ``min(model.max_model_len, max_position_embeddings)``, in
    tokens. Head counts are the whole model's; ``num_kv_heads_per_rank`` what one rank caches.
    ``num_params`` counts weights (a quantized matrix's elements, not its bytes);
    ``weight_bytes`` is what they take in memory; ``quantization`` is ``none`` or ``gguf:``
    and the quantized types kept (``gguf:Q4_1,Q8_0``).
    """

    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_kv_heads_per_rank: int
    head_dim: int
    hidden_size: int
    dtype: str
    num_params: int
    runner: str = "generate"  # model.runner, resolved: generate | pooling
    pooling_type: str = "last"
    labels: tuple[str, ...] | None = None  # a sequence classifier's label names, one per output
    use_sep_token: bool = True  # a cross-encoder's pairs: text-pair tokenization, else one joined text
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    quantization: str = "none"
    weight_bytes: int = 0


def resolve_kv_cache_dtype(
    cache_dtype: str, model_dtype: torch.dtype, device: torch.device, quantized: bool = False
) -> torch.dtype:
    """``cache.cache_dtype`` as a torch dtype: ``auto`` is the model dtype (vLLM's rule), except
    under GGUF weights kept quantized on CPU, where it is bfloat16: half the bytes a cached token
    takes of float32 (llama.cpp keeps its quantized files' K/V in 16 bits too, f16), widened to
    float32 by a shift as attention reads it, which measured faster than both float32 and
    float16 K/V (``pkgd bench throughput cache.cache_dtype=...``); attention is computed in
    float32.

    Raises:
        ValueError: a cache dtype other than the model's on CUDA (the Triton kernels read and
            write the cache in the model dtype).
    """
    if cache_dtype == "auto":
        kv = torch.bfloat16 if quantized and device.type == "cpu" else model_dtype
    else:
        kv = getattr(torch, cache_dtype)
    if kv != model_dtype and device.type != "cpu":
        raise ValueError(
            f"cache.cache_dtype: {cache_dtype} differs from the model dtype "
            f"{str(model_dtype).removeprefix('torch.')}, which only the CPU path supports; use auto on {device.type}"
        )
    return kv


def arch_config_for(config: VllmConfig, model_files: ModelFiles) -> ArchConfig:
    """The model's `ArchConfig`: ``config.json`` with ``model.hf_overrides`` over it; with
    ``model.convert: classify`` a ``*ForCausalLM`` becomes its ``*ForSequenceClassification``;
    a classifier's ``classifier_from_token`` resolved to token ids (`pkgd.runner.models.classifier`).

    Raises:
        ValueError: an unreadable config, or a ``classifier_from_token`` the tokenizer lacks.
    """
    arch = load_arch_config(model_files.model_dir, config.model.hf_overrides.as_dict())
    raw = arch.raw
    if config.model.convert == "classify" and not is_classifier(arch.architecture):
        name = arch.architecture.removesuffix("ForCausalLM") + "ForSequenceClassification"
        raw = {**raw, "architectures": [name]}
    if is_classifier(raw["architectures"][0]):
        raw = resolve_classifier_tokens(raw, model_files.tokenizer_dir)
    return arch if raw is arch.raw else dataclasses.replace(arch, architecture=str(raw["architectures"][0]), raw=raw)


def resolve_device(requested: str) -> torch.device:
    """``parallel.device``: ``auto`` = cuda when available, else cpu."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


class ModelRunner:
    """Loads the model and executes scheduler steps (see the module docstring).

    Raises (from the constructor):
        UnsupportedArchitectureError: ``config.json`` names an unregistered architecture.
        ModelSourceError: weight files are missing or unreadable.
        ValueError: weights that do not fit, or a TP size the head counts do not divide.
    """

    def __init__(
        self,
        config: VllmConfig,
        model_files: ModelFiles,
        *,
        device: torch.device | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.config = config
        self.model_files = model_files
        self.device = device or resolve_device(config.parallel.device)
        self.tp = TPGroup(rank, world_size, expert_parallel=config.parallel.enable_expert_parallel)
        self._float_choice: DtypeChoice | None = None
        self.arch: ArchConfig = arch_config_for(config, model_files)
        bar = rank == 0  # one bar per terminal: the other ranks log their phases only
        self.cpu_kernels = None
        if self.device.type == "cpu":
            tune_cpu_allocator()
            with phases.phase("cpu_kernels", "building CPU kernels", bar=bar):
                self.cpu_kernels = self._load_cpu_kernels(config)
        self.runner_type = config.model.runner_type
        if is_classifier(self.arch.architecture):
            if config.model.runner == "generate":
                raise ValueError(
                    f"model.runner: generate cannot serve {self.arch.architecture} (a classifier): use "
                    "model.runner: pooling or auto"
                )
            self.runner_type = "pooling"
        self.quantization, self._gguf = choose_quantization(
            config.model.quantization,
            model_files.gguf_path,
            self.arch,
            device=self.device,
            tp_size=world_size,
            kernels=self.cpu_kernels,
            dtype=config.model.dtype,
            pooling=self.runner_type == "pooling",
            float_dtype=lambda: self._float_dtype_choice().dtype,
            cache=MeasurementCache(default_cache_dir(config.model.cache_dir) / "quantization-choice"),
        )
        logger.info(
            "quantization_choice",
            quantized=self.quantization.quantized,
            reason=self.quantization.reason,
            tensor_types=self.quantization.tensor_types,
            figures=self.quantization.figures,
        )
        self.dtype_choice = self._choose_dtype()
        self.dtype = self.dtype_choice.dtype
        pooler_cfg = config.model.pooler
        self.pooler = Pooler(
            resolve_pooling_type(pooler_cfg.pooling_type, model_files.model_dir), normalize=pooler_cfg.normalize
        )
        with phases.phase(
            "load_weights",
            "loading weights",
            unit="tensor",
            bar=bar,
            dtype=str(self.dtype).removeprefix("torch."),
            quantized=self.quantization.quantized,
        ) as p:
            # a model class of pkgd.runner.models (compute_logits, cpu_decode ...); None after sleep(2)
            self.model: Any = self._load_model(progress=p)
        if self.device.type == "cpu":
            self._to_huge_pages("weights", [tensor_span(t) for t in self.model.parameters()])
            step_heap()  # loading's garbage handed back; the steps' temporaries stay in the heap
        if self.cpu_kernels is not None:
            logger.info(
                "cpu_kernels_loaded",
                library=str(self.cpu_kernels.path),
                one_call_decode=getattr(self.model, "cpu_decode", None) is not None,
            )
        self.num_kv_heads_local, _ = kv_heads_per_rank(self.arch.num_key_value_heads, self.tp)
        self.kv_dtype = resolve_kv_cache_dtype(
            config.cache.cache_dtype, self.dtype, self.device, quantized=self.quantization.quantized
        )
        self.model_info = self._model_info()
        gen = torch.Generator().manual_seed(config.model.seed)
        self.sampler = Sampler(self.model_info.eos_token_ids, gen)
        self.batch_invariant = config.model.batch_invariant
        self.states: dict[str, RequestState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.num_blocks = 0
        self._offloaded: dict[torch.Tensor, torch.Tensor] | None = None  # sleep level 1 on a GPU
        self.lora: LoRAManager | None = None
        self._attach_lora()

    # ---- LoRA adapters (`pkgd.runner.lora`) ----------------------------------------------

    def _attach_lora(self) -> None:
        """Adapter slots on the model when ``lora.enable_lora`` (again after a reload of the
        weights, keeping the host cache)."""
        cfg = self.config.lora
        if not cfg.enable_lora or self.runner_type != "generate" or self.model is None:
            return
        dtype = self.dtype if cfg.lora_dtype == "auto" else getattr(torch, cfg.lora_dtype)
        cache = self.lora.cache if self.lora is not None else None
        self.lora = LoRAManager(self.model, cfg, dtype=dtype, device=self.device)
        if cache is not None:
            self.lora.cache = cache

    def add_lora(self, request: LoRARequest) -> bool:
        """Read and check an adapter into the host cache; raises `LoRAAdapterError`
        (a ``ValueError``) naming the problem, changing nothing."""
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled (lora.enable_lora) or this model takes none")
        self.lora.add_adapter(request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter's host copy and slot; whether it was held."""
        return self.lora is not None and self.lora.remove_adapter(lora_int_id)

    def _load_model(self, progress: Any = None) -> torch.nn.Module:
        """The model: the GGUF's blocks kept quantized when `choose_quantization` said so (the
        file reopened when `wake_up` reloads it), else the float weights in ``self.dtype``."""
        if self.quantization.quantized:
            path = self.model_files.gguf_path
            assert path is not None, "choose_quantization keeps quantized weights of a GGUF source only"
            gguf, self._gguf = self._gguf or GGUFWeights(path, self.arch), None
            cache = PackedWeightsCache(default_cache_dir(self.config.model.cache_dir) / PACKED_WEIGHTS_DIR)
            return load_quantized_model(self.arch, gguf, kernels=self.cpu_kernels, progress=progress, cache=cache)
        ensure_float_weights(self.model_files)
        return load_model(
            self.arch,
            self.model_files.model_dir,
            dtype=self.dtype,
            device=self.device,
            tp=self.tp,
            progress=progress,
            kernels=self.cpu_kernels,
            pooling=self.runner_type == "pooling",
        )

    def _float_dtype_choice(self) -> DtypeChoice:
        """``model.dtype`` resolved for float weights (`pkgd.runner.loader.dtype`; measured on
        rank 0 only, once: `choose_quantization`'s ``auto`` compares against it)."""
        if self._float_choice is None:
            first = self.tp.rank == 0
            self._float_choice = choose_dtype(
                self.config.model.dtype,
                self.arch.checkpoint_dtype,
                self.device.type,
                shapes=linear_shapes(self.arch, self.tp.size) if first else (),
                layers=self.arch.num_hidden_layers,
                kernels=self.cpu_kernels,
                cache=MeasurementCache(default_cache_dir(self.config.model.cache_dir) / "dtype-choice"),
            )
        return self._float_choice

    def _choose_dtype(self) -> DtypeChoice:
        """The dtype the model runs in, broadcast from rank 0 so every rank of a TP group runs
        one dtype: float32 activations for weights kept quantized, else
        `_float_dtype_choice`; logged as ``dtype_choice``."""
        first = self.tp.rank == 0
        if self.quantization.quantized:  # kept only for model.dtype auto or float32 (choose_quantization)
            choice = DtypeChoice(torch.float32, self.config.model.dtype, "quantized weights take float32 activations")
        else:
            choice = self._float_dtype_choice()
        if self.tp.size > 1:
            codes = list(_DTYPE_CODES)
            agreed = codes[int(self.tp.broadcast(torch.tensor([codes.index(choice.dtype)], device=self.device)).item())]
            if agreed != choice.dtype or not first:
                choice = dataclasses.replace(choice, dtype=agreed, reason="rank 0's choice")
        logger.info("dtype_choice", **choice.as_dict())
        return choice

    @staticmethod
    def _load_cpu_kernels(config: VllmConfig):
        """The C kernels (`pkgd_kernels.cpu.CpuKernels`) for the model, or None (logged with
        the reason; the ops' PyTorch forms then run): from ``parallel.cpu_kernel_cache``, else
        ``kernels/`` under the model cache; none with ``parallel.cpu_kernels: false``."""
        from pkgd_kernels import cpu

        if not config.parallel.cpu_kernels:
            logger.info("cpu_kernels_unavailable", reason="disabled by parallel.cpu_kernels: false", fallback="pytorch")
            return None
        cache = config.parallel.cpu_kernel_cache
        try:
            return cpu.load(Path(cache) if cache else default_cache_dir(config.model.cache_dir) / "kernels")
        except cpu.CpuKernelsUnavailable as e:
            logger.warning("cpu_kernels_unavailable", reason=str(e), fallback="pytorch")
            return None

    def _model_info(self) -> ModelInfo:
        a = self.arch
        matryoshka, dims = matryoshka_of(self.config.model.pooler.matryoshka, a.raw)
        configured = self.config.model.max_model_len
        max_len = a.max_position_embeddings if configured is None else min(configured, a.max_position_embeddings)
        quantized = [m for m in self.model.modules() if hasattr(m, "qweight")]
        num_params = sum(p.numel() for p in self.model.parameters() if p.is_floating_point())  # this rank's share
        num_params += sum(m.num_weights for m in quantized)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return ModelInfo(
            architecture=a.architecture,
            max_model_len=max_len,
            vocab_size=a.vocab_size,
            eos_token_id=a.eos_token_ids[0] if a.eos_token_ids else None,
            eos_token_ids=a.eos_token_ids,
            bos_token_id=a.bos_token_id,
            num_layers=a.num_hidden_layers,
            num_heads=a.num_attention_heads,
            num_kv_heads=a.num_key_value_heads,
            num_kv_heads_per_rank=self.num_kv_heads_local,
            head_dim=a.head_dim,
            hidden_size=a.hidden_size,
            dtype=str(self.dtype).removeprefix("torch."),
            num_params=num_params,
            runner=self.runner_type,
            pooling_type=self.pooler.pooling_type,
            labels=tuple(labels_of(a.raw)) if is_classifier(a.architecture) else None,
            use_sep_token=uses_sep_token(a.raw),
            matryoshka=matryoshka,
            matryoshka_dimensions=tuple(dims) if dims else None,
            quantization="gguf:" + ",".join(sorted({n for m in quantized for n in m.qweight.qtype_names()}))
            if quantized
            else "none",
            weight_bytes=weight_bytes,
        )

    # ---- KV cache ------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block takes on this rank: K and V of every layer, ``block_size`` tokens."""
        elt = torch.empty(0, dtype=self.kv_dtype).element_size()
        return 2 * self.arch.num_hidden_layers * block_size * self.num_kv_heads_local * self.arch.head_dim * elt

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate zeroed ``key_cache``/``value_cache`` of shape ``[num_blocks, block_size,
        num_kv_heads_per_rank, head_dim]`` per layer. Zeroed so padding slots in a gathered
        block are finite (a masked NaN would still poison the attention's ``p @ V``).

        On CPU the cache is fresh anonymous memory (`pkgd.runner.allocator.lazy_zeroed_buffers`):
        zero without being written, resident only as blocks are first written, so the budget
        can be sized for the worst case while memory follows the blocks the scheduler uses.
        The first `KV_SMALL_PAGE_HEAD_BYTES` of each buffer stay on 4 KiB pages."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        shape = (num_blocks, block_size, self.num_kv_heads_local, self.arch.head_dim)
        layers = self.arch.num_hidden_layers
        with phases.phase(
            "kv_cache",
            "allocating KV cache",
            total=layers,
            unit="layer",
            bar=self.tp.rank == 0,
            num_blocks=num_blocks,
            bytes=num_blocks * self.kv_cache_bytes_per_block(block_size),
        ) as p:
            self.kv_caches = []
            if self.device.type == "cpu":
                nbytes = num_blocks * self.kv_cache_bytes_per_block(block_size) // (2 * layers)
                # The first requests get the lowest block ids (`BlockPool`): on 4 KiB pages, their
                # first writes fault in a few KiB per layer instead of a 2 MiB huge page each
                # (2 x layers faults of several ms each on a virtualised host: SmolLM2's first
                # answer took ~0.3 s longer). Blocks past the head stay on huge pages.
                raw = lazy_zeroed_buffers(
                    [nbytes] * (2 * layers),
                    huge_pages=self.config.parallel.cpu_huge_pages,
                    small_head=KV_SMALL_PAGE_HEAD_BYTES,
                )
                bufs = [b.view(self.kv_dtype).view(shape) for b in raw]
                self.kv_caches = list(zip(bufs[0::2], bufs[1::2]))
                p.advance(layers)
            else:
                for _ in range(layers):
                    self.kv_caches.append(
                        (
                            torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                            torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                        )
                    )
                    p.advance()
        self.block_size, self.num_blocks = block_size, num_blocks

    # ---- sleep mode ----------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Release memory until `wake_up` (vLLM's sleep mode; the engine holds no request).

        Level 1 frees the KV cache and moves the weights to host memory (on a CPU they are
        there already and stay); level 2 frees the KV cache and drops the weights, which
        `wake_up` reloads from the model files.
        """
        self.kv_caches = []
        self.states.clear()
        if level >= 2:
            self.model = None
            if self.lora is not None:
                self.lora.slot_ids = [None] * self.lora.max_loras  # the slots go with the weights
            self._offloaded = None
        elif self.device.type != "cpu" and self._offloaded is None and self.model is not None:
            # No kernel keeps raw pointers off the CPU, so swapping each tensor's storage is safe.
            self._offloaded = {}
            for t in [*self.model.parameters(), *self.model.buffers()]:
                self._offloaded[t] = t.data.to("cpu")
                t.data = torch.empty(0, dtype=t.dtype, device=self.device)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str]) -> None:
        """Restore what `sleep` released: ``"weights"`` and/or ``"kv_cache"`` (zeroed)."""
        if "weights" in tags:
            if self.model is None:
                self.model = self._load_model()
                self._attach_lora()
                if self.device.type == "cpu":
                    self._to_huge_pages("weights", [tensor_span(t) for t in self.model.parameters()])
                    step_heap()  # the reload's garbage handed back
            elif self._offloaded is not None:
                for t, host in self._offloaded.items():
                    t.data = host.to(self.device)
                self._offloaded = None
        if "kv_cache" in tags and not self.kv_caches and self.num_blocks:
            self.initialize_kv_cache(self.num_blocks, self.block_size)

    def _to_huge_pages(self, what: str, spans: list[tuple[int, int]]) -> None:
        """Back ``spans`` with 2 MiB pages (`pkgd.runner.allocator.collapse_to_huge_pages`) and
        log it; nothing with ``parallel.cpu_huge_pages: false``."""
        if not self.config.parallel.cpu_huge_pages:
            return
        t0 = time.perf_counter()
        done = collapse_to_huge_pages(spans)
        logger.info(
            "huge_pages",
            memory=what,
            bytes=done,
            of_bytes=sum(n for _, n in spans),
            seconds=round(time.perf_counter() - t0, 3),
        )

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the sampled tokens per scheduled request (decodes first).

        Raises:
            RuntimeError: the KV cache is not initialised.
            KeyError / ValueError: the scheduler's diffs do not match the runner's state.
        """
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must be called before execute_model()")
        update_states(self.states, scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        batch = build_batch(self.states, scheduler_output, self.block_size)
        hidden = self._forward_invariant(batch) if self.batch_invariant else self._forward(batch)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if batch.sample_rows:
            self._sample(batch, hidden, sampled, logprobs, scheduler_output)
        out = ModelRunnerOutput(
            req_ids=[st.req_id for st in batch.states],
            sampled_token_ids=[sampled.get(st.req_id, []) for st in batch.states],
        )
        if any(st.sampling_params is not None and st.sampling_params.logprobs is not None for st in batch.states):
            out.logprobs = [
                logprobs.get(st.req_id, [])
                if st.sampling_params is not None and st.sampling_params.logprobs is not None
                else None
                for st in batch.states
            ]
        if batch.prompt_logprobs:
            out.prompt_logprobs = self._prompt_logprobs(batch, hidden)
        if batch.pooling:
            # a sequence classifier's head turns the pooled hidden state into its logits
            out.pooler_output = self.pooler(hidden, batch.pooling, head=getattr(self.model, "classify", None))
        return out

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        meta = AttentionMetadata.build(
            query_lens=batch.query_lens,
            seq_lens=batch.seq_lens,
            block_table_rows=batch.block_table_rows,
            slot_mapping=batch.slot_mapping,
            block_size=self.block_size,
            kv_bytes_per_token=self._kv_bytes_per_token(),
            device=self.device,
            shares_sequences=bool(batch.drafts),
        )
        if self.lora is not None:
            # per request, not per attention sequence: a speculating request is 1 + k sequences
            self.lora.prepare_step([st.lora_request for st in batch.states], batch.state_tokens, self.device)
        return self.model(batch.input_ids.to(self.device), batch.positions.to(self.device), self.kv_caches, meta)

    def _kv_bytes_per_token(self) -> int:
        elt = max(self.kv_caches[0][0].element_size(), self.dtype.itemsize)
        return 2 * self.num_kv_heads_local * self.arch.head_dim * elt

    def _forward_invariant(self, batch: StepBatch) -> torch.Tensor:
        """`_forward` one token at a time, in order (a prompt's token t reads the K/V its
        earlier tokens wrote): every token takes the one-query path whatever the batch, the
        chunking or the prefix-cache hits, so its hidden state ``[1, H]`` is the same bits
        each time. Returns ``[T, H]`` as `_forward` does."""
        rows: list[torch.Tensor] = []
        ids, positions = batch.input_ids.to(self.device), batch.positions.to(self.device)
        t = 0
        for n, seq_len, table in zip(batch.query_lens, batch.seq_lens, batch.block_table_rows):
            for j in range(n):
                meta = AttentionMetadata.build(
                    query_lens=[1],
                    seq_lens=[seq_len - n + j + 1],
                    block_table_rows=[table],
                    slot_mapping=batch.slot_mapping[t : t + 1],
                    block_size=self.block_size,
                    kv_bytes_per_token=self._kv_bytes_per_token(),
                    device=self.device,
                )
                rows.append(self.model(ids[t : t + 1], positions[t : t + 1], self.kv_caches, meta))
                t += 1
        return torch.cat(rows)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits`` of ``hidden [M, H]`` -> ``[M, V]``; row by row under
        ``model.batch_invariant`` (a GEMM's kernel, and so its bits, depends on M)."""
        if not self.batch_invariant or hidden.shape[0] <= 1:
            return self.model.compute_logits(hidden)
        return torch.cat([self.model.compute_logits(hidden[i : i + 1]) for i in range(hidden.shape[0])])

    def _sample(
        self, batch: StepBatch, hidden: torch.Tensor, sampled: dict, logprobs: dict, so: SchedulerOutput
    ) -> None:
        if batch.drafts:
            self._verify(batch, hidden, sampled, logprobs, so)
            return
        rows = torch.tensor(batch.sample_rows, dtype=torch.int64, device=self.device)
        logits = self._logits(hidden.index_select(0, rows))
        apply_grammar_bitmask(logits, [st.req_id for st in batch.sample_states], so)
        logits = logits.cpu()
        # sample_states hold sampling requests only (pooling requests are never sampled)
        spec = [
            SamplingRow(
                cast(SamplingParams, st.sampling_params), st.prompt_token_ids, st.output_token_ids, st.generator
            )
            for st in batch.sample_states
        ]
        if self.batch_invariant:
            parts = [self.sampler(logits[i : i + 1], [row]) for i, row in enumerate(spec)]
            tokens = [int(p.token_ids[0]) for p in parts]
            found = [p.logprobs[0] for p in parts]
        else:
            result = self.sampler(logits, spec)
            tokens, found = result.token_ids.tolist(), result.logprobs
        for st, tok, lp in zip(batch.sample_states, tokens, found):
            st.append(tok)
            sampled[st.req_id] = [tok]
            if lp is not None:
                logprobs[st.req_id] = [lp]

    def _verify(
        self, batch: StepBatch, hidden: torch.Tensor, sampled: dict, logprobs: dict, so: SchedulerOutput
    ) -> None:
        """A step with speculative proposals: logits at every verified position of every
        sampling request, grammar masks per position, then `rejection_sampler.verify`."""
        drafts = [batch.drafts.get(st.req_id, []) for st in batch.sample_states]
        row_ids: list[int] = []
        req_ids: list[str] = []
        positions: list[int] = []
        for st, row, draft in zip(batch.sample_states, batch.sample_rows, drafts):
            for j in range(len(draft) + 1):
                row_ids.append(row + j)
                req_ids.append(st.req_id)
                positions.append(j)
        rows = torch.tensor(row_ids, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        apply_grammar_bitmask(logits, req_ids, so, positions)
        groups = [
            VerifyGroup(
                SamplingRow(
                    cast(SamplingParams, st.sampling_params), st.prompt_token_ids, st.output_token_ids, st.generator
                ),
                draft,
            )
            for st, draft in zip(batch.sample_states, drafts)
        ]
        emitted, lps = verify(self.sampler, logits.float().cpu(), groups)
        for st, tokens, lp in zip(batch.sample_states, emitted, lps):
            for tok in tokens:
                st.append(tok)
            sampled[st.req_id] = tokens
            if lp is not None:
                logprobs[st.req_id] = lp

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> dict[str, list[TokenLogprobs | None]]:
        out: dict[str, list[TokenLogprobs | None]] = {}
        for span in batch.prompt_logprobs:
            entries: list[TokenLogprobs | None] = [None] * span.leading_nones
            for s in range(span.row_start, span.row_end, PROMPT_LOGPROBS_SLICE):
                e = min(span.row_end, s + PROMPT_LOGPROBS_SLICE)
                lp = torch.log_softmax(self._logits(hidden[s:e]).cpu(), dim=-1)
                targets = torch.tensor(span.target_ids[s - span.row_start : e - span.row_start], dtype=torch.int64)
                entries.extend(batch_token_logprobs(lp, targets, [span.num_logprobs] * (e - s)))
            out[span.req_id] = entries
        return out
