"""Incremental detokenization and stop strings, with SmolLM2's real tokenizer."""

import pytest

from pkgd.frontend.detokenizer import IncrementalDetokenizer, find_stop_string
from pkgd.sampling_params import SamplingParams

TEXTS = [
    "Hello there, world!",
    "Emoji: 😀🎉👍🏽 and 🇫🇷 flags",
    "中文测试：你好，世界！日本語もテストします。",
    "  leading spaces,\ttabs\nand new lines  ",
    "Ünïcödé mixed with ascii and €uro signs",
]


def stream(tok, text, params=None, prompt="Q:"):
    """Feed the token ids of ``text`` one by one; returns the concatenated deltas."""
    params = params or SamplingParams()
    d = IncrementalDetokenizer(tok, params, tok.encode(prompt))
    pieces = []
    ids = tok.encode(text, add_special_tokens=False)
    stop = None
    for i, t in enumerate(ids):
        stop = d.update([t], False)
        pieces.append(d.get_next_output_text(stop is not None or i == len(ids) - 1, True))
        if stop:
            break
    return pieces, stop


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_round_trips_text(smollm2_tokenizer, text):
    pieces, _ = stream(smollm2_tokenizer, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a UTF-8 character


def test_multibyte_characters_span_several_tokens(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # otherwise the test above proves nothing about splits
    pieces, _ = stream(smollm2_tokenizer, "😀")
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "😀"


def test_stop_string_spanning_two_steps_is_cut_and_never_streamed(smollm2_tokenizer):
    text = "The answer is forty-two. Then more text follows here."
    params = SamplingParams(stop=["forty-two"])
    pieces, stop = stream(smollm2_tokenizer, text, params)
    assert stop == "forty-two"
    assert "".join(pieces) == "The answer is "
    assert not any("forty" in p for p in pieces)
    ids = smollm2_tokenizer.encode("forty-two", add_special_tokens=False)
    assert len(ids) > 1  # the stop string arrives over several steps


def test_include_stop_str_in_output(smollm2_tokenizer):
    params = SamplingParams(stop=["two"], include_stop_str_in_output=True)
    pieces, stop = stream(smollm2_tokenizer, "one two three", params)
    assert stop == "two" and "".join(pieces) == "one two"


def test_earliest_stop_string_wins():
    assert find_stop_string("abc STOP x END", 14, ["END", "STOP"], False) == ("STOP", 4)
    assert find_stop_string("abcdef", 1, ["cd"], False) is None  # ended before the new text
    assert find_stop_string("abcdef", 3, ["cd"], False) == ("cd", 2)


def test_stop_token_text_is_left_out(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Paris.", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, SamplingParams(), [1])
    d.update(ids[:-1], False)
    d.update(ids[-1:], True)  # the engine stopped on this token (stop_token_ids)
    assert d.get_next_output_text(True, False) == tok.decode(ids[:-1])


def test_no_text_when_detokenize_is_off(smollm2_tokenizer):
    d = IncrementalDetokenizer(smollm2_tokenizer, SamplingParams(detokenize=False), [1])
    d.update([100, 200], False)
    assert d.get_next_output_text(True, False) == ""


@pytest.mark.parametrize("include", [False, True])
def test_a_special_token_stop_string_stops_though_its_text_is_skipped(smollm2_tokenizer, include):
    tok = smollm2_tokenizer
    start = tok.convert_tokens_to_ids("<|im_start|>")  # special, and not EOS
    params = SamplingParams(stop=["<|im_start|>"], include_stop_str_in_output=include)
    d = IncrementalDetokenizer(tok, params, tok.encode("Q:"))
    assert d.update(tok.encode("Hello", add_special_tokens=False), False) is None
    assert d.update([start, *tok.encode(" more", add_special_tokens=False)], False) == "<|im_start|>"
    assert d.get_next_output_text(True, False) == ("Hello<|im_start|>" if include else "Hello")
    # without the stop string the special token's text is skipped and nothing stops
    d = IncrementalDetokenizer(tok, SamplingParams(stop=["zzz"]), tok.encode("Q:"))
    assert d.update([*tok.encode("Hello", add_special_tokens=False), start], False) is None
    assert d.get_next_output_text(True, False) == "Hello"
