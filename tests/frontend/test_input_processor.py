"""InputProcessor: tokenization, chat template, limits, n > 1 fan-out; torch-free."""

import subprocess
import sys

import pytest

from pkgd.frontend.input_processor import InputProcessor
from pkgd.sampling_params import SamplingParams


@pytest.fixture
def proc(smollm2_tokenizer):
    return InputProcessor(smollm2_tokenizer, max_model_len=64)


def test_text_prompt_is_tokenized_and_max_tokens_filled(proc, smollm2_tokenizer):
    p = proc.process("r1", "Hello world", SamplingParams(max_tokens=None))
    assert p.prompt == "Hello world"
    assert p.prompt_token_ids == smollm2_tokenizer.encode("Hello world")
    (req,) = p.engine_requests
    assert req.request_id == "r1" and req.sampling_params.max_tokens == 64 - len(p.prompt_token_ids)
    assert req.eos_token_id == smollm2_tokenizer.eos_token_id


def test_chat_messages_use_the_chat_template(proc):
    p = proc.process_chat("c", [{"role": "user", "content": "What is the capital of France?"}])
    assert p.prompt.startswith("<|im_start|>system") and p.prompt.endswith("<|im_start|>assistant\n")
    assert p.prompt_token_ids[0] == 1  # <|im_start|>, added once by the template


def test_chat_template_override(smollm2_tokenizer):
    proc = InputProcessor(smollm2_tokenizer, max_model_len=64)
    text = proc.render_chat(
        [{"role": "user", "content": "hi"}], chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    assert text == "[hi]"


def test_prompt_plus_max_tokens_beyond_max_model_len_is_a_clear_error(proc):
    with pytest.raises(ValueError, match=r"prompt has 50 tokens and max_tokens is 20: 70 exceeds max_model_len 64"):
        proc.process("r", list(range(50)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="no room"):
        proc.process("r", list(range(64)), SamplingParams(max_tokens=None))


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(), "empty"),
        ([1, 10**6], SamplingParams(), "out of range"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(logprobs=50), "logprobs"),
    ],
)
def test_bad_input_is_rejected(proc, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        proc.process("r", prompt, params)


def test_n_fans_out_children_sharing_the_prompt(proc):
    p = proc.process("r", [5, 6, 7], SamplingParams(n=3, seed=10, max_tokens=4))
    assert [r.request_id for r in p.engine_requests] == ["0_r", "1_r", "2_r"]
    assert [r.sampling_params.seed for r in p.engine_requests] == [10, 11, 12]
    assert all(r.sampling_params.n == 1 and r.prompt_token_ids == [5, 6, 7] for r in p.engine_requests)


def test_frontend_modules_do_not_import_torch(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save_pretrained(tmp_path)
    code = (
        "import sys\n"
        "from pkgd.frontend.tokenizer import load_tokenizer\n"
        "from pkgd.frontend.input_processor import InputProcessor\n"
        "from pkgd.frontend.output_processor import OutputProcessor\n"
        f"tok = load_tokenizer({str(tmp_path)!r})\n"
        "p = InputProcessor(tok, max_model_len=100).process_chat('x', [{'role': 'user', 'content': 'hi'}])\n"
        "OutputProcessor(tok).add_request(p)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_truncate_prompt_tokens_keeps_the_last_tokens(proc, smollm2_tokenizer):
    text = "one two three four five six seven"
    full = smollm2_tokenizer.encode(text)
    r = proc.process("t1", text, SamplingParams(max_tokens=4), truncate_prompt_tokens=3)
    assert r.prompt_token_ids == full[-3:] and r.prompt is None  # a truncated prompt has no text
    assert proc.process("t2", full, SamplingParams(max_tokens=4), truncate_prompt_tokens=50).prompt_token_ids == full
    tokenized = proc.tokenize_prompt(text, truncate_prompt_tokens=2)
    assert proc.process("t3", tokenized, SamplingParams(max_tokens=4)).prompt_token_ids == full[-2:]
    for bad in (0, -2, proc.max_model_len + 1):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            proc.process("t4", text, SamplingParams(max_tokens=4), truncate_prompt_tokens=bad)


def test_bad_words_become_token_sequences_alone_and_after_a_space(proc, smollm2_tokenizer):
    r = proc.process("b1", "Hi", SamplingParams(max_tokens=4, bad_words=["Paris", " big city"]))
    seqs = r.engine_requests[0].sampling_params.bad_words_token_ids
    enc = lambda s: smollm2_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert enc("Paris") in seqs and enc(" Paris") in seqs and enc("big city") in seqs and enc(" big city") in seqs
    with pytest.raises(ValueError, match="bad_words"):
        proc.process("b2", "Hi", SamplingParams(max_tokens=4, bad_words=["  "]))
