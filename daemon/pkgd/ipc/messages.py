"""Every message that crosses a process boundary, as versioned msgspec structs.

One module so the protocol reads in one place. Frames are msgpack;
nothing is pickled. Each frame is a tagged union member (``type`` field), so a receiver
dispatches by type through a table. ``PROTOCOL_VERSION`` is checked in the handshake: a
client speaking another version is refused with a clear error.

Directions:
    API server -> engine core: `Hello`, `AddRequest`, `AbortRequests`, `UtilityRequest`,
        `Shutdown`.
    engine core -> API server: `Handshake`, `EngineOutputs`, `EngineError`, `UtilityResult`.
    child -> supervisor (ready pipe, one frame then close): `Handshake` (engine core) or
        `ApiServerReady` (API server) once serving, or `ChildFailed` when start-up failed.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

from pkgd.logprobs import TokenLogprobs
from pkgd.lora_request import LoRARequest
from pkgd.pooling_params import PoolingParams
from pkgd.sampling_params import SamplingParams

# 2: SamplingParams.structured_outputs (an engine speaking 1 would ignore the constraint).
# 3: pooling requests and outputs, utility calls (prefix-cache reset, sleep mode).
# 4: per-request engine timestamps and preemptions on EngineCoreOutput; the per-step token
# histogram in SchedulerStats.
# 5: speculative decoding: EngineCoreRequest.prediction_token_ids, the prediction counts on
# EngineCoreOutput, the spec_decode counters in SchedulerStats.
# 6: EngineCoreRequest.lora_request, the LoRA utility calls, LoRA counts in SchedulerStats.
PROTOCOL_VERSION = 6

# Upper bounds of the SchedulerStats.iteration_tokens_counts buckets (tokens per engine step),
# vLLM v1's ``vllm:iteration_tokens_total`` buckets (vllm/v1/metrics/buckets.py); the last
# count is the +Inf bucket.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class FinishReason(enum.IntEnum):
    """Why a request ended; names match OpenAI's ``finish_reason`` (plus abort/error)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class Message(msgspec.Struct, tag_field="type", omit_defaults=True, kw_only=True):
    """Base of every frame."""


# ---- API server -> engine core -------------------------------------------------------


class Hello(Message, tag="hello"):
    """First frame of a client; the core answers with `Handshake`."""

    version: int
    client_id: str


class EngineCoreRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A tokenized request. ``eos_token_id`` None means the model has none.

    Exactly one of ``sampling_params`` (generate) and ``pooling_params`` (a prefill-only
    pooling request, ``model.runner: pooling``) is set. ``arrival_time`` is Unix time in
    seconds; lower ``priority`` runs first under ``scheduler.policy: priority``.
    ``prediction_token_ids``: OpenAI Predicted Outputs, the tokenized prediction the engine
    proposes as this request's speculative draft (`pkgd.engine.spec_decode`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    prediction_token_ids: list[int] | None = None
    lora_request: LoRARequest | None = None


class AddRequest(Message, tag="add"):
    request: EngineCoreRequest


class AbortRequests(Message, tag="abort"):
    """Abort these requests (client gone, stop string hit, timeout); unknown ids are ignored."""

    request_ids: list[str]


UtilityMethod = Literal[
    "reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "add_lora", "remove_lora", "list_loras"
]


class UtilityRequest(Message, tag="utility"):
    """Call an `EngineCore` method between steps; the core answers `UtilityResult` with the
    same ``call_id``. ``args`` are the method's keyword arguments (``sleep``: ``level``;
    ``wake_up``: ``tags``)."""

    call_id: int
    method: UtilityMethod
    args: dict[str, Any] = msgspec.field(default_factory=dict)


class Shutdown(Message, tag="shutdown"):
    """Finish nothing more: abort everything and exit (the supervisor drains first)."""


# ---- engine core -> API server / supervisor -------------------------------------------


class Handshake(Message, tag="handshake"):
    """The engine core is loaded and serving; what a frontend needs to know about it.

    ``max_model_len`` is effective (tokens); ``num_kv_blocks`` × ``block_size`` is the KV
    capacity in tokens.
    """

    version: int
    engine_index: int
    pid: int
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    num_kv_blocks: int
    block_size: int
    runner: Literal["generate", "pooling"] = "generate"
    hidden_size: int = 0
    matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    # a sequence classifier's label names, one per output of its pooled vector; None for an
    # embedding model (its vector is a hidden state) or a generating one
    labels: list[str] | None = None
    # a cross-encoder's score pairs: tokenized as a text pair (true), or as one joined text
    use_sep_token: bool = True
    enable_sleep_mode: bool = False


class EngineCoreOutput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """New tokens of one request this step; ``finish_reason`` set on its last output.

    ``stop_reason`` is the stop token id that ended it, None for EOS/length.
    ``num_cached_tokens`` (prompt tokens hit in the prefix cache), ``queued_ts`` (when the
    engine core received the request) and ``scheduled_ts`` (when it was first scheduled) are
    sent with the first output, as Unix times in seconds of the engine's clock;
    ``num_preemptions`` (how often it lost its KV blocks) with the last. A pooling request has
    one output, its last, with ``pooling_output``: the pooled vector as little-endian float32
    bytes (4 x its dimensions) and no tokens. A request with a prediction gets, with every
    output, how many proposed prediction tokens verification has accepted and rejected so far.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    pooling_output: bytes | None = None
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    num_preemptions: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class SchedulerStats(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Engine gauges and counters for ``/metrics`` (vLLM's metric meanings).

    ``kv_cache_usage`` is the used fraction of KV blocks in [0, 1]; the prefix-cache and
    preemption counters are cumulative since the engine started, and so is the histogram of
    tokens per step: ``iteration_tokens_counts[i]`` steps with at most
    ``ITERATION_TOKENS_BUCKETS[i]`` tokens (and more than the bound before; the last entry
    counts the rest), ``iteration_tokens_sum`` their tokens. Speculative decoding (cumulative,
    vLLM's ``vllm:spec_decode_*``): proposals, proposed tokens, accepted tokens, and per
    proposal position how many proposals had that position accepted. LoRA (vLLM's
    ``vllm:lora_requests_info``): ``max_lora`` slots (0 = LoRA off), the names of the adapters
    of running and of waiting requests.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    iteration_tokens_counts: list[int] = msgspec.field(default_factory=list)
    iteration_tokens_sum: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    max_lora: int = 0
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)


class EngineOutputs(Message, tag="outputs"):
    """One step's outputs for the requests of one client, plus the engine's stats.

    ``timestamp`` is Unix time in seconds when the step finished.
    """

    engine_index: int
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


class EngineError(Message, tag="error"):
    """The engine core failed (load error, crash in a step, shutdown) or refused requests;
    ``request_ids`` get an error.

    ``rejected`` is True when the core refused these requests as invalid (the caller's
    fault, an HTTP 400), False when it failed to serve them (a 5xx). With no
    ``request_ids`` the error concerns the connection itself (e.g. a protocol version
    mismatch answering `Hello`).
    """

    engine_index: int
    message: str
    request_ids: list[str] = msgspec.field(default_factory=list)
    rejected: bool = False


class UtilityResult(Message, tag="utility_result"):
    """The answer to `UtilityRequest` ``call_id``: ``result`` (JSON-able), or ``error`` when
    the core refused the call (``error_status``: 400 bad arguments, 409 not now, e.g. requests
    still running)."""

    call_id: int
    engine_index: int
    result: Any = None
    error: str | None = None
    error_status: int = 0


class ApiServerReady(Message, tag="api_ready"):
    """An API server is accepting connections on its inherited socket(s)."""

    server_index: int
    pid: int


class ChildFailed(Message, tag="failed"):
    """A child could not start (model missing, bad address …); ``message`` is for the log.

    ``usage``: the configuration is at fault (`pkgd.config.errors.ModelConfigMismatch`), so
    the daemon exits 2 instead of 1.
    """

    role: str
    message: str
    usage: bool = False


ClientMessage = Hello | AddRequest | AbortRequests | UtilityRequest | Shutdown
EngineMessage = Handshake | EngineOutputs | EngineError | UtilityResult
ReadyMessage = Handshake | ApiServerReady | ChildFailed

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)
_ready_decoder = msgspec.msgpack.Decoder(ReadyMessage)


def encode(msg: Message) -> bytes:
    """msgpack bytes of one frame."""
    return _encoder.encode(msg)


def decode_client(data: bytes) -> ClientMessage:
    """Decode a frame sent to an engine core; raises `msgspec.DecodeError` on garbage."""
    return _client_decoder.decode(data)


def decode_engine(data: bytes) -> EngineMessage:
    """Decode a frame sent by an engine core; raises `msgspec.DecodeError` on garbage."""
    return _engine_decoder.decode(data)


def decode_ready(data: bytes) -> ReadyMessage:
    """Decode the one frame a child writes to its ready pipe."""
    return _ready_decoder.decode(data)
