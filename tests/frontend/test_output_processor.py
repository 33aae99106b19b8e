"""OutputProcessor: output kinds, stop strings across steps, logprobs, n > 1 aggregation."""

import pytest

from pkgd.frontend.input_processor import InputProcessor
from pkgd.frontend.output_processor import OutputProcessor
from pkgd.ipc.messages import EngineCoreOutput, FinishReason
from pkgd.logprobs import TokenLogprobs
from pkgd.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def setup(tok, text_or_ids="Hi", **sp):
    inp = InputProcessor(tok, max_model_len=256)
    proc = OutputProcessor(tok)
    p = inp.process("req", text_or_ids, SamplingParams(**sp))
    proc.add_request(p)
    return proc, p


def feed(proc, rid, ids, final=None, **kw):
    """One engine output per token; the last carries ``final``."""
    results = []
    for i, t in enumerate(ids):
        out = EngineCoreOutput(
            request_id=rid, new_token_ids=[t], finish_reason=final if i == len(ids) - 1 else None, **kw
        )
        results.append(proc.process_outputs([out]))
    return results


def test_cumulative_delta_and_final_only(tok):
    ids = tok.encode(" The capital is Paris.", add_special_tokens=False)
    for kind in RequestOutputKind:
        proc, _ = setup(tok, output_kind=kind, max_tokens=len(ids))
        res = feed(proc, "req", ids, FinishReason.LENGTH)
        outs = [ro for r in res for ro in r.request_outputs]
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1 and outs[0].outputs[0].text == " The capital is Paris."
        elif kind == RequestOutputKind.DELTA:
            assert "".join(o.outputs[0].text for o in outs) == " The capital is Paris."
            assert sum(len(o.outputs[0].token_ids) for o in outs) == len(ids)
        else:
            assert outs[-1].outputs[0].text == " The capital is Paris." and outs[-1].outputs[0].token_ids == ids
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert not proc.has_unfinished_requests()


def test_stop_string_finishes_with_stop_and_asks_for_an_abort(tok):
    ids = tok.encode(" one, two, three, four", add_special_tokens=False)
    proc, _ = setup(tok, stop=["three"], output_kind=RequestOutputKind.DELTA, max_tokens=50)
    res = feed(proc, "req", ids)
    texts = [ro.outputs[0].text for r in res for ro in r.request_outputs]
    aborts = [a for r in res for a in r.reqs_to_abort]
    assert "".join(texts) == " one, two, "
    assert aborts == ["req"]
    last = [ro for r in res for ro in r.request_outputs][-1]
    assert last.finished and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == "three"
    assert not proc.has_unfinished_requests()  # later engine outputs for it are ignored
    assert proc.process_outputs([EngineCoreOutput(request_id="req", new_token_ids=[5])]).request_outputs == []


def test_eos_and_stop_token_reasons(tok):
    proc, _ = setup(tok, max_tokens=10)
    (r,) = feed(proc, "req", [tok.eos_token_id], FinishReason.STOP)
    c = r.request_outputs[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason is None and c.text == ""
    proc, _ = setup(tok, max_tokens=10)
    ids = tok.encode(" yes.", add_special_tokens=False)
    res = feed(proc, "req", ids, FinishReason.STOP, stop_reason=ids[-1])
    c = res[-1].request_outputs[0].outputs[0]
    assert c.stop_reason == ids[-1] and c.text == " yes"


def test_logprobs_carry_decoded_tokens_and_cumulative_sum(tok):
    proc, _ = setup(tok, logprobs=1, max_tokens=2)
    paris, london = (
        tok.encode(" Paris", add_special_tokens=False)[0],
        tok.encode(" London", add_special_tokens=False)[0],
    )
    outs = [
        EngineCoreOutput(
            request_id="req", new_token_ids=[paris], new_logprobs=[TokenLogprobs([paris, paris], [-0.1, -0.1], 1)]
        ),
        EngineCoreOutput(
            request_id="req",
            new_token_ids=[london],
            new_logprobs=[TokenLogprobs([london, paris], [-2.0, -0.5], 2)],
            finish_reason=FinishReason.LENGTH,
        ),
    ]
    proc.process_outputs(outs[:1])
    ro = proc.process_outputs(outs[1:]).request_outputs[0]
    c = ro.outputs[0]
    assert c.cumulative_logprob == pytest.approx(-2.1)
    assert c.logprobs[0][paris].decoded_token == " Paris" and c.logprobs[0][paris].rank == 1
    assert c.logprobs[1][london].rank == 2 and c.logprobs[1][paris].rank == 1


def test_n_completions_are_aggregated_under_the_client_id(tok):
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        proc, p = setup(tok, n=2, output_kind=kind, max_tokens=2)
        a, b = (r.request_id for r in p.engine_requests)
        outs = []
        for rid, toks in ((a, [100, 101]), (b, [200, 201])):
            outs += [ro for r in feed(proc, rid, toks, FinishReason.LENGTH) for ro in r.request_outputs]
        assert all(o.request_id == "req" for o in outs)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        if kind != RequestOutputKind.DELTA:
            assert [c.token_ids for c in outs[-1].outputs] == [[100, 101], [200, 201]]
        else:
            assert [(o.outputs[0].index, o.outputs[0].token_ids) for o in outs] == [
                (0, [100]),
                (0, [101]),
                (1, [200]),
                (1, [201]),
            ]
        assert not proc.has_unfinished_requests()


def test_abort_by_client_id_returns_the_engine_ids(tok):
    proc, p = setup(tok, n=3)
    assert sorted(proc.abort_requests(["req"])) == ["0_req", "1_req", "2_req"]
    assert not proc.has_unfinished_requests()


def test_num_cached_tokens_and_prompt_logprobs_arrive_with_the_first_output(tok):
    proc, p = setup(tok, [10, 11, 12], prompt_logprobs=0, max_tokens=1)
    out = EngineCoreOutput(
        request_id="req",
        new_token_ids=[13],
        num_cached_tokens=0,
        finish_reason=FinishReason.LENGTH,
        new_prompt_logprobs=[None, TokenLogprobs([11], [-1.0], 3), TokenLogprobs([12], [-2.0], 1)],
    )
    ro = proc.process_outputs([out]).request_outputs[0]
    assert (
        ro.prompt_logprobs[0] is None
        and ro.prompt_logprobs[1][11].logprob == -1.0
        and ro.prompt_logprobs[2][12].rank == 1
    )


@pytest.mark.parametrize("text", ["日本語のテキスト", " café 😀 naïve", "Ωμέγα — ✓"])
def test_logprob_tokens_of_multibyte_characters_join_into_the_text(tok, text):
    """A token holding part of a character decodes alone as U+FFFD: the token that completes
    the character carries it whole, so the sampled tokens' decoded_token rebuild the text."""
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)  # the case under test occurs
    proc, _ = setup(tok, output_kind=RequestOutputKind.FINAL_ONLY, max_tokens=len(ids), logprobs=1, ignore_eos=True)
    for i, t in enumerate(ids):
        out = EngineCoreOutput(
            request_id="req",
            new_token_ids=[t],
            new_logprobs=[TokenLogprobs([t, 0], [-0.1, -2.0], 1)],
            finish_reason=FinishReason.LENGTH if i == len(ids) - 1 else None,
        )
        res = proc.process_outputs([out])
    (ro,) = res.request_outputs
    lps = ro.outputs[0].logprobs
    assert "".join(d[t].decoded_token for d, t in zip(lps, ids, strict=True)) == ro.outputs[0].text == text
    assert "\ufffd" not in "".join(d[t].decoded_token for d, t in zip(lps, ids, strict=True))
