"""pkgd's answer to every flag of ``vllm serve`` that is not a config alias.

vLLM's own list of flags is ``schemas/vllm_serve_flags.json`` (extracted from vLLM's parser
by ``scripts/vllm_flags_reference.py``; it records how many values each flag takes). Each of
those flags is, in order of precedence:

* **mapped**: an alias of a config key (``x-cli-aliases`` in the schema, `schema.alias_index`),
  e.g. ``--max-num-seqs`` sets ``scheduler.max_num_seqs``; ``--config FILE`` is the one flag
  that is a whole layer (`pkgd.config.vllm_yaml`);
* **satisfied**: accepted and changes nothing, because what it asks for is already how pkgd
  works (``--enforce-eager``: pkgd never captures CUDA graphs). A ``=A|B`` suffix limits it
  to those values; any other value is refused;
* **refused**: exits 2 before anything starts, with one line naming the flag and why
  (``--enable-lora: a vLLM flag pkgd does not support: pkgd serves no LoRA adapters``).

A test fails when a flag of the reference list has no answer, when an answer names a flag
vLLM does not have, or when ``docs/vllm-flags.md`` (``pkgd config vllm-flags --markdown``)
is out of date.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib.resources import files
from typing import Any, Literal

# Features pkgd does not have; the "off" form of such a switch is satisfied below.
_NO_LORA = "pkgd's LoRA adapters are text-only (no multimodal tower or per-modality adapters)"
_LORA_TARGETS = (
    "pkgd's LoRA covers the attention and dense MLP projections an adapter names (q/k/v/o, gate/up/down); "
    "targets are not restricted, not specialised, and MoE experts and classifier heads take no adapters"
)
_NO_MM = "pkgd serves text-only models (no multimodal inputs)"
_NO_MOE = (
    "pkgd places MoE experts one way (parallel.enable_expert_parallel: a contiguous num_experts / tp "
    "per rank) with one kernel path, and has no expert load balancing or routed-expert output"
)
_NO_CP = "pkgd has no context parallelism (tensor and data parallelism only)"
_NO_GRAPHS = "pkgd runs PyTorch eagerly and captures no CUDA graphs"
_NO_COMPILE = "pkgd compiles nothing (no torch.compile, no CUDA graphs)"
_NO_CODE = "pkgd never imports code named on its command line or shipped with a model"
_NO_HUB = "nothing is downloaded from a hub: model.source is a local directory, .gguf file or pkg: path"
_NO_MAMBA = "no Mamba/SSM model is supported"
_NO_OFFLOAD = "pkgd keeps weights and KV cache on the engine's device (no offloading)"
_NO_TLS = "pkgd's API servers speak plain HTTP; terminate TLS in a reverse proxy in front of them"
_NO_KV_TRANSFER = "pkgd has no disaggregated prefill / KV-cache transfer"
_NO_TRACING = "pkgd exports no traces (OpenTelemetry); its logs are structured JSON lines"
_NO_DPM_SUPERVISOR = (
    "lb.mode=external (-dpm/-dpe) runs one API server per rank on port + rank; pkgd has no aggregated health port"
)
_UVICORN = "pkgd serves HTTP with hypercorn; its limits are frontend.* keys (see `pkgd config show`)"
_LB_OFF = "lb.mode chooses internal, external or hybrid; to undo a switch set lb.mode=internal"

REFUSED: dict[str, tuple[str, ...]] = {
    "with --grpc (frontend.grpc) the gRPC server listens on --port itself; pkgd has no second port serving "
    "gRPC beside HTTP": ("--grpc-port",),
    _NO_LORA: (
        "--enable-tower-connector-lora",
        "--default-mm-loras",
    ),
    "pkgd shards every adapter as its base layer (B's outputs for column-parallel, A's inputs for "
    "row-parallel); there is no fully sharded LoRA layout": ("--fully-sharded-loras",),
    _LORA_TARGETS: (
        "--lora-target-modules",
        "--specialize-active-lora",
        "--enable-mixed-moe-lora-format",
        "--enable-moe-shared-loras",
        "--max-lora-cls-labels",
    ),
    "chat message content is rendered as the template expects (OpenAI lists are joined to text for string "
    "templates); the format is not selectable": ("--chat-template-content-format",),
    "a request's chat_template is never used: the template is model.chat_template or the tokenizer's": (
        "--trust-request-chat-template",
    ),
    _NO_MM: (
        "--trust-request-mm-kwargs",
        "--allowed-local-media-path",
        "--allowed-media-domains",
        "--limit-mm-per-prompt",
        "--enable-mm-embeds",
        "--media-io-kwargs",
        "--mm-processor-kwargs",
        "--mm-processor-cache-gb",
        "--mm-processor-cache-type",
        "--mm-hasher-algorithm",
        "--mm-shm-cache-max-object-size-mb",
        "--mm-encoder-only",
        "--mm-encoder-tp-mode",
        "--mm-encoder-attn-backend",
        "--mm-encoder-attn-dtype",
        "--mm-encoder-fp8-scale-path",
        "--mm-encoder-fp8-scale-save-path",
        "--mm-encoder-fp8-scale-save-margin",
        "--interleave-mm-strings",
        "--video-pruning-rate",
        "--video-pruning-method",
        "--mm-tensor-ipc",
        "--mm-processor-device",
        "--mm-ipc-gpu-memory-gb",
        "--mm-device-do-normalize",
        "--enable-chunked-mm-input",
        "--language-model-only",
        "--enable-prompt-embeds",
    ),
    "default chat_template_kwargs are not configurable; send chat_template_kwargs with the request": (
        "--default-chat-template-kwargs",
    ),
    "reasoning_effort is not mapped to template values": ("--reasoning-effort-map",),
    "the assistant role name is fixed ('assistant')": ("--response-role",),
    "logprob tokens are returned as text (token ids are in the tokenizer's /tokenize)": (
        "--return-tokens-as-token-ids",
    ),
    "tools are kept in the prompt for tool_choice=none": ("--exclude-tools-when-tool-choice-none",),
    "tool-call parsers are pkgd's registered ones (frontend.tool_call_parser); " + _NO_CODE: ("--tool-parser-plugin",),
    "pkgd has no structural-tag tool-call strictness levels": ("--tool-strict-level",),
    "pkgd runs no built-in tool servers (MCP, browser, code interpreter)": ("--tool-server",),
    "usage has no prompt_tokens_details": ("--enable-prompt-tokens-details",),
    "responses carry no per-request timing; see /metrics": ("--enable-per-request-metrics",),
    "pkgd does not track server_load_metrics": ("--enable-server-load-tracking",),
    "usage is sent as the request's stream_options ask": ("--enable-force-include-usage",),
    "pkgd sends no SSE keep-alive comments": ("--sse-keep-alive-interval",),
    "pkgd never logs model outputs (logging.log_requests logs ids, token counts and latency)": (
        "--enable-log-outputs",
    ),
    "pkgd serves no Cohere /v2/chat API": (
        "--cohere-is-reasoning-model",
        "--no-cohere-is-reasoning-model",
        "--cohere-format",
    ),
    "pkgd serves no Anthropic Messages API": ("--anthropic-disabled-thinking-effort",),
    "error responses are logged without stack traces; engine failures are logged with theirs": ("--log-error-stack",),
    "pkgd has no tokens-only (disaggregated everything) mode": ("--tokens-only",),
    "pkgd registers no scale-out endpoints (/render, /derender, /inference/v1/*)": ("--enable-scale-out",),
    "responses carry no system_fingerprint": ("--fingerprint-mode", "--fingerprint-value"),
    _NO_DPM_SUPERVISOR: (
        "--data-parallel-supervisor-port",
        "--dp-supervisor-probe-interval-s",
        "--dp-supervisor-probe-timeout-s",
        "--dp-supervisor-probe-failure-threshold",
    ),
    "pkgd writes no HTTP access log; logging.log_requests logs one line per request": ("--enable-uvicorn-access-log",),
    _NO_TLS: (
        "--ssl-keyfile",
        "--ssl-certfile",
        "--ssl-ca-certs",
        "--enable-ssl-refresh",
        "--ssl-cert-reqs",
        "--ssl-ciphers",
    ),
    "the API is served at /; set the path prefix in the reverse proxy": ("--root-path",),
    _NO_CODE: (
        "--middleware",
        "--model-class-overrides",
        "--logits-processors",
        "--io-processor-plugin",
        "--reasoning-parser-plugin",
        "--worker-cls",
        "--worker-extension-cls",
        "--scheduler-cls",
    ),
    "responses always carry an X-Request-Id header (the client's, echoed, or the request's id)": (
        "--disable-request-id-headers",
    ),
    "the OpenAPI docs (/docs, /redoc, /openapi.json) are always served": ("--disable-fastapi-docs",),
    _UVICORN: ("--h11-max-incomplete-event-size", "--h11-max-header-count"),
    "the /docs page loads its assets from a CDN; pkgd vendors no offline copy": ("--enable-offline-docs",),
    "pkgd has no late-interaction (ColBERT) scoring": ("--enable-flash-late-interaction",),
    "the tokenizer is the model's Hugging Face fast tokenizer and is always loaded": ("--skip-tokenizer-init",),
    "model.source is read as a Hugging Face directory or a .gguf file; no other config location": ("--hf-config-path",),
    _NO_HUB: ("--revision", "--code-revision", "--tokenizer-revision", "--hf-token", "--ignore-patterns"),
    "pkgd runs a GGUF file's own quantized types (model.quantization) and no other quantization method": (
        "--quantization-config",
        "--allow-deprecated-quantization",
    ),
    _NO_MOE: (
        "--enable-return-routed-experts",
        "--all2all-backend",
        "--enable-eplb",
        "--eplb-config",
        "--expert-placement-strategy",
        "--enable-ep-weight-filter",
        "--elastic-ep-max-dp-size",
        "--moe-backend",
    ),
    "pkgd returns no sampling masks": ("--return-sampling-mask",),
    "pkgd samples with torch's float32 Gumbel noise": ("--use-fp64-gumbel",),
    "pkgd has no trace replay": ("--enable-trace-replay",),
    "sliding-window models are refused at load (Qwen2 use_sliding_window); there is no window to disable": (
        "--disable-sliding-window",
    ),
    "cascade attention was removed from vLLM and pkgd never had it": ("--enable-cascade-attn",),
    "pkgd has no sleep-mode backends or CUDA memory pools to configure": (
        "--sleep-mode-backend",
        "--sleep-mode-offload-cudagraph",
        "--sleep-preserve-parameter-names",
        "--enable-cumem-allocator",
        "--enable-nccl-comm-suspend",
    ),
    "prompts are rendered in the API server's own thread pool": ("--renderer-num-workers",),
    "pkgd loads safetensors with its own loader (one mmap per file)": (
        "--safetensors-load-strategy",
        "--safetensors-prefetch-num-threads",
        "--safetensors-prefetch-block-size",
        "--model-loader-extra-config",
        "--pt-load-map-location",
        "--max-parallel-loading-workers",
    ),
    "loading progress is logged as timed model_phase lines (a bar on a terminal)": (
        "--use-tqdm-on-load",
        "--no-use-tqdm-on-load",
    ),
    "pkgd chooses its attention kernels by device and CPU features": (
        "--attention-backend",
        "--gdn-prefill-backend",
        "--kda-prefill-backend",
        "--kda-decode-backend",
    ),
    _NO_MAMBA: (
        "--mamba-backend",
        "--mamba-ssu-algorithm",
        "--enable-mamba-cache-stochastic-rounding",
        "--mamba-cache-philox-rounds",
        "--mamba-cache-dtype",
        "--mamba-ssm-cache-dtype",
        "--mamba-block-size",
        "--mamba-cache-mode",
        "--enable-mamba-shared-prefix-checkpoint",
        "--replayssm-buffer-len",
        "--use-replayssm",
    ),
    "torch.distributed timeouts are torch's defaults": (
        "--distributed-timeout-seconds",
        "--cpu-distributed-timeout-seconds",
    ),
    "set CPU and NUMA affinity with systemd (CPUAffinity=, NUMAPolicy=) or numactl": (
        "--numa-bind",
        "--numa-bind-nodes",
        "--numa-bind-cpus",
    ),
    "choose GPUs with CUDA_VISIBLE_DEVICES": ("--device-ids",),
    _NO_CP: (
        "--dcp-comm-backend",
        "--dcp-q-replicate",
        "--dcp-kv-cache-interleave-size",
        "--cp-kv-cache-interleave-size",
        "--enable-hc-sp",
    ),
    _LB_OFF: ("--no-data-parallel-hybrid-lb", "--no-data-parallel-external-lb"),
    "pkgd samples each engine core's batch in one place": ("--enable-batch-sharded-sampling",),
    "pkgd has no dual-batch overlap (micro-batching)": (
        "--enable-dbo",
        "--ubatch-size",
        "--dbo-decode-token-threshold",
        "--dbo-prefill-token-threshold",
    ),
    "tensors between pkgd's processes go through torch.distributed, not a shared-memory arena": (
        "--enable-shm-tensor-arena",
    ),
    "data-parallel engine cores do not synchronise steps (no MoE)": (
        "--dp-sync-interval",
        "--enable-nccl-for-dp-synchronization",
    ),
    "pkgd does not profile workers with Nsight under Ray (it does not use Ray)": ("--ray-workers-use-nsight",),
    "tensor parallelism all-reduces with torch.distributed (no custom all-reduce kernel)": (
        "--enable-custom-all-reduce",
    ),
    "a crashed engine core is restarted by the supervisor (supervisor.max_restarts); there is no in-engine "
    "fault tolerance": (
        "--enable-fault-tolerance",
        "--fault-tolerance-config",
    ),
    "the prefix cache evicts least recently used blocks; there is no retention interval": (
        "--prefix-cache-retention-interval",
    ),
    "every layer's K/V is stored in cache.cache_dtype": ("--kv-cache-dtype-skip-layers",),
    "pkgd has no cross-layer KV sharing": ("--kv-sharing-fast-prefill",),
    "pkgd has no sliding-window replay": ("--swa-bounded-replay",),
    "prefix-cache hits are whole KV blocks (cache.block_size)": ("--prefix-match-unit",),
    _NO_OFFLOAD: (
        "--kv-offloading-size",
        "--kv-offloading-backend",
        "--offload-backend",
        "--cpu-offload-params",
        "--offload-group-size",
        "--offload-num-in-group",
        "--offload-prefetch-step",
        "--offload-params",
    ),
    "skipped multimodal profiling only applies to multimodal models; " + _NO_MM: ("--skip-mm-profiling",),
    "logging is configured with the logging.* keys (structlog), not a Python logging config file": (
        "--logging-config",
        "--log-config-file",
    ),
    "pkgd exposes no hidden (deprecated) metrics": ("--show-hidden-metrics-for-version",),
    _NO_TRACING: ("--otlp-traces-endpoint", "--collect-detailed-traces", "--enable-layerwise-nvtx-tracing"),
    "speculative decoding is reported in the engine's vllm:spec_decode_* counters, not per request": (
        "--per-request-spec-decode-metrics",
    ),
    "pkgd exports no KV-cache residency metrics": ("--kv-cache-metrics", "--kv-cache-metrics-sample"),
    "histogram buckets are vLLM's defaults (see docs/metrics.md)": ("--custom-histogram-buckets",),
    "pkgd exports no CUDA-graph metrics: " + _NO_GRAPHS: ("--cudagraph-metrics",),
    "pkgd exports no MFU metrics": ("--enable-mfu-metrics",),
    "pkgd logs no per-iteration details": ("--enable-logging-iteration-details",),
    "pkgd has no JIT monitor": ("--jit-monitor-mode", "--jit-monitor-verbose"),
    "the waiting queue is unbounded; the API servers' frontend.limits bound each request": (
        "--max-num-scheduled-tokens",
        "--max-num-active-seqs",
        "--max-num-queued-reqs",
        "--max-num-queued-tokens",
    ),
    "pkgd caps prefill chunks at a fixed scheduler.long_prefill_token_threshold, not an adaptive one": (
        "--long-prefill-token-threshold-adaptive",
    ),
    "admission reserves room for the running requests' next tokens; the full prompt is not reserved": (
        "--scheduler-reserve-full-isl",
    ),
    "admission reserves the running requests' next 32 tokens of KV blocks instead of a watermark": ("--watermark",),
    "prefills are scheduled every step": ("--prefill-schedule-interval",),
    "pkgd's KV-cache manager has one full-attention group": ("--enable-hybrid-kv-cache-manager",),
    "the engine schedules, runs and samples each step in order (no async scheduling)": ("--async-scheduling",),
    _NO_COMPILE: (
        "--cudagraph-capture-sizes",
        "--max-cudagraph-capture-size",
        "--compilation-config",
        "-cc",
        "--ir-op-priority",
        "--enable-flashinfer-autotune",
        "--monokernel",
        "--linear-backend",
        "--sparse-indexer-topk-backend",
        "--kernel-config",
        "--performance-mode",
    ),
    "pkgd has no watermarking": ("--watermark-config",),
    "pkgd serves no diffusion models": ("--diffusion-config", "-dc"),
    _NO_KV_TRANSFER: (
        "--kv-transfer-config",
        "--kv-events-config",
        "--ec-transfer-config",
        "--ec-manager-config",
        "--weight-transfer-config",
    ),
    "attention is configured by pkgd per device": ("--attention-config", "-ac"),
    "pkgd has no Engram memory": ("--engram-config",),
    "reasoning is split by frontend.reasoning_parser": ("--reasoning-config",),
    "pkgd takes no free-form additional config": ("--additional-config",),
    "structured outputs use xgrammar; the backend is not selectable": ("--structured-outputs-config",),
    "pkgd has no auxiliary outputs": ("--aux-output-config",),
    "pkgd has no built-in torch profiler (use py-spy or perf)": ("--profiler-config",),
    "the engine watchdog is systemd's (WatchdogSec=, supervisor.watchdog)": ("--watchdog-config",),
    "stats are per engine core (engine label on /metrics); there is no aggregated stats log": (
        "--aggregate-engine-logging",
    ),
    "pkgd checks PKGD_* variables, not VLLM_* ones": (
        "--fail-on-environ-validation",
        "--no-fail-on-environ-validation",
    ),
    "an embedding model's pooling is set with the model.pooler.* keys": ("--pooler-config",),
}

SATISFIED: dict[str, tuple[str, ...]] = {
    "responses always carry an X-Request-Id header (the client's, echoed, or the request's id)": (
        "--enable-request-id-headers",
    ),
    "pkgd never prints prompts, so every limit on their logged length holds": ("--max-log-len",),
    "only matters with --enable-log-outputs, and pkgd never logs outputs": (
        "--enable-log-deltas",
        "--disable-log-deltas",
        "--disable-log-outputs",
    ),
    "pkgd writes no HTTP access log, for any endpoint": (
        "--disable-uvicorn-access-log",
        "--disable-access-log-for-endpoints",
    ),
    "the default of a feature pkgd does not have": (
        "--no-trust-request-mm-kwargs",
        "--no-trust-request-chat-template",
        "--no-return-tokens-as-token-ids",
        "--disable-prompt-tokens-details",
        "--disable-per-request-metrics",
        "--disable-server-load-tracking",
        "--disable-force-include-usage",
        "--no-log-error-stack",
        "--no-tokens-only",
        "--disable-scale-out",
        "--enable-fastapi-docs",
        "--disable-offline-docs",
        "--disable-flash-late-interaction",
        "--no-skip-tokenizer-init",
        "--no-allow-deprecated-quantization",
        "--disable-return-routed-experts",
        "--no-return-sampling-mask",
        "--no-use-fp64-gumbel",
        "--disable-trace-replay",
        "--enable-sliding-window",
        "--disable-prompt-embeds",
        "--no-sleep-mode-offload-cudagraph",
        "--disable-cumem-allocator",
        "--disable-nccl-comm-suspend",
        "--disable-mamba-cache-stochastic-rounding",
        "--no-numa-bind",
        "--no-dcp-q-replicate",
        "--disable-hc-sp",
        "--disable-batch-sharded-sampling",
        "--disable-ep-weight-filter",
        "--disable-dbo",
        "--disable-shm-tensor-arena",
        "--disable-nccl-for-dp-synchronization",
        "--disable-eplb",
        "--no-ray-workers-use-nsight",
        "--disable-fault-tolerance",
        "--no-kv-sharing-fast-prefill",
        "--no-swa-bounded-replay",
        "--disable-mamba-shared-prefix-checkpoint",
        "--no-use-replayssm",
        "--no-language-model-only",
        "--disable-mm-embeds",
        "--no-mm-encoder-only",
        "--no-interleave-mm-strings",
        "--no-skip-mm-profiling",
        "--no-mm-device-do-normalize",
        "--disable-tower-connector-lora",
        "--no-fully-sharded-loras",
        "--no-specialize-active-lora",
        "--disable-mixed-moe-lora-format",
        "--disable-moe-shared-loras",
        "--no-kv-cache-metrics",
        "--no-cudagraph-metrics",
        "--disable-layerwise-nvtx-tracing",
        "--disable-mfu-metrics",
        "--disable-logging-iteration-details",
        "--no-jit-monitor-verbose",
        "--no-long-prefill-token-threshold-adaptive",
        "--disable-chunked-mm-input",
        "--no-scheduler-reserve-full-isl",
        "--disable-hybrid-kv-cache-manager",
        "--no-async-scheduling",
        "--disable-ssl-refresh",
        "--disable-flashinfer-autotune",
        "--no-monokernel",
        "--no-exclude-tools-when-tool-choice-none",
        "--disable-custom-all-reduce",
        "--disable-cascade-attn",
    ),
    _NO_GRAPHS + ": both forms run eagerly": ("--enforce-eager", "--no-enforce-eager"),
    "pkgd tokenizes with the model's Hugging Face fast tokenizer": ("--tokenizer-mode=auto|hf",),
    "the model's config.json is read as Hugging Face's": ("--config-format=auto|hf",),
    "pkgd runs its own model implementations"
    " (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3 text, Mixtral, Qwen3-MoE: docs/models.md)": (
        "--model-impl=auto|vllm",
    ),
    "pkgd reads the format from the file: a safetensors directory or a .gguf file": ("--load-format=auto",),
    "logprobs are the raw log-softmax of the model's logits": ("--logprobs-mode=raw_logprobs",),
    "tensor-parallel workers and engine cores are separate processes on this node": (
        "--distributed-executor-backend=mp",
        "--data-parallel-backend=mp",
        "-dpb=mp",
    ),
    _NO_CP + "; size 1 is its absence": (
        "--decode-context-parallel-size=1",
        "-dcp=1",
        "--prefill-context-parallel-size=1",
        "-pcp=1",
    ),
    "prefix-cache block hashes are SHA-256 chained over token ids": ("--prefix-caching-hash-algo=sha256",),
    _NO_OFFLOAD + "; 0 offloads nothing": ("--cpu-offload-gb=0",),
    "outputs are streamed after every engine step": ("--stream-interval=1",),
    _NO_COMPILE + "; level 0 compiles nothing": ("--optimization-level=0",),
}


@dataclasses.dataclass(frozen=True)
class Answer:
    """pkgd's answer to one vLLM flag: ``satisfied`` (accepted, nothing to change) or
    refused; ``values``: the only values a satisfied flag accepts (empty = any)."""

    flag: str
    satisfied: bool
    reason: str
    values: tuple[str, ...] = ()

    def problem(self, value: str | None = None) -> str | None:
        """The refusal line for this use of the flag, or None when it is accepted."""
        if self.satisfied and (not self.values or value in self.values):
            return None
        if self.satisfied:
            shown = f"{self.flag} {value}" if value is not None else self.flag
            return (
                f"{shown}: a value of this vLLM flag pkgd does not support (accepted: {', '.join(self.values)}); "
                f"{self.reason}"
            )
        return f"{self.flag}: a vLLM flag pkgd does not support: {self.reason}"


@functools.cache
def answers() -> dict[str, Answer]:
    """Every answered flag (option string) → its `Answer`."""
    out: dict[str, Answer] = {}
    for satisfied, table in ((False, REFUSED), (True, SATISFIED)):
        for reason, flags in table.items():
            for entry in flags:
                flag, _, values = entry.partition("=")
                if flag in out:
                    raise ValueError(f"{flag} is answered twice")
                out[flag] = Answer(flag, satisfied, reason, tuple(values.split("|")) if values else ())
    return out


@functools.cache
def reference() -> dict[str, Any]:
    """``schemas/vllm_serve_flags.json``: vLLM's flags (see the module docstring)."""
    return json.loads((files("pkgd") / "schemas" / "vllm_serve_flags.json").read_text(encoding="utf-8"))


@functools.cache
def reference_nargs() -> dict[str, int | str | None]:
    """vLLM option string → its ``nargs`` (0 = a switch, None = one value, "+" or "?")."""
    return {flag: entry["nargs"] for entry in reference()["flags"] for flag in entry["flags"]}


def answer(flag: str) -> Answer | None:
    """The answer to a vLLM flag no config key maps, or None when pkgd does not know it."""
    return answers().get(flag)


def mapping(flag: str) -> str | None:
    """What a mapped flag sets, as the docs show it (``scheduler.max_num_seqs``, ``lb.mode =
    external``), or None when no config key maps it."""
    from pkgd.config import schema

    if flag == "--config":
        return "a layer: the YAML file's keys are read as these flags (below the other command-line arguments)"
    if flag in schema.section_aliases():
        return f"`{schema.section_aliases()[flag]}.*` (a JSON object of its keys)"
    entry = schema.alias_index().get(flag)
    if entry is None:
        return None
    leaf, const = entry
    if const is None:
        return f"`{leaf.key}`" + _registered(leaf.key)
    return f"`{leaf.key}` = {const}"


# Keys whose values are names in a registry: the docs list the names a value may take.
_REGISTRIES: dict[str, Literal["tool", "reasoning"]] = {
    "frontend.tool_call_parser": "tool",
    "frontend.reasoning_parser": "reasoning",
}


def _registered(key: str) -> str:
    if key not in _REGISTRIES:
        return ""
    from pkgd.parsers import registered_names  # light: names only, no parser code

    return " (one of " + ", ".join(f"`{n}`" for n in registered_names(_REGISTRIES[key])) + ")"


def markdown() -> str:
    """``docs/vllm-flags.md``: every flag of ``vllm serve`` and pkgd's answer."""
    ref = reference()
    lines = [
        f"# vLLM's `{ref['command']}` flags in pkgd",
        "",
        f"Every option of `{ref['command']} --help` in vLLM {ref['vllm_version']} and what pkgd does with it:",
        "**mapped** to a config key (the flag is an alias in the schema; `pkgd config show --sources`",
        "shows it as `cli`), **accepted** because what it asks for is already how pkgd works (it",
        "changes nothing; where values are listed, only those are accepted), or **refused**: the",
        "command exits 2 before anything starts, with one line naming the flag and the reason.",
        "Flags also take vLLM's spellings: `--flag=value`, underscores (`--max_model_len`), `-O0`.",
        "As in vLLM, `pkgd serve --help=all` lists every key, `--help=listgroup` the sections,",
        "`--help=SECTION` (`model`, or vLLM's `ModelConfig`) one section and `--help=WORD`",
        "(`max-model-len`) the keys whose name or flag contains the word.",
        "",
        "Generated from `schemas/vllm_serve_flags.json` and the schema by",
        "`python -m pkgd.config.vllm_flags > docs/vllm-flags.md`; a test keeps it current.",
    ]
    group = None
    for entry in ref["flags"]:
        if entry["group"] != group:
            group = entry["group"]
            lines += ["", f"## {group}", "", "| flag | pkgd |", "| --- | --- |"]
        names = " ".join(f"`{f}`" for f in entry["flags"])
        answers_ = []
        for flag in entry["flags"]:
            mapped = mapping(flag)
            found = answer(flag)
            if mapped is not None:
                text = f"mapped: {mapped}"
            elif found is not None and found.satisfied:
                only = f" (values: {', '.join(found.values)})" if found.values else ""
                text = f"accepted{only}: {found.reason}"
            elif found is not None:
                text = f"refused: {found.reason}"
            else:
                text = "unanswered"
            answers_.append((flag, text))
        if len({t for _, t in answers_}) == 1:
            lines.append(f"| {names} | {answers_[0][1]} |")
        else:
            lines.append(f"| {names} | " + "; ".join(f"`{f}`: {t}" for f, t in answers_) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(markdown())
