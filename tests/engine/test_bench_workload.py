"""Workloads of pkgd bench throughput."""

import pytest

from pkgd.benchmarks.throughput import make_workload


def test_random_workload_has_the_asked_lengths_and_no_special_tokens(smollm2_tokenizer):
    w = make_workload(num_prompts=20, input_len=32, output_len=8, vocab_size=49152, tokenizer=smollm2_tokenizer, seed=3)
    assert [len(p) for p in w.prompts] == [32] * 20 and w.output_lens == [8] * 20
    special = set(smollm2_tokenizer.all_special_ids)
    assert not any(t in special for p in w.prompts for t in p)
    assert len({tuple(p[:4]) for p in w.prompts}) == 20  # no shared prefixes
    assert w == make_workload(
        num_prompts=20, input_len=32, output_len=8, vocab_size=49152, tokenizer=smollm2_tokenizer, seed=3
    )


def test_mixed_output_lengths_and_range_ratio():
    w = make_workload(num_prompts=500, input_len=100, output_len=50, vocab_size=1000, output_len_range=(16, 256))
    assert min(w.output_lens) >= 16 and max(w.output_lens) <= 256 and len(set(w.output_lens)) > 100
    w = make_workload(num_prompts=500, input_len=100, output_len=50, vocab_size=1000, random_range_ratio=0.5)
    lens = [len(p) for p in w.prompts]
    assert min(lens) >= 50 and max(lens) <= 150 and min(w.output_lens) >= 25 and max(w.output_lens) <= 75


def test_fixed_prompts_are_text_with_distinct_heads(smollm2_tokenizer):
    w = make_workload(
        num_prompts=3, input_len=64, output_len=4, vocab_size=49152, prompt_kind="fixed", tokenizer=smollm2_tokenizer
    )
    texts = [smollm2_tokenizer.decode(p) for p in w.prompts]
    assert all(len(p) == 64 for p in w.prompts)
    assert texts[0].startswith("Document 0.") and texts[2].startswith("Document 2.") and "abstraction" in texts[1]
    with pytest.raises(ValueError, match="tokenizer"):
        make_workload(num_prompts=1, input_len=8, output_len=1, vocab_size=10, prompt_kind="fixed")


class _SteppedLLM:
    """Just enough of `LLM` for run_single_stream: ``generate`` runs one engine step per token
    (each ``step_s`` long) and stamps first/last token times as the output processor does."""

    def __init__(self, step_s: float) -> None:
        self.engine = _SleepEngine(step_s)

    def get_tokenizer(self):
        return None

    def generate(self, prompts, sp, use_tqdm=False):
        import time
        from types import SimpleNamespace

        metrics = {}
        for _ in range(sp.max_tokens):
            self.engine.step()
            now = time.time()
            metrics.setdefault("first_token_time", now)
            metrics["last_token_time"] = now
        return [SimpleNamespace(metrics=metrics, outputs=[SimpleNamespace(token_ids=[0] * sp.max_tokens)])]


class _SleepEngine:
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def step(self):
        import time

        time.sleep(self.step_s)
        return []


def test_single_stream_probe_readings_are_averaged_and_their_time_left_out():
    import itertools
    import time

    from pkgd.benchmarks.throughput import run_single_stream

    values = itertools.cycle([10e9, 40e9])

    def probe() -> float:  # a slow probe: counted in, it would cut the decode rate by 4x
        time.sleep(0.03)
        return next(values)

    llm = _SteppedLLM(step_s=0.01)
    res = run_single_stream(llm, input_len=4, output_len=9, vocab_size=100, probe=probe)
    assert llm.engine.__class__ is _SleepEngine  # the engine is given back
    assert 60 < res.decode_tokens_per_s < 101  # 8 decode steps of ~10 ms each
    assert res.ttft < 0.025 and res.elapsed < 0.15
    # readings before the 8 decode steps alternate 40 and 10 GB/s: harmonic mean 16 GB/s
    assert res.paced_bandwidth == pytest.approx(16e9)
    plain = run_single_stream(llm, input_len=4, output_len=9, vocab_size=100)
    assert plain.paced_bandwidth is None and 60 < plain.decode_tokens_per_s < 101
