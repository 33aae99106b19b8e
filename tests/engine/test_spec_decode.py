"""Speculative decoding through a real `EngineCore` on tiny random models: greedy output equal
to the output without speculation (batches mixing speculating and plain requests, chunked
prefill, prefix hits, preemption, structured outputs), proposal bookkeeping and counters."""

from __future__ import annotations

import pytest
import torch
from tests.runner.tiny_models import build_tiny

from pkgd.config.vllm_config import VllmConfig
from pkgd.engine.core import EngineCore
from pkgd.engine.spec_decode import ngram_propose, prediction_propose
from pkgd.ipc.messages import EngineCoreRequest
from pkgd.sampling_params import SamplingParams

# Prompts with repeats, so n-gram lookup finds proposals from the first step on.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 9],
    [20, 21, 22, 23, 24, 20, 21, 22, 23, 24, 20, 21],
    list(range(30, 70)) + list(range(30, 60)),
    [1, 2, 3],
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-llama")
    build_tiny("llama", d)
    return d


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(model_dir, speculative=None, **sections) -> EngineCore:
    cfg = VllmConfig(
        model={
            "source": str(model_dir),
            "dtype": "float32",
            "max_model_len": sections.pop("max_model_len", 256),
            "tokenizer": sections.pop("tokenizer", None),
        },
        cache={"num_blocks": sections.pop("num_blocks", 64), "block_size": 4},
        parallel={"cpu_threads": 1},
        speculative=speculative or {},
        **sections,
    )
    return EngineCore(cfg)


def run(engine: EngineCore, prompts, max_tokens=24, *, predictions=None, **sp) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=sp.get("temperature", 0.0), ignore_eos=True)
        pred = predictions[i] if predictions else None
        engine.add_request(
            EngineCoreRequest(
                request_id=f"r{i}", prompt_token_ids=list(p), sampling_params=params, prediction_token_ids=pred
            )
        )
        out[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_ngram_lookup_takes_the_latest_longest_match():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 1, 3, 2) == [7, 1]
    assert ngram_propose([1, 2, 3, 4], 1, 3, 2) == []
    assert ngram_propose([4, 5, 6, 4], 1, 1, 3) == [5, 6, 4]
    assert ngram_propose([7, 7, 7, 7], 1, 1, 3) == [7, 7, 7]  # a loop: the earliest occurrence
    assert ngram_propose([4, 5, 6, 4], 2, 2, 3) == []


def test_prediction_proposals_follow_the_output_realigned():
    pred = [10, 11, 12, 13, 14, 15]
    assert prediction_propose(pred, [], 3) == [10, 11, 12]
    assert prediction_propose(pred, [99, 12], 3) == [13, 14, 15]
    assert prediction_propose([1, 2, 1, 3, 1, 4], [9, 9, 9, 9, 1], 1) == [4]  # the occurrence nearest position 5
    assert prediction_propose(pred, [7], 3) == []


def test_greedy_ngram_equals_no_speculation_and_counts_acceptance(tiny_llama):
    want = run(make_engine(tiny_llama), PROMPTS)
    engine = make_engine(tiny_llama, NGRAM)
    got = run(engine, PROMPTS)
    assert got == want
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_accepted_per_pos[0] >= stats.spec_decode_accepted_per_pos[-1]
    assert sum(stats.spec_decode_accepted_per_pos) == stats.spec_decode_num_accepted_tokens


def test_greedy_equal_with_chunked_prefill_prefix_hits_and_preemption(tiny_llama):
    prompts = PROMPTS + [PROMPTS[2][:40] + [7, 7, 7]]  # shares 10 blocks with prompt 2: a prefix hit
    base = dict(scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 8, "long_prefill_token_threshold": 8})
    want = run(make_engine(tiny_llama, **base), prompts, max_tokens=40)
    engine = make_engine(tiny_llama, NGRAM, num_blocks=30, max_model_len=120, **base)  # tight: preempts
    got = run(engine, prompts, max_tokens=40)
    assert got == want
    assert engine.stats().prefix_cache_hits > 0
    assert engine.stats().num_preemptions > 0
    assert engine.stats().spec_decode_num_accepted_tokens > 0


def test_prediction_drafts_without_a_speculative_config(tiny_llama):
    want = run(make_engine(tiny_llama), PROMPTS[:2])
    engine = make_engine(tiny_llama)
    outs: dict[str, list] = {}
    # r0 predicts its own output exactly, r1 with 5 tokens wrong
    preds = [want["r0"], want["r1"][:8] + [3] * 5 + want["r1"][13:]]
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(
            EngineCoreRequest(
                request_id=f"r{i}",
                prompt_token_ids=p,
                sampling_params=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                prediction_token_ids=preds[i],
            )
        )
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finals[o.request_id] = o
    assert outs == want
    # steps after the prefill propose 8, 8 and the 4 that max_tokens leaves: all accepted
    assert finals["r0"].accepted_prediction_tokens == 20
    assert finals["r0"].rejected_prediction_tokens == 0
    assert finals["r1"].accepted_prediction_tokens > 0
    assert finals["r1"].rejected_prediction_tokens > 0


@pytest.mark.slow  # compiles a grammar for a 49k vocabulary
def test_structured_output_masks_every_verified_position(tmp_path):
    """A tiny model with SmolLM2's vocabulary under a JSON schema: with n-gram proposals the
    greedy output is the one without (a proposal the grammar rejects is cut, each verified
    position is masked with the grammar advanced over the proposals before it)."""
    from tests.smollm2 import smollm2_gguf

    from pkgd.sampling_params import StructuredOutputsParams

    build_tiny("llama", tmp_path, vocab_size=49152)
    schema = {"type": "array", "items": {"enum": [11, 22, 333]}, "minItems": 14, "maxItems": 14}
    so = StructuredOutputsParams(json=schema)

    def run_so(speculative):
        engine = make_engine(tmp_path, speculative, tokenizer=str(smollm2_gguf()))
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate([[5, 6, 7], [8, 9, 10, 11]]):
            sp = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=so)
            engine.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=sp))
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out, engine.stats()

    want, _ = run_so(None)
    got, stats = run_so(NGRAM)
    assert got == want
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_draft_model_greedy_equals_no_speculation(tiny_llama, tmp_path):
    """A smaller random Llama of the same vocabulary as the draft (its own KV cache in the
    target's blocks); and the target itself as its own draft, whose proposals are all kept."""
    small = tmp_path / "draft"
    build_tiny("llama", small, seed=3, hidden_size=32, intermediate_size=48, num_hidden_layers=1)
    base = dict(scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 8, "long_prefill_token_threshold": 8})
    want = run(make_engine(tiny_llama, **base), PROMPTS, max_tokens=30)
    for draft in (small, tiny_llama):
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        engine = make_engine(tiny_llama, spec, **base)
        assert run(engine, PROMPTS, max_tokens=30) == want
        stats = engine.stats()
        assert stats.spec_decode_num_drafts > 0
        if draft == tiny_llama:
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    build_tiny("llama", tmp_path, vocab_size=96)
    with pytest.raises(ValueError, match="speculative.model: .* vocabulary of 96 tokens"):
        make_engine(tiny_llama, {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})


def test_greedy_with_penalties_sees_kept_proposals_as_outputs(tiny_llama):
    """Penalties at verified position j count proposals 0..j-1 as outputs, as the plain run does."""

    def run_penalised(engine):
        out: dict[str, list[int]] = {}
        for i, p in enumerate(PROMPTS):
            sp = SamplingParams(
                max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=0.05, repetition_penalty=1.02
            )
            engine.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=p, sampling_params=sp))
            out[f"r{i}"] = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        return out

    want = run_penalised(make_engine(tiny_llama))
    engine = make_engine(tiny_llama, NGRAM)
    assert run_penalised(engine) == want
    assert engine.stats().spec_decode_num_accepted_tokens > 0
