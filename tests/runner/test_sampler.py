"""Each sampling knob changes what it should; seeded draws do not depend on the batch."""

from __future__ import annotations

import math

import pytest
import torch

from pkgd.runner.sampler import Sampler, SamplingRow, step_seed
from pkgd.sampling_params import SamplingParams
from pkgd_kernels import top_k_top_p_mask

EOS = 7
V = 16


def _sampler(seed: int = 0) -> Sampler:
    return Sampler((EOS,), torch.Generator().manual_seed(seed))


def _row(prompt=(), outputs=(), seeded=False, **kw) -> SamplingRow:
    p = SamplingParams(**kw)
    return SamplingRow(p, list(prompt), list(outputs), torch.Generator() if seeded else None)


def _logits(*values: float, n: int = 1) -> torch.Tensor:
    row = torch.full((V,), -10.0)
    row[: len(values)] = torch.tensor(values)
    return row.repeat(n, 1)


def _draws(logits_row: torch.Tensor, n: int = 4000, **kw) -> torch.Tensor:
    """Tokens drawn for n identical rows."""
    s = _sampler(1)
    return s(logits_row.repeat(n, 1).clone(), [_row(**kw) for _ in range(n)]).token_ids


def test_greedy_is_argmax_and_all_greedy_batch_is_one_argmax():
    logits = torch.randn(5, V)
    out = _sampler()(logits.clone(), [_row(temperature=0.0) for _ in range(5)])
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_temperature_sharpens_and_flattens_matching_softmax():
    base = _logits(2.0, 1.0, 0.0)[0]
    cold = torch.bincount(_draws(base, temperature=0.5), minlength=V).float() / 4000
    hot = torch.bincount(_draws(base, temperature=2.0), minlength=V).float() / 4000
    for temp, freq in ((0.5, cold), (2.0, hot)):
        want = torch.softmax(base / temp, -1)
        assert (freq[:3] - want[:3]).abs().max() < 0.03, (temp, freq[:3], want[:3])
    assert cold[0] > hot[0] + 0.2


def test_top_k_keeps_only_k_tokens():
    toks = set(_draws(_logits(1.0, 0.9, 0.8, 0.7)[0], top_k=2).tolist())
    assert toks == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    base = torch.log(torch.tensor([0.5, 0.3, 0.2] + [1e-9] * (V - 3)))
    assert set(_draws(base, top_p=0.7).tolist()) == {0, 1}
    assert set(_draws(base, top_p=0.45).tolist()) == {0}


def test_min_p_drops_tokens_below_fraction_of_top():
    base = torch.log(torch.tensor([0.6, 0.3, 0.1] + [1e-9] * (V - 3)))
    assert set(_draws(base, min_p=0.25).tolist()) == {0, 1}


def test_top_k_top_p_mask_keeps_ties_and_respects_off_values():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0], [3.0, 2.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    out = top_k_top_p_mask(
        logits, torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([1.0, 1.0, 0.3], dtype=torch.float32)
    )
    kept = torch.isfinite(out)
    assert kept[0].tolist() == [True, True, True, False]  # tie at the k-th value kept
    assert kept[1].all()  # both off
    assert kept[2].all()  # all tied: the boundary value is shared by every token
    p = top_k_top_p_mask(logits[:1], torch.tensor([0], dtype=torch.int32), torch.tensor([0.5], dtype=torch.float32))
    assert torch.isfinite(p).tolist() == [[True, False, False, False]]


def test_presence_frequency_and_repetition_penalties():
    s = _sampler()
    logits = _logits(2.0, 1.9, 1.0)
    assert s(logits.clone(), [_row(temperature=0.0, outputs=[0])]).token_ids.item() == 0
    assert s(logits.clone(), [_row(temperature=0.0, outputs=[0], presence_penalty=0.5)]).token_ids.item() == 1
    # frequency scales with the count: one occurrence x 0.05 is not enough, three are
    assert s(logits.clone(), [_row(temperature=0.0, outputs=[0], frequency_penalty=0.05)]).token_ids.item() == 0
    assert s(logits.clone(), [_row(temperature=0.0, outputs=[0, 0, 0], frequency_penalty=0.05)]).token_ids.item() == 1
    # repetition counts the prompt too; presence/frequency do not
    assert s(logits.clone(), [_row(temperature=0.0, prompt=[0], presence_penalty=2.0)]).token_ids.item() == 0
    assert s(logits.clone(), [_row(temperature=0.0, prompt=[0], repetition_penalty=1.2)]).token_ids.item() == 1
    neg = _logits(-1.0, -1.1)
    # negative logits are multiplied: the seen token gets less likely, not more
    assert s(neg.clone(), [_row(temperature=0.0, prompt=[0], repetition_penalty=1.2)]).token_ids.item() == 1


def test_penalties_apply_per_row_only():
    s = _sampler()
    logits = _logits(2.0, 1.9, n=2)
    rows = [_row(temperature=0.0, outputs=[0], presence_penalty=1.0), _row(temperature=0.0, outputs=[0])]
    assert s(logits, rows).token_ids.tolist() == [1, 0]


def test_logit_bias_and_out_of_vocab_ids_ignored():
    s = _sampler()
    out = s(_logits(5.0, 0.0, 0.0), [_row(temperature=0.0, logit_bias={2: 100.0, V + 5: 100.0})])
    assert out.token_ids.item() == 2


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    s = _sampler()
    logits = torch.full((1, V), 0.0)
    logits[0, EOS], logits[0, 3], logits[0, 5] = 5.0, 4.0, 1.0
    kw = dict(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert s(logits.clone(), [_row(outputs=[1], **kw)]).token_ids.item() == 5
    assert s(logits.clone(), [_row(outputs=[1, 1], **kw)]).token_ids.item() == EOS
    # ignore_eos: EOS is not suppressed by min_tokens (it does not stop the request anyway)
    assert s(logits.clone(), [_row(outputs=[1], ignore_eos=True, **kw)]).token_ids.item() == EOS


def test_logprobs_sampled_token_rank_and_top_k():
    s = _sampler()
    logits = torch.randn(2, V)
    rows = [_row(temperature=0.0, logprobs=3), _row(temperature=0.0)]
    out = s(logits.clone(), rows)
    lp = torch.log_softmax(logits[0], -1)
    entry = out.logprobs[0]
    assert out.logprobs[1] is None
    tok = out.token_ids[0].item()
    assert entry.token_ids[0] == tok and entry.rank == 1
    assert entry.token_ids[1:] == lp.topk(3).indices.tolist()
    assert entry.logprobs == pytest.approx([lp[tok].item()] + lp.topk(3).values.tolist(), abs=1e-6)
    # logprobs are the model's raw ones, not after temperature/penalties
    out = s(logits[:1].clone(), [_row(temperature=0.0, logprobs=0, logit_bias={int(logits[0].argmin()): 100.0})])
    e = out.logprobs[0]
    assert e.token_ids == [int(logits[0].argmin())] and e.rank == V
    assert e.logprobs[0] == pytest.approx(lp.min().item(), abs=1e-6)


def test_seeded_rows_do_not_depend_on_batch_composition():
    logits = torch.randn(1, V)

    def draw(batch_pos: int, batch_size: int, outputs):
        rows = [_row(temperature=1.0) for _ in range(batch_size)]
        rows[batch_pos] = _row(temperature=1.0, seed=1234, seeded=True, outputs=outputs)
        other = torch.randn(batch_size, V)
        other[batch_pos] = logits[0]
        return _sampler(batch_size)(other, rows).token_ids[batch_pos].item()

    seq = [draw(0, 1, [9] * i) for i in range(12)]
    assert [draw(3, 5, [9] * i) for i in range(12)] == seq
    assert [draw(1, 8, [9] * i) for i in range(12)] == seq
    assert len(set(seq)) > 1  # a new draw each step, not one fixed token


def test_different_seeds_differ_and_unseeded_follow_the_engine_generator():
    logits = torch.zeros(1, V)
    a = [_sampler()(logits.clone(), [_row(seed=1, seeded=True, outputs=[0] * i)]).token_ids.item() for i in range(20)]
    b = [_sampler()(logits.clone(), [_row(seed=2, seeded=True, outputs=[0] * i)]).token_ids.item() for i in range(20)]
    assert a != b
    s1, s2 = _sampler(5), _sampler(5)
    x = [s1(logits.clone(), [_row()]).token_ids.item() for _ in range(20)]
    y = [s2(logits.clone(), [_row()]).token_ids.item() for _ in range(20)]
    assert x == y


def test_step_seed_is_64_bit_and_spreads():
    seeds = {step_seed(s, i) for s in range(10) for i in range(10)}
    assert len(seeds) == 100 and all(0 <= x < 2**63 for x in seeds)
    assert not math.isclose(step_seed(0, 0), step_seed(0, 1))


def test_allowed_token_ids_mask_every_other_token():
    logits = _logits(5.0, 4.0, 3.0, 2.0, n=2)
    out = _sampler()(logits.clone(), [_row(temperature=0.0, allowed_token_ids=[2, 3]), _row(temperature=0.0)])
    assert out.token_ids.tolist() == [2, 0]
    draws = _draws(_logits(5.0, 4.0, 3.0, 2.0), n=500, allowed_token_ids=[1, 3])
    assert set(draws.tolist()) == {1, 3}


def test_bad_words_mask_the_last_token_after_their_prefix():
    # one-token word 0 always banned; two-token word (4, 1): 1 banned only right after 4
    words = [[0], [4, 1]]
    logits = _logits(9.0, 8.0, 1.0, 1.0, 1.0)
    free = _sampler()(logits.clone(), [_row(temperature=0.0, bad_words_token_ids=words, outputs=[3])])
    after = _sampler()(logits.clone(), [_row(temperature=0.0, bad_words_token_ids=words, outputs=[3, 4])])
    assert free.token_ids.tolist() == [1] and after.token_ids.tolist() != [1] and after.token_ids.tolist() != [0]
