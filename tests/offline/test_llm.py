"""LLM with the fake runner: ordering, validation before anything runs, n, stop strings."""

import io

import pytest
from tests.engine.fake_runner import fake_factory
from tests.smollm2 import smollm2_gguf
from tqdm import tqdm

from pkgd import LLM, SamplingParams
from pkgd.offline import progress
from pkgd.sampling_params import BeamSearchParams

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm():
    return LLM(
        runner_factory=fake_factory(vocab_size=49152),
        tokenizer=str(smollm2_gguf()),
        num_blocks=64,
        block_size=16,
        max_model_len=256,
    )


def test_outputs_come_back_in_input_order(llm):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (9, 2, 5)]  # finish out of order
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 2, 5]
    assert all(o.finished for o in outs)


def test_single_token_id_prompt_and_prompt_dicts(llm):
    (a,) = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    b, c = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}, {"prompt": "Hello"}],
        SamplingParams(temperature=0, max_tokens=3),
        use_tqdm=False,
    )
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert c.prompt == "Hello" and c.outputs[0].text == llm.tokenizer.decode(
        c.outputs[0].token_ids, skip_special_tokens=True
    )


def test_bad_prompt_fails_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="exceeds max_model_len 256"):
        llm.generate([[1, 2], list(range(1, 250))], SamplingParams(max_tokens=10), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.output_processor.has_unfinished_requests()


def test_n_completions(llm):
    (out,) = llm.generate([[3, 4]], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # different seeds per child


def test_stop_string_is_excluded_and_the_engine_request_aborted(llm):
    (free,) = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    (out,) = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)
    assert stop not in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.get_num_free_blocks() == 64


def test_chat_uses_the_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.prompt.startswith("<|im_start|>system") and len(out.outputs[0].token_ids) == 2
    outs = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], use_tqdm=False)
    assert len(outs) == 2


def test_beam_search_runs_on_the_engine(llm):
    (res,) = llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(res.sequences) == 2 and all(s.tokens[:3] == [1, 2, 3] and len(s.tokens) == 6 for s in res.sequences)
    assert res.sequences[0].cum_logprob >= res.sequences[1].cum_logprob
    assert not llm.engine.has_unfinished_requests()


def test_no_progress_bar_for_a_quick_call_or_one_prompt(llm, capsys):
    llm.generate([[1, 2]] * 3, SamplingParams(max_tokens=2))  # the default: done before the bar's delay
    llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=True)
    assert capsys.readouterr().err == ""


def test_progress_bar_of_a_long_batch(llm, capsys, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)  # as if the batch had run for longer than the delay
    llm.generate([[1, 2]] * 3, SamplingParams(max_tokens=2))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "est. speed input" in err
    llm.generate([[1, 2]] * 3, SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_use_tqdm_takes_a_bar_factory_as_in_vllm(llm):
    bars = []

    def factory(**kwargs):
        bars.append(tqdm(file=io.StringIO(), **kwargs))
        return bars[-1]

    llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=factory)  # shown even for one prompt
    (bar,) = bars
    assert bar.total == 1 and bar.n == 1 and bar.desc == "Processed prompts" and "toks/s" in bar.postfix


def test_start_up_lines_go_to_stderr_not_stdout():
    """`LLM()` sets up pkgd's logging (unless the program did): its lines on stderr, so a
    program writing results to stdout (pkgd run-batch -o -) gets only those there."""
    import subprocess
    import sys

    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'tests' / 'engine')!r}); from fake_runner import fake_factory; "
        "from pkgd import LLM, phases; LLM(runner_factory=fake_factory(vocab_size=49152), "
        f"tokenizer={str(smollm2_gguf())!r}, "
        "num_blocks=8, block_size=16, max_model_len=64)\n"
        "with phases.phase('load_weights', 'loading'): pass\nprint('result')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "result\n" and '"event": "model_phase"' in r.stderr
