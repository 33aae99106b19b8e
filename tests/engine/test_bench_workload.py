"""Workloads of pkgd bench throughput."""

import pytest

from pkgd.benchmarks.throughput import make_workload


def test_random_workload_has_the_asked_lengths_and_no_special_tokens(smollm2_tokenizer):
    w = make_workload(num_prompts=20, input_len=32, output_len=8, vocab_size=49152, tokenizer=smollm2_tokenizer, seed=3)
    assert [len(p) for p in w.prompts] == [32] * 20 and w.output_lens == [8] * 20
    special = set(smollm2_tokenizer.all_special_ids)
    assert not any(t in special for p in w.prompts for t in p)
    assert len({tuple(p[:4]) for p in w.prompts}) == 20  # no shared prefixes
    assert w == make_workload(num_prompts=20, input_len=32, output_len=8, vocab_size=49152, tokenizer=smollm2_tokenizer, seed=3)


def test_mixed_output_lengths_and_range_ratio():
    w = make_workload(num_prompts=500, input_len=100, output_len=50, vocab_size=1000, output_len_range=(16, 256))
    assert min(w.output_lens) >= 16 and max(w.output_lens) <= 256 and len(set(w.output_lens)) > 100
    w = make_workload(num_prompts=500, input_len=100, output_len=50, vocab_size=1000, random_range_ratio=0.5)
    lens = [len(p) for p in w.prompts]
    assert min(lens) >= 50 and max(lens) <= 150 and min(w.output_lens) >= 25 and max(w.output_lens) <= 75


def test_fixed_prompts_are_text_with_distinct_heads(smollm2_tokenizer):
    w = make_workload(num_prompts=3, input_len=64, output_len=4, vocab_size=49152, prompt_kind="fixed", tokenizer=smollm2_tokenizer)
    texts = [smollm2_tokenizer.decode(p) for p in w.prompts]
    assert all(len(p) == 64 for p in w.prompts)
    assert texts[0].startswith("Document 0.") and texts[2].startswith("Document 2.") and "abstraction" in texts[1]
    with pytest.raises(ValueError, match="tokenizer"):
        make_workload(num_prompts=1, input_len=8, output_len=1, vocab_size=10, prompt_kind="fixed")
