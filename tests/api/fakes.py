"""A test double for `pkgd.ipc.client.EngineClient`: an in-process engine that "generates" a
scripted token sequence, so the app's behaviour can be checked without a model. With
``runner="pooling"`` it answers pooling requests with `fake_vector` (a function of the prompt).

Token rule: a request generates ``script(request)`` one token per event-loop turn, stopping
at ``max_tokens`` ("length"), at EOS unless ``ignore_eos``, or at a ``stop_token_ids`` token
("stop"). Logprobs are made up but well formed: the sampled token has rank 1 and logprob
-0.1, alternatives ``tok+1 … tok+k`` get -1, -2, ….
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable

from pkgd.ipc.client import EngineRequestError, EngineUnavailableError
from pkgd.ipc.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineOutputs,
    FinishReason,
    Handshake,
    SchedulerStats,
    UtilityResult,
)
from pkgd.logprobs import TokenLogprobs

EOS = 2
MAX_MODEL_LEN = 2048
VOCAB = 49152


def _entry(tok: int, k: int) -> TokenLogprobs:
    ids = [tok] + [(tok + j) % VOCAB for j in range(1, k + 1)]
    return TokenLogprobs(ids, [-0.1] + [-float(j) for j in range(1, k + 1)], 1)


HIDDEN = 8


def fake_vector(prompt: list[int], dimensions: int | None = None) -> list[float]:
    """The fake engine's "embedding" of a prompt (exact in float32)."""
    return [float(len(prompt) + i) / 4 for i in range(dimensions or HIDDEN)]


class FakeEngineClient:
    def __init__(self, sink, script: Callable[[EngineCoreRequest], list[int]], *, runner: str = "generate") -> None:
        self.sink = sink
        self.script = script
        self.available = True
        self.handshake = Handshake(
            version=1,
            engine_index=0,
            pid=0,
            model_name="SmolLM2-135M-Instruct",
            max_model_len=MAX_MODEL_LEN,
            vocab_size=VOCAB,
            eos_token_id=EOS,
            num_kv_blocks=128,
            block_size=16,
            runner=runner,
            hidden_size=HIDDEN,
            matryoshka=True,
        )
        self.utility_calls: list[tuple[str, dict]] = []
        self.utility_answers: dict[str, UtilityResult] = {}  # method -> answer (default: result None)
        self.added: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.fail: dict[str, EngineRequestError] = {}  # engine request id -> error after 1 token
        self.delay = 0.0
        self.gate: asyncio.Event | None = None  # set: generation waits for it before the first token
        self._tasks: dict[str, asyncio.Task] = {}

    async def start(self, timeout: float = 0) -> bool:
        return True

    async def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()

    def is_available(self) -> bool:
        return self.available

    def engine_stats(self) -> dict[int, SchedulerStats]:
        return {0: SchedulerStats(num_running_reqs=len(self._tasks), kv_cache_usage=0.25)}

    def engine_info(self):
        return {0: (self.handshake, self.engine_stats()[0])}

    def num_inflight(self) -> int:
        return len(self._tasks)

    def add_requests(self, requests) -> int:
        if not self.available:
            raise EngineUnavailableError("no engine core is available (fake)")
        for req in requests:
            self.added.append(req)
            self._tasks[req.request_id] = asyncio.ensure_future(self._run(req))
        return 0

    def abort_requests(self, ids) -> None:
        for rid in ids:
            task = self._tasks.pop(rid, None)
            if task is not None:
                self.aborted.append(rid)
                task.cancel()

    async def call_utility(
        self, method: str, args: dict | None = None, *, timeout: float = 600.0
    ) -> list[UtilityResult]:
        self.utility_calls.append((method, dict(args or {})))
        return [self.utility_answers.get(method, UtilityResult(call_id=0, engine_index=0))]

    async def _run(self, req: EngineCoreRequest) -> None:
        if req.pooling_params is not None:
            await asyncio.sleep(self.delay)
            vec = struct.pack(f"<{HIDDEN}f", *fake_vector(req.prompt_token_ids))[
                : 4 * (req.pooling_params.dimensions or HIDDEN)
            ]
            self._tasks.pop(req.request_id, None)
            out = EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[], finish_reason=FinishReason.STOP, pooling_output=vec
            )
            self.sink.on_outputs(EngineOutputs(engine_index=0, outputs=[out], scheduler_stats=None))
            return
        sp = req.sampling_params
        tokens = self.script(req)
        if self.gate is not None:
            await self.gate.wait()
        for i, tok in enumerate(tokens):
            await asyncio.sleep(self.delay)
            if req.request_id in self.fail and i == 1:
                self._tasks.pop(req.request_id, None)
                self.sink.on_request_error([req.request_id], self.fail[req.request_id])
                return
            finish = None
            if (tok == req.eos_token_id and not sp.ignore_eos) or tok in sp.stop_token_ids:
                finish = FinishReason.STOP
            elif i + 1 >= (sp.max_tokens or len(tokens)) or i + 1 == len(tokens):
                finish = FinishReason.LENGTH
            now = time.time()
            out = EngineCoreOutput(
                request_id=req.request_id,
                new_token_ids=[tok],
                finish_reason=finish,
                queued_ts=now - 0.002 if i == 0 else 0.0,
                scheduled_ts=now - 0.001 if i == 0 else 0.0,
                new_logprobs=[_entry(tok, sp.logprobs)] if sp.logprobs is not None else None,
                new_prompt_logprobs=(
                    [None] + [_entry(t, sp.prompt_logprobs) for t in req.prompt_token_ids[1:]]
                    if i == 0 and sp.prompt_logprobs is not None
                    else None
                ),
            )
            if finish is not None:
                self._tasks.pop(req.request_id, None)
            self.sink.on_outputs(EngineOutputs(engine_index=0, outputs=[out], scheduler_stats=None, timestamp=now))
            if finish is not None:
                return
