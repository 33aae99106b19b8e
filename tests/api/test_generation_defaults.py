"""Sampling defaults: the request's own value, then model.generation, then the file of
model.generation_config, then vLLM's."""

from __future__ import annotations

import pytest

from pkgd.config.vllm_config import VllmConfig

from .conftest import served

pytestmark = pytest.mark.anyio


async def test_generation_config_file_defaults_are_below_config_and_request(tokenizer):
    cfg = VllmConfig.model_validate({"model": {"generation": {"temperature": 0.0}}})
    async with served(tokenizer, config=cfg) as (http, state, fake):
        state.llm.generation_defaults = {"max_tokens": 3, "temperature": 0.7, "top_k": 5}
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.json()["usage"]["completion_tokens"] == 3
        sp = fake.added[-1].sampling_params
        assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.0, 5, 3)  # model.generation beats the file
        await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "top_k": 9})
        sp = fake.added[-1].sampling_params
        assert (sp.top_k, sp.max_tokens) == (9, 2)
