"""A tiny Gemma 2 (soft-caps, local/global layers, GeGLU) served end to end: an engine-core
process and an API-server process started as the supervisor starts them, a GGUF written as
llama.cpp writes it (float32 tensors, so the weights are transformers' own), driven by the
official ``openai`` client; the greedy completion equals transformers' ``generate``."""

from __future__ import annotations

import pytest
import torch
from tests.runner.tiny_gguf import write_gguf
from tests.runner.tiny_models import build_tiny

from pkgd.config.vllm_config import VllmConfig

from .test_serving_e2e import Daemon

pytestmark = pytest.mark.slow
PROMPT = list(range(3, 22))  # 19 tokens: past the 8-token window of the local layers


def test_tiny_gemma2_serves_transformers_greedy_tokens(tmp_path):
    hf = build_tiny("gemma2", tmp_path / "hf", query_pre_attn_scalar=16)  # llama.cpp's scale
    path = write_gguf(hf, tmp_path / "tiny-gemma2.F32.gguf")
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    want_ids = want[0, len(PROMPT) :].tolist()
    config = VllmConfig.model_validate(
        {"model": {"source": str(path), "max_model_len": 128, "cache_dir": str(tmp_path / "cache")}}
    )
    daemon = Daemon(tmp_path / "serve", config=config)
    try:
        client = daemon.client()
        (model,) = [m.id for m in client.models.list().data]
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 6
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(next((tmp_path / "cache").rglob("tokenizer.json")).parent)
        assert r.choices[0].text == tok.decode(want_ids)
    finally:
        daemon.stop()
