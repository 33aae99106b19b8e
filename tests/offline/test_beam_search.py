"""Beam search over a known next-token distribution."""

import math

import pytest

from pkgd.offline.beam_search import beam_search
from pkgd.outputs import Logprob
from pkgd.sampling_params import BeamSearchParams

EOS = 0
# A 2-step toy language: greedy takes "1" (p=.6) but then only weak continuations follow;
# "2" (p=.4) is followed by a near-certain token, so the best 2-token sequence starts with 2.
TABLE = {
    (): {1: 0.6, 2: 0.4},
    (1,): {3: 0.35, 4: 0.35, EOS: 0.3},
    (2,): {5: 0.95, EOS: 0.05},
}


def next_lp(seqs, k):
    out = []
    for s in seqs:
        dist = TABLE.get(tuple(s[1:]), {EOS: 1.0})
        top = sorted(dist.items(), key=lambda kv: -kv[1])[:k]
        out.append({t: Logprob(math.log(p), r) for r, (t, p) in enumerate(top, 1)})
    return out


def test_beam_search_finds_the_sequence_greedy_misses():
    (res,) = beam_search(
        [[9]],
        BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0),
        next_lp,
        eos_token_id=EOS,
        max_model_len=100,
    )
    best = res.sequences[0]
    assert best.tokens == [9, 2, 5]
    assert best.cum_logprob == pytest.approx(math.log(0.4 * 0.95))
    assert len(res.sequences) == 2


def test_eos_beams_complete_early():
    table_eos_first = {(): {EOS: 0.9, 1: 0.1}}

    def lp(seqs, k):
        return [
            {t: Logprob(math.log(p), 1) for t, p in table_eos_first.get(tuple(s[1:]), {7: 1.0}).items()} for s in seqs
        ]

    (res,) = beam_search([[9]], BeamSearchParams(beam_width=1, max_tokens=5), lp, eos_token_id=EOS, max_model_len=100)
    assert res.sequences[0].tokens == [9, EOS] and res.sequences[0].finish_reason == "stop"


def test_max_model_len_ends_beams():
    (res,) = beam_search(
        [[9, 9]], BeamSearchParams(beam_width=2, max_tokens=10), next_lp, eos_token_id=None, max_model_len=4
    )
    assert all(len(s.tokens) <= 4 for s in res.sequences)


WORDS = {9: "Q:", 1: " a", 2: " b", 3: " c", 4: " d", 5: " STOP", EOS: ""}


def decode(ids):
    return "".join(WORDS[t] for t in ids)


@pytest.mark.parametrize(("include", "text"), [(False, "Q: b"), (True, "Q: b STOP")])
def test_a_stop_string_finishes_a_beam_and_cuts_its_text(include, text):
    params = BeamSearchParams(
        beam_width=2, max_tokens=4, length_penalty=0.0, stop=[" STOP"], include_stop_str_in_output=include
    )
    (res,) = beam_search([[9]], params, next_lp, eos_token_id=EOS, max_model_len=100, decode=decode)
    best = res.sequences[0]
    assert best.tokens == [9, 2, 5] and best.finish_reason == "stop" and best.stop_reason == " STOP"
    assert best.text == text
    assert all(s.text is not None for s in res.sequences)


def test_stop_needs_a_decoder():
    with pytest.raises(ValueError, match="need a tokenizer"):
        beam_search(
            [[9]],
            BeamSearchParams(beam_width=1, max_tokens=2, stop=["x"]),
            next_lp,
            eos_token_id=EOS,
            max_model_len=100,
        )
