"""Offline beam search on top of the engine (vLLM's ``LLM.beam_search``), torch-free.

Each step sends every live beam to the engine as a one-token request asking for the top
``2 × beam_width`` logprobs (prefix caching makes re-sending the beam's tokens cheap: only the
last, partial block is computed again). Every beam is extended by each candidate token;
candidates ending in EOS (unless ``ignore_eos``) are set aside as completed; the
``beam_width`` best of the rest by cumulative logprob continue. After ``max_tokens`` steps, or
when no beam is left, completed and live beams are ranked by the length-penalised score
``cum_logprob / len(tokens) ** length_penalty`` (Wu et al., 2016, GNMT; like vLLM, ``tokens``
includes the prompt) and the best ``beam_width`` are returned. With ``stop`` strings (and a
``decode`` function), a candidate whose generated text contains one is completed with
``finish_reason`` "stop" and its ``text`` cut at the stop string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pkgd.frontend.detokenizer import find_stop_string
from pkgd.outputs import Logprob
from pkgd.sampling_params import BeamSearchParams


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` (prompt then generated), per generated token the candidates'
    logprobs, and its summed log-probability. ``text`` is the decoded ``tokens``."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(seq: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """GNMT's length-normalised score; a final EOS does not count towards the length."""
    length = len(seq.tokens)
    if eos_token_id is not None and seq.tokens and seq.tokens[-1] == eos_token_id:
        length -= 1
    return seq.cum_logprob / (max(length, 1) ** length_penalty)


# (token sequences, number of top logprobs) -> per sequence, the next token's top logprobs
NextTokenFn = Callable[[list[list[int]], int], list[dict[int, Logprob]]]


def beam_search(
    prompts: list[list[int]],
    params: BeamSearchParams,
    next_token_logprobs: NextTokenFn,
    *,
    eos_token_id: int | None,
    max_model_len: int,
    decode: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """Run beam search for each prompt; ``next_token_logprobs`` runs one engine step batch.
    ``decode`` (token ids → text) is needed for ``params.stop``; it also sets each
    sequence's ``text`` (prompt and generated tokens, as vLLM returns it).

    Raises `ValueError` for ``beam_width`` or ``max_tokens`` below 1, or ``stop`` without
    ``decode``.
    """
    if params.beam_width < 1 or params.max_tokens < 1:
        raise ValueError(
            f"beam_width and max_tokens must be at least 1, got {params.beam_width} and {params.max_tokens}"
        )
    if params.stop and decode is None:
        raise ValueError("stop strings need a tokenizer to decode the beams")
    prompt_lens = [len(p) for p in prompts]
    width = params.beam_width
    live = [[BeamSearchSequence(list(p), [])] for p in prompts]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        for i, beams in enumerate(live):
            full = [b for b in beams if len(b.tokens) >= max_model_len]
            for beam in full:
                beam.finish_reason = "length"
            completed[i] += full
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams if beam.finish_reason is None]
        if not flat:
            break
        tops = next_token_logprobs([beam.tokens for _, beam in flat], 2 * width)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), top in zip(flat, tops, strict=True):
            for token_id, lp in top.items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [top], beam.cum_logprob + lp.logprob)
                if token_id == eos_token_id and not params.ignore_eos:
                    new.finish_reason = "stop"
                    completed[i].append(new)
                elif params.stop and _hit_stop(new, prompt_lens[i], params, decode):  # type: ignore[arg-type]
                    completed[i].append(new)
                else:
                    candidates[i].append(new)
        live = [sorted(c, key=lambda b: b.cum_logprob, reverse=True)[:width] for c in candidates]
    live = [[b for b in beams if b.finish_reason is None] for beams in live]
    outputs = []
    for done, beams in zip(completed, live, strict=True):
        for beam in beams:
            beam.finish_reason = "length"
        ranked = sorted(
            done + beams, key=lambda b: beam_search_score(b, eos_token_id, params.length_penalty), reverse=True
        )
        outputs.append(BeamSearchOutput(ranked[:width]))
    if decode is not None:
        for out in outputs:
            for seq in out.sequences:
                if seq.text is None:  # a stopped beam's text is already cut
                    seq.text = decode(seq.tokens)
    return outputs


def _hit_stop(
    seq: BeamSearchSequence, prompt_len: int, params: BeamSearchParams, decode: Callable[[list[int]], str]
) -> bool:
    """Finish ``seq`` when its generated text holds a stop string: set its ``text`` (prompt
    text, then the generated text cut at the stop string) and the reasons."""
    prompt_text = decode(seq.tokens[:prompt_len])
    full = decode(seq.tokens)
    generated = full[len(prompt_text) :] if full.startswith(prompt_text) else decode(seq.tokens[prompt_len:])
    hit = find_stop_string(generated, len(generated), params.stop, params.include_stop_str_in_output)
    if hit is None:
        return False
    stop_str, cut = hit
    seq.finish_reason, seq.stop_reason = "stop", stop_str
    seq.text = prompt_text + generated[:cut]
    return True
