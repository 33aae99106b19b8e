"""Pooling models (``model.runner: pooling``): pkgd's pooled vectors match transformers' hidden
states (``last_hidden_state``, after the final norm) on tiny random Qwen3 / Llama checkpoints,
fp32, <= 1e-4; through the offline `LLM` and its in-process engine (scheduler, paged KV cache,
chunked prefill, continuous batching, prefix cache)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pkgd import LLM
from pkgd.pooling_params import PoolingParams

TOL = 1e-4
LENGTHS = [1, 5, 13, 24, 7]


def _prompts(seed: int = 0, lengths=LENGTHS, vocab: int = 160) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _hidden(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).last_hidden_state[0]


def _pool(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    return {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[kind]


def _llm(model_dir, pooling_type="last", normalize=False, **kw) -> LLM:
    opts = {"model.pooler.pooling_type": pooling_type, "model.pooler.normalize": normalize, "num_blocks": 64, **kw}
    return LLM(str(model_dir), runner="pooling", dtype="float32", block_size=4, **opts)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_vectors_match_transformers(tiny_dirs, arch, kind, cpu_path):
    """Five prompts of 1-24 tokens in one batch, prefilled in chunks of at most 8 tokens a step
    (mean pooling accumulates over the chunks)."""
    model_dir, hf = tiny_dirs(arch)
    llm = _llm(model_dir, kind, max_num_seqs=4, max_num_batched_tokens=8)
    prompts = _prompts()
    outs = llm.encode(prompts, use_tqdm=False)
    for tokens, out in zip(prompts, outs, strict=True):
        want = _pool(_hidden(hf, tokens), kind)
        got = out.outputs.data
        assert got.dtype == torch.float32 and got.shape == (64,)
        assert (got - want).abs().max().item() <= TOL
        assert out.prompt_token_ids == tokens and out.finished
    # Prefill only, nothing kept: every block went back to the pool at once.
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.usage == 0.0


def test_normalise_and_matryoshka_dimensions(tiny_dirs):
    model_dir, hf = tiny_dirs("qwen3")
    llm = _llm(model_dir, normalize=True, **{"model.pooler.matryoshka": True})
    tokens = _prompts(1)[2]
    last = _hidden(hf, tokens)[-1]
    full, cut, raw = llm.embed(
        [tokens] * 3,
        [PoolingParams(), PoolingParams(dimensions=16), PoolingParams(dimensions=16, normalize=False)],
        use_tqdm=False,
    )
    assert (torch.tensor(full.outputs.embedding) - F.normalize(last, dim=0)).abs().max() <= TOL
    assert cut.outputs.hidden_size == 16  # truncated first, then normalised (vLLM's order)
    assert (torch.tensor(cut.outputs.embedding) - F.normalize(last[:16], dim=0)).abs().max() <= TOL
    assert (torch.tensor(raw.outputs.embedding) - last[:16]).abs().max() <= TOL


def test_dimensions_refused_unless_the_model_is_matryoshka(tiny_dirs):
    model_dir, _ = tiny_dirs("qwen3")
    llm = _llm(model_dir)
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed([[1, 2, 3]], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="at most the model's hidden size 64"):
        _llm(model_dir, **{"model.pooler.matryoshka": True}).embed(
            [[1, 2]], PoolingParams(dimensions=65), use_tqdm=False
        )


def test_batched_steps_and_prefix_cache(tiny_dirs):
    """Eight prompts share steps (continuous batching); a repeated prompt is served from the
    prefix cache under last-token pooling and still equals transformers."""
    model_dir, hf = tiny_dirs("llama")
    llm = _llm(model_dir)
    steps = []
    inner = llm.engine.model_runner.execute_model
    llm.engine.model_runner.execute_model = lambda so: steps.append(len(so.num_scheduled_tokens)) or inner(so)
    prompts = _prompts(2, [12] * 8)
    first = llm.encode(prompts, use_tqdm=False)
    assert max(steps) == 8 and len(steps) == 1
    again = llm.encode(prompts[:1], use_tqdm=False)[0]
    assert again.num_cached_tokens == 8  # two full blocks of 4; the last token is recomputed
    want = _hidden(hf, prompts[0])[-1]
    for out in (first[0], again):
        assert (out.outputs.data - want).abs().max() <= TOL


def test_mean_pooling_takes_no_prefix_hits(tiny_dirs):
    model_dir, hf = tiny_dirs("qwen3")
    llm = _llm(model_dir, "mean")
    tokens = _prompts(3, [17])[0]
    llm.encode([tokens], use_tqdm=False)
    out = llm.encode([tokens], use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert (out.outputs.data - _hidden(hf, tokens).mean(dim=0)).abs().max() <= TOL


def test_generation_and_pooling_are_refused_across_runners(tiny_dirs):
    model_dir, _ = tiny_dirs("qwen3")
    with pytest.raises(ValueError, match="does not generate"):
        _llm(model_dir).generate([[1, 2, 3]], use_tqdm=False)
    gen = LLM(str(model_dir), dtype="float32", num_blocks=64)
    with pytest.raises(ValueError, match="pooling model"):
        gen.embed([[1, 2, 3]], use_tqdm=False)


def test_base_model_checkpoint_without_lm_head_loads(tiny_dirs, tmp_path):
    """Qwen3-Embedding's layout: tensors saved from the base model (``layers.0...``, no
    ``model.`` prefix, no ``lm_head``)."""
    from safetensors.torch import save_file

    src, hf = tiny_dirs("qwen3")
    for f in src.glob("*.json"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    state = {k: v.contiguous() for k, v in hf.model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    tokens = _prompts(4, [9])[0]
    out = _llm(tmp_path).encode([tokens], use_tqdm=False)[0]
    assert (out.outputs.data - _hidden(hf, tokens)[-1]).abs().max() <= TOL
