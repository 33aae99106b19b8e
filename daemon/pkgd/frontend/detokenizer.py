"""Incremental detokenization with stop strings (vLLM v1's ``detokenizer.py``), torch-free.

Text is produced one token at a time by the ``tokenizers`` library's ``DecodeStream``, which
buffers tokens until they decode to whole UTF-8 characters (so half an emoji or CJK
character is never emitted) and decodes each token in the context of the previous ones (so
spaces come out right for byte-level BPE and SentencePiece alike). The stream is primed with
the last prompt tokens, so the first generated token sees its left context.

Stop strings: after each update the new text, plus the stop string's length before it, is
searched, so a stop string spanning two steps is found. The text is cut before the stop
string (or after it with ``include_stop_str_in_output``), and while a request runs the last
``max(len(stop)) - 1`` characters are held back, so a stop string's beginning never reaches
a client.

A stop string that is a special token's text (``<|im_end|>``) is matched on the token itself,
before ``skip_special_tokens`` drops its text (vLLM never sees such a stop string, since it
searches the text after the skip): the text ends before it, or with it under
``include_stop_str_in_output``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pkgd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Prompt tokens fed to the stream before the first output token (left context for spaces
# and for a UTF-8 character split across the prompt's end).
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Text of one completion, grown token by token.

    Args:
        tokenizer: a fast tokenizer (``PreTrainedTokenizerFast``) or None for no text.
        params: the request's `SamplingParams` (``stop``, ``include_stop_str_in_output``,
            ``skip_special_tokens``, ``detokenize``).
        prompt_token_ids: the prompt, for left context.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerFast | None, params: SamplingParams, prompt_token_ids: list[int]
    ) -> None:
        self.output_text = ""
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self._sent_offset = 0
        self._tokenizer = None
        self._special_stops: dict[int, str] = {}
        if tokenizer is not None and params.detokenize and self.stop and params.skip_special_tokens:
            self._special_stops = special_stop_tokens(tokenizer, self.stop)
        if tokenizer is not None and params.detokenize:
            from tokenizers.decoders import DecodeStream

            self._tokenizer = tokenizer.backend_tokenizer
            self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
            for token_id in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]:
                self._stream.step(self._tokenizer, token_id)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add tokens; returns the stop string that ended the text, or None.

        ``stop_terminated``: the engine ended the request with EOS or a stop token id; that
        last token's text is left out unless ``include_stop_str_in_output``.
        """
        if self._tokenizer is None:
            return None
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        before = len(self.output_text)
        special_stop = None
        for token_id in new_token_ids:
            special_stop = self._special_stops.get(token_id)
            if special_stop is not None:
                break
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                self.output_text += piece
        if not self.stop:
            return None
        hit = find_stop_string(
            self.output_text, len(self.output_text) - before, self.stop, self.include_stop_str_in_output
        )
        if hit is None:
            if special_stop is not None and self.include_stop_str_in_output:
                self.output_text += special_stop
            return special_stop
        stop_str, end = hit
        self.output_text = self.output_text[:end]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report: everything so far, or (``delta``) what was not reported yet;
        while running, minus the held-back stop-string buffer."""
        hold = 0 if finished else self.stop_buffer_length
        end = len(self.output_text) - hold
        if not delta:
            return self.output_text[:end] if hold else self.output_text
        start = self._sent_offset
        if start >= end:
            return ""
        self._sent_offset = end
        return self.output_text[start:end]


def special_stop_tokens(tokenizer: PreTrainedTokenizerFast, stop: list[str]) -> dict[int, str]:
    """Token id -> stop string, for the special tokens whose text is one of ``stop``."""
    wanted = set(stop)
    return {
        token_id: added.content
        for token_id, added in tokenizer.added_tokens_decoder.items()
        if added.special and added.content in wanted
    }


def find_stop_string(
    text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """The earliest stop string that ends within the last ``new_char_count`` characters.

    Returns ``(stop_string, cut)`` where ``text[:cut]`` is the text to keep (before the stop
    string, or through it when ``include_in_output``), or None.
    """
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, len(text) - new_char_count - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return s, idx + len(s) if include_in_output else idx
