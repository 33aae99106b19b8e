"""`Sampler`: next tokens from logits, with vLLM v1's processing order and meanings.

Order, per row (``logits [N, V]`` float32, one row per request that samples this step):

1. raw logprobs (``log_softmax`` of the model's logits) for rows that asked for logprobs, as
   vLLM v1 returns by default;
2. ``allowed_token_ids``: every other token -inf; ``bad_words``: the last token of each
   bad-word sequence -inf when the tokens before it end the output so far (vLLM's rule);
3. ``min_tokens``: EOS and ``stop_token_ids`` set to -inf while fewer outputs exist;
   ``logit_bias`` added (OpenAI);
4. penalties: repetition (CTRL, Keskar et al., 2019: positive logits of seen tokens divided
   by the penalty, negative ones multiplied; prompt and output tokens), frequency
   (``-= penalty * count``) and presence (``-= penalty * [count > 0]``) over output tokens;
5. greedy rows: argmax. Other rows: divide by temperature, ``min_p`` (drop tokens below
   ``min_p`` × the top probability), top-k / top-p (``pkgd_kernels.top_k_top_p_mask``), then sample by the
   exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` per token picks token i with
   probability ``p_i`` (the Gumbel-max trick in exponential form, as vLLM v1's sampler).

Seeded requests draw ``q`` from their own `torch.Generator`, re-seeded every step from
``(seed, output index)``: a request's tokens depend only on its seed and its own history,
whatever else is in the batch and even across preemption. Unseeded rows share the runner's
generator (seeded from ``model.seed``).

When every row is greedy without processing or logprobs, sampling is one ``argmax``.
"""

from __future__ import annotations

import dataclasses

import torch

import pkgd_kernels as pk
from pkgd.logprobs import TokenLogprobs
from pkgd.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclasses.dataclass
class SamplingRow:
    """What the sampler needs about one request that samples this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # for seeded requests


@dataclasses.dataclass
class SamplerOutput:
    """``token_ids [N]`` int64; ``logprobs[i]`` set for rows that asked for logprobs."""

    token_ids: torch.Tensor
    logprobs: list[TokenLogprobs | None]


def step_seed(seed: int, output_index: int) -> int:
    """64-bit seed of a seeded request's draw for its ``output_index``-th token (SplitMix64
    finaliser of ``seed`` and the index, Steele et al., 2014), so draws are independent across
    steps yet reproducible."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    """Samples one token per row. ``eos_token_ids`` are what ``min_tokens`` suppresses
    (besides each request's ``stop_token_ids``); ``generator`` serves unseeded rows."""

    def __init__(self, eos_token_ids: tuple[int, ...], generator: torch.Generator) -> None:
        self.eos_token_ids = eos_token_ids
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample from ``logits [N, V]`` (float32, modified in place) for ``rows`` (N)."""
        n = len(rows)
        want_lp = [r.params.logprobs is not None for r in rows]
        raw_lp = None
        if any(want_lp):
            idx = [i for i in range(n) if want_lp[i]]
            raw_lp = torch.log_softmax(logits[idx] if len(idx) < n else logits, dim=-1)
        self._process(logits, rows)
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows, greedy)
        logprobs: list[TokenLogprobs | None] = [None] * n
        if raw_lp is not None:
            lp_rows = [i for i in range(n) if want_lp[i]]
            found = batch_token_logprobs(raw_lp, tokens[lp_rows], [rows[i].params.logprobs or 0 for i in lp_rows])
            for i, entry in zip(lp_rows, found):
                logprobs[i] = entry
        return SamplerOutput(tokens, logprobs)

    # ---- logits processing ---------------------------------------------------------------

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Steps 2-4, in place. Token ids outside the vocabulary are ignored (the frontend
        validates them; the runner must not fail a whole step over one request)."""
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if p.allowed_token_ids is not None:
                allowed = torch.tensor([t for t in p.allowed_token_ids if 0 <= t < vocab], dtype=torch.int64)
                keep = logits[i, allowed].clone()
                logits[i] = float("-inf")
                logits[i, allowed] = keep
            if p.bad_words_token_ids:
                banned_last = bad_word_tokens(p.bad_words_token_ids, r.output_token_ids, vocab)
                if banned_last:
                    logits[i, banned_last] = float("-inf")
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                banned = [t for t in banned if 0 <= t < vocab]
                if banned:
                    logits[i, banned] = float("-inf")
            if p.logit_bias:
                bias = {int(t): b for t, b in p.logit_bias.items() if 0 <= int(t) < vocab}
                if bias:
                    ids = torch.tensor(list(bias.keys()), dtype=torch.int64)
                    logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)
        pen = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
        if pen:
            apply_penalties(logits, [rows[i] for i in pen], pen)

    # ---- random sampling -----------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> torch.Tensor:
        tokens = torch.empty(len(rows), dtype=torch.int64)
        g_idx = [i for i in range(len(rows)) if greedy[i]]
        if g_idx:
            tokens[g_idx] = logits[g_idx].argmax(dim=-1)
        r_idx = [i for i in range(len(rows)) if not greedy[i]]
        sub = logits[r_idx] if g_idx else logits
        rr = [rows[i] for i in r_idx]
        probs = self.probs(sub, rr)
        q = self._exponentials(probs, rr)
        tokens[r_idx] = probs.div_(q).argmax(dim=-1)
        return tokens

    @staticmethod
    def probs(sub: torch.Tensor, rr: list[SamplingRow]) -> torch.Tensor:
        """The distribution sampled from: ``sub [M, V]`` (processed logits of non-greedy rows,
        modified in place) divided by temperature, ``min_p``, top-k / top-p, softmax. Returns
        float32 ``[M, V]`` probabilities."""
        temps = torch.tensor([r.params.temperature for r in rr], dtype=sub.dtype)
        sub.div_(temps.unsqueeze(1))
        min_p = [r.params.min_p for r in rr]
        if any(min_p):
            probs = sub.softmax(dim=-1)
            thresh = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, dtype=sub.dtype).unsqueeze(1)
            sub.masked_fill_(probs < thresh, float("-inf"))
        top_k = [max(r.params.top_k, 0) for r in rr]
        top_p = [r.params.top_p for r in rr]
        if any(top_k) or any(p < 1.0 for p in top_p):
            sub = pk.top_k_top_p_mask(
                sub, torch.tensor(top_k, dtype=torch.int32), torch.tensor(top_p, dtype=torch.float32)
            )
        return sub.softmax(dim=-1)

    def _exponentials(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            return q.exponential_(generator=self.generator)
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                r.generator.manual_seed(step_seed(r.params.seed or 0, len(r.output_token_ids)))
                q[i].exponential_(generator=r.generator)
        return q


def bad_word_tokens(sequences: list[list[int]], output_token_ids: list[int], vocab: int) -> list[int]:
    """The tokens a request may not sample next: the last token of each bad-word sequence
    whose other tokens end ``output_token_ids`` (a one-token sequence always)."""
    banned = []
    for seq in sequences:
        *before, last = seq
        if not 0 <= last < vocab or len(before) > len(output_token_ids):
            continue
        if not before or output_token_ids[-len(before) :] == before:
            banned.append(last)
    return banned


def _has_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], row_index: list[int]) -> None:
    """Repetition, frequency and presence penalties for ``rows`` at ``logits[row_index]``,
    in place (see the module docstring for the formulas)."""
    vocab = logits.shape[1]
    out_counts = _counts([r.output_token_ids for r in rows], vocab)
    sub = logits[row_index]
    rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype).unsqueeze(1)
    if bool((rep != 1.0).any()):
        seen = (out_counts > 0) | (_counts([r.prompt_token_ids for r in rows], vocab) > 0)
        factor = torch.where(sub > 0, 1.0 / rep, rep)
        sub = torch.where(seen, sub * factor, sub)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype).unsqueeze(1)
    sub = sub - freq * out_counts - pres * (out_counts > 0).to(logits.dtype)
    logits[row_index] = sub


def _counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float32 occurrence counts."""
    counts = torch.zeros(len(token_lists), vocab + 1)
    longest = max((len(t) for t in token_lists), default=0)
    if longest:
        padded = torch.full((len(token_lists), longest), vocab, dtype=torch.int64)
        for i, t in enumerate(token_lists):
            if t:
                padded[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        counts.scatter_add_(1, padded, torch.ones(padded.shape))
    return counts[:, :vocab]


def batch_token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Per row of ``logprobs [M, V]`` (natural log): the logprob and rank (1 = most likely) of
    ``tokens[m]`` (int64 ``[M]``) and the top ``ks[m]`` candidates."""
    tokens = tokens.to(torch.int64).view(-1, 1)
    chosen = logprobs.gather(1, tokens)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    kmax = max(ks, default=0)
    top_ids: list[list[int]] = [[] for _ in ks]
    top_lps: list[list[float]] = [[] for _ in ks]
    if kmax:
        top = logprobs.topk(kmax, dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    chosen_l, token_l = chosen.view(-1).tolist(), tokens.view(-1).tolist()
    return [
        TokenLogprobs(
            token_ids=[token_l[m]] + top_ids[m][: ks[m]], logprobs=[chosen_l[m]] + top_lps[m][: ks[m]], rank=ranks[m]
        )
        for m in range(len(ks))
    ]
