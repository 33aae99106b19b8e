"""Seeded requests repeat exactly (docs/reproducibility.md), on a tiny random bf16 Llama.

By default a seeded request takes no prefix-cache hit, so alone it repeats with its prefix
cached or not (a hit leaving a one-token suffix runs the decode kernels, whose bits differ
from the prefill's). With ``model.batch_invariant`` it repeats whatever shares its batch and
whatever is cached, and so do greedy requests.
"""

from __future__ import annotations

import pytest
import torch

from pkgd import LLM, SamplingParams

pytestmark = pytest.mark.slow
VOCAB = 2000
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
OTHER = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.runner.tiny_models import build_tiny

    out = tmp_path_factory.mktemp("tiny-repro")
    build_tiny(
        "llama",
        out,
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    return str(out)


def _prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, VOCAB, (64,), generator=g).tolist()
    # 65 tokens: a second run finds 64 cached and computes one token
    target = shared + torch.randint(0, VOCAB, (1,), generator=g).tolist()
    others = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 40, 90)]
    return target, others


def _run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def _seen(out):
    c = out.outputs[0]
    return c.token_ids, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]


def _llm(tiny, **kw):
    return LLM(tiny, dtype="bfloat16", num_blocks=256, block_size=16, enable_prefix_caching=True, **kw)


def test_a_seeded_request_alone_repeats_with_its_prefix_cached(tiny):
    target, _ = _prompts()
    with _llm(tiny) as llm:
        first = _run(llm, [target], SEEDED)[0]
        again = _run(llm, [target], SEEDED)[0]
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 0  # seeded: no hits taken
        assert _seen(again) == _seen(first)
        # unseeded requests still take hits (caching is on)
        _run(llm, [target], GREEDY)
        assert _run(llm, [target], GREEDY)[0].num_cached_tokens == 64


def test_batch_invariant_repeats_whatever_the_batch_and_the_cache(tiny):
    target, others = _prompts()
    with _llm(tiny, batch_invariant=True) as llm:
        for params in (SEEDED, GREEDY):
            alone = _run(llm, [target], params)[0]
            cached = _run(llm, [target], params)[0]
            mixed = _run(llm, [*others, target], [OTHER] * len(others) + [params])[-1]
            assert cached.num_cached_tokens == 64
            assert _seen(cached) == _seen(alone) and _seen(mixed) == _seen(alone)
        # the same request in another batch position, with others mid-decode
        late = _run(llm, [target, *others], [SEEDED] + [OTHER] * len(others))[0]
        assert _seen(late) == _seen(_run(llm, [target], SEEDED)[0])
