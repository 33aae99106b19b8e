"""The server's per-step output batching: one engine step's outputs for many streams (one
`EngineOutputs` frame) become exactly one SSE event per stream, written as one body message,
holding every token that step gave the stream (speculative decoding gives several); a step
without text for a stream sends it nothing."""

from __future__ import annotations

import asyncio
import json

import pytest

from pkgd.ipc.messages import EngineCoreOutput, EngineOutputs, FinishReason

from .conftest import served
from .fakes import EOS

pytestmark = pytest.mark.anyio
STREAMS = 8


class BodyCounter:
    """ASGI middleware counting the ``http.response.body`` messages of each request path."""

    def __init__(self, app) -> None:
        self.app = app
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        async def counting(message):
            if message["type"] == "http.response.body" and message.get("body"):
                self.bodies.append(message["body"])
            await send(message)

        await self.app(scope, receive, counting)


async def test_one_step_for_many_streams_is_one_event_and_one_write_per_stream(tokenizer):
    async with served(tokenizer) as (http, state, fake):
        held: list = []
        fake.add_requests = lambda requests: held.extend(requests) or 0  # the test plays the steps
        counter = BodyCounter(http._transport.app)
        http._transport.app = counter
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 16, "stream": True}

        async def stream() -> list[dict]:
            events = []
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            return events

        tasks = [asyncio.ensure_future(stream()) for _ in range(STREAMS)]
        for _ in range(200):
            if len(held) == STREAMS:
                break
            await asyncio.sleep(0.01)
        assert len(held) == STREAMS
        words = tokenizer.encode(" one two three four five", add_special_tokens=False)
        steps = [words[:3], words[3:4], [], words[4:]]  # three tokens in one step, then one, none, the rest
        for i, ids in enumerate(steps):
            last = i == len(steps) - 1
            outs = [
                EngineCoreOutput(
                    request_id=r.request_id,
                    new_token_ids=ids + ([EOS] if last else []),
                    finish_reason=FinishReason.STOP if last else None,
                )
                for r in held
            ]
            state.llm.on_outputs(EngineOutputs(engine_index=0, outputs=outs, scheduler_stats=None))
            await asyncio.sleep(0.05)  # every stream writes before the next step
        results = await asyncio.gather(*tasks)
    want = [tokenizer.decode(ids) for ids in steps if ids]
    for events in results:
        texts = [e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["text"]]
        assert texts == want, texts  # one event per step with text, all of that step's tokens in it
        assert (
            events[-1]["choices"][0]["finish_reason"] == "stop" or events[-2]["choices"][0]["finish_reason"] == "stop"
        )
    events_per_stream = len(results[0]) + 1  # + [DONE]
    assert all(len(r) + 1 == events_per_stream for r in results)
    assert len(counter.bodies) == STREAMS * events_per_stream  # one write per event
    assert all(b.count(b"data: ") == 1 for b in counter.bodies)
