"""Fixtures for the app tests: the real SmolLM2 tokenizer and an app whose engine is the
in-process `FakeEngineClient` (the behaviour under test is the app's)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from pkgd import log
from pkgd.config.vllm_config import VllmConfig

from .fakes import EOS, FakeEngineClient

ANSWER = "The capital of France is Paris."


@pytest.fixture(autouse=True, scope="session")
def _json_logs():
    log.configure(role="test")


@pytest.fixture(scope="session")
def tokenizer():
    pytest.importorskip("pkgd.frontend.tokenizer", reason="the engine's frontend is not merged yet")
    pytest.importorskip("pkgd.model_files.resolve", reason="the runner's model resolver is not merged yet")
    from pkgd.frontend.async_llm import load_frontend_tokenizer

    return load_frontend_tokenizer(VllmConfig())


@pytest.fixture
def anyio_backend():
    return "asyncio"


def answer_script(tokenizer, text: str = ANSWER) -> Callable:
    ids = tokenizer.encode(text, add_special_tokens=False) + [EOS]
    return lambda req: ids


@contextlib.asynccontextmanager
async def served(
    tokenizer, *, config: VllmConfig | None = None, script: Callable | None = None, runner: str = "generate"
) -> AsyncIterator:
    """(httpx client on the app, ServerState, FakeEngineClient)."""
    from pkgd.api.app import build_app
    from pkgd.api.state import ServerState
    from pkgd.frontend.async_llm import AsyncLLM
    from pkgd.frontend.metrics import EngineStatsCollector, Metrics, cache_config_labels

    config = config or VllmConfig()
    fakes: list[FakeEngineClient] = []

    def factory(sink):
        fakes.append(FakeEngineClient(sink, script or answer_script(tokenizer), runner=runner))
        return fakes[0]

    llm = AsyncLLM(config, ["ipc:///unused"], tokenizer=tokenizer, client_factory=factory)
    await llm.start(handshake_timeout=1)
    state = ServerState(config, llm, Metrics("SmolLM2-135M-Instruct", max_model_len=2048))
    llm.metrics = state.metrics
    state.engine_collector = EngineStatsCollector(
        "SmolLM2-135M-Instruct", llm.client.engine_info, cache_config_labels(config)
    )
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http, state, fakes[0]
    await llm.close()


def count_validations(monkeypatch, model) -> list[int]:
    """A list that grows by one each time ``model.model_validate`` runs (the call goes on)."""
    validated: list[int] = []
    original = model.model_validate.__func__
    monkeypatch.setattr(
        model, "model_validate", classmethod(lambda cls, d, **kw: validated.append(1) or original(cls, d, **kw))
    )
    return validated
