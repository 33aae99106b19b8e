"""A drain deadline's cut reaches a lagging stream at once: `AsyncLLM.abort_all` puts the error
ahead of the outputs its consumer has not taken yet (a client reading slower than the engine
generates would otherwise get the error only after its whole backlog, past the close grace,
and be cut without it)."""

from __future__ import annotations

import asyncio

import pytest

from pkgd.frontend.async_llm import RequestStream
from pkgd.ipc.client import EngineRequestError

from .conftest import served


def test_fail_now_puts_the_error_before_the_backlog():
    async def main():
        stream = RequestStream("r", ["r-0"], 3)
        for i in range(50):
            stream.put(f"output {i}")
        assert await stream.get() == "output 0"
        stream.fail_now(EngineRequestError("cut"))
        with pytest.raises(EngineRequestError, match="cut"):
            await stream.get()

    asyncio.run(main())


@pytest.mark.anyio
async def test_abort_all_cuts_a_lagging_stream_next(tokenizer):
    async with served(tokenizer) as (_http, state, _fake):
        llm = state.llm
        stream = RequestStream("lagging", [], 3)
        for i in range(50):
            stream.put(f"output {i}")
        llm._streams["lagging"] = stream
        llm.abort_all("the server is shutting down (supervisor.drain_timeout passed)")
        with pytest.raises(EngineRequestError, match="shutting down"):
            await stream.get()
        assert "lagging" not in llm._streams
