"""`AsyncLLM.start` while the engine core loads: one info line saying it waits, no warning."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from pkgd.config.vllm_config import VllmConfig
from pkgd.frontend import async_llm
from pkgd.frontend.async_llm import AsyncLLM

from .fakes import FakeEngineClient

pytestmark = pytest.mark.anyio


class LoadingClient(FakeEngineClient):
    """An engine client whose core answers its handshake only after ``load_s`` seconds."""

    def __init__(self, sink, load_s: float) -> None:
        super().__init__(sink, lambda req: [])
        self.answer, self.handshake, self.load_s = self.handshake, None, load_s

    async def start(self, timeout: float = 0) -> bool:
        asyncio.get_running_loop().call_later(self.load_s, setattr, self, "handshake", self.answer)
        await asyncio.sleep(min(timeout, self.load_s))
        return self.handshake is not None

    def unavailable(self) -> list[str]:
        return [] if self.handshake else ["ipc:///loading"]


async def test_a_loading_engine_is_waited_for_without_a_warning(tokenizer, monkeypatch):
    monkeypatch.setattr(async_llm, "WAIT_NOTICE_S", 0.05)
    monkeypatch.setattr(async_llm, "ALL_CORES_WAIT_S", 0.1)
    llm = AsyncLLM(
        VllmConfig(), ["ipc:///loading"], tokenizer=tokenizer, client_factory=lambda sink: LoadingClient(sink, 0.4)
    )
    with structlog.testing.capture_logs() as logs:
        await llm.start(handshake_timeout=5)
    assert llm.is_ready()
    waiting = [e for e in logs if e["event"] == "waiting_for_engine"]
    assert len(waiting) == 1 and waiting[0]["log_level"] == "info"
    assert (
        waiting[0]["loading"] == ["ipc:///loading"] and waiting[0]["timeout_key"] == "supervisor.engine_ready_timeout"
    )
    assert [e for e in logs if e["log_level"] != "info"] == []


async def test_a_quick_engine_is_not_announced(tokenizer):
    llm = AsyncLLM(
        VllmConfig(), ["ipc:///x"], tokenizer=tokenizer, client_factory=lambda sink: LoadingClient(sink, 0.0)
    )
    with structlog.testing.capture_logs() as logs:
        await llm.start(handshake_timeout=5)
    assert llm.is_ready() and not [e for e in logs if e["event"] == "waiting_for_engine"]


async def test_an_engine_that_never_answers_times_out(tokenizer):
    llm = AsyncLLM(VllmConfig(), ["ipc:///x"], tokenizer=tokenizer, client_factory=lambda sink: LoadingClient(sink, 60))
    with pytest.raises(TimeoutError, match="no engine core answered within 1 s"):
        await llm.start(handshake_timeout=1)


@pytest.mark.parametrize("converted", [True, False])
async def test_the_tokenizer_loads_while_the_engine_does_once_the_model_is_converted(tokenizer, monkeypatch, converted):
    """A model already resolvable (converted by an earlier start) has its tokenizer read while
    the engine core loads; a GGUF's first conversion is left to the engine and the tokenizer
    is read after its handshake (this process never converts)."""
    from pkgd.model_files.resolve import NotConverted

    client: list[LoadingClient] = []
    calls: list[tuple[bool, bool]] = []  # (convert, engine answered yet)

    def load(config, *, convert=True):
        calls.append((convert, client[0].handshake is not None))
        if not convert and not converted:
            raise NotConverted("cold cache")
        return tokenizer, {}

    def factory(sink):
        client.append(LoadingClient(sink, 0.5))
        return client[0]

    monkeypatch.setattr(async_llm, "load_frontend_model", load)
    llm = AsyncLLM(VllmConfig(), ["ipc:///loading"], client_factory=factory)
    await llm.start(handshake_timeout=5)
    assert llm.is_ready() and llm.tokenizer is tokenizer
    assert calls == ([(False, False)] if converted else [(False, False), (True, True)])
