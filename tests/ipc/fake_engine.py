"""A small deterministic stand-in for `pkgd.engine.core.EngineCore`, and a process entry
that serves it through the real `pkgd.engine.core_proc` loop.

Token rule: a request's k-th generated token (k = 0, 1, ...) is
``(prompt_token_ids[-1] + 1 + k) % VOCAB``; one token per request per step; a request
finishes with "length" after ``max_tokens`` tokens, or "stop" when it produces EOS
(``eos_token_id``) unless ``ignore_eos``. A prompt whose first token is ``CRASH_TOKEN``
makes the next step raise (an engine crash).

Run as a script it behaves like ``python -m pkgd.engine.core_proc`` (same arguments);
``FAKE_LOAD_SECONDS`` delays loading, ``FAKE_STEP_SECONDS`` slows each step, and
``FAKE_VOCAB`` / ``FAKE_MAX_MODEL_LEN`` change the reported model (e.g. SmolLM2's 49152 /
8192, to put a real API server in front of it for a frontend benchmark).
"""

from __future__ import annotations

import os
import sys
import time

from pkgd.ipc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, SchedulerStats
from pkgd.logprobs import TokenLogprobs

VOCAB = int(os.environ.get("FAKE_VOCAB", "1000"))
MAX_MODEL_LEN = int(os.environ.get("FAKE_MAX_MODEL_LEN", "256"))
CRASH_TOKEN = 999


class FakeEngineCore:
    def __init__(self, config=None, engine_index: int = 0, *, step_seconds: float = 0.0) -> None:
        self.engine_index = engine_index
        self.step_seconds = step_seconds
        self.requests: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self.aborted: list[str] = []
        self.num_steps = 0

    def handshake_info(self) -> dict:
        return {
            "model_name": "fake-model",
            "max_model_len": MAX_MODEL_LEN,
            "vocab_size": VOCAB,
            "eos_token_id": 0,
            "num_kv_blocks": 64,
            "block_size": 16,
        }

    def add_request(self, req: EngineCoreRequest) -> None:
        max_tokens = req.sampling_params.max_tokens or 1
        if len(req.prompt_token_ids) + max_tokens > MAX_MODEL_LEN:
            raise ValueError(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({MAX_MODEL_LEN})"
            )
        self.requests[req.request_id] = (req, [])

    def abort_requests(self, ids) -> None:
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.requests), kv_cache_usage=min(1.0, len(self.requests) / 64))

    def step(self) -> list[EngineCoreOutput]:
        self.num_steps += 1
        if self.step_seconds:
            time.sleep(self.step_seconds)
        outputs = []
        for rid, (req, generated) in list(self.requests.items()):
            if req.prompt_token_ids[0] == CRASH_TOKEN:
                raise RuntimeError("fake engine crash")
            sp = req.sampling_params
            tok = (req.prompt_token_ids[-1] + 1 + len(generated)) % VOCAB
            generated.append(tok)
            finish = None
            if tok == req.eos_token_id and not sp.ignore_eos:
                finish = FinishReason.STOP
            elif len(generated) >= (sp.max_tokens or 1):
                finish = FinishReason.LENGTH
            logprobs = None
            if sp.logprobs is not None:
                top = [tok] + [(tok + j) % VOCAB for j in range(1, sp.logprobs + 1)]
                logprobs = [TokenLogprobs(top, [-0.5 * j for j in range(len(top))], 1)]
            outputs.append(
                EngineCoreOutput(request_id=rid, new_token_ids=[tok], new_logprobs=logprobs, finish_reason=finish)
            )
            if finish is not None:
                del self.requests[rid]
        return outputs

    # utility calls (the real core's names and refusals)
    def reset_prefix_cache(self) -> bool:
        return not self.requests

    def sleep(self, level: int = 1) -> None:
        from pkgd.engine.errors import EngineBusyError

        if self.requests:
            raise EngineBusyError(f"{len(self.requests)} requests are still running")
        self.sleeping = level

    def is_sleeping(self) -> bool:
        return bool(getattr(self, "sleeping", 0))

    def shutdown(self) -> None:
        pass


def _factory(config, engine_index: int) -> FakeEngineCore:
    time.sleep(float(os.environ.get("FAKE_LOAD_SECONDS", "0")))
    return FakeEngineCore(config, engine_index, step_seconds=float(os.environ.get("FAKE_STEP_SECONDS", "0")))


if __name__ == "__main__":
    from pkgd.engine import core_proc

    sys.exit(core_proc.main(core_factory=_factory))
