"""Verification of speculative proposals (`pkgd.runner.rejection_sampler`).

Greedy: the kept prefix and the token after it are the argmaxes. Sampled: rejection sampling
keeps the target distribution. The statistical test takes the target's logits from a tiny
random Llama (transformers) at the last prompt position and at the position after a proposed
token, draws ``N`` verifications with a fixed seed, and compares the frequencies of the first
emitted token with ``p0`` and, among draws that kept the proposal, of the second with ``p1``,
by Pearson's chi-square over the tokens expected at least 5 times (the rest pooled in one
bin). The bound is the chi-square quantile at significance 1e-3 (Wilson-Hilferty
approximation): a correct sampler fails with probability 1e-3 over seeds, and the seed is
fixed, so the test is deterministic. The same test applied to a wrong rule (resampling from
``p`` itself after a rejection, which over-weights the proposal) must exceed the bound, which
shows the test has the power to fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.runner.tiny_models import build_tiny

from pkgd.runner.rejection_sampler import VerifyGroup, verify
from pkgd.runner.sampler import Sampler, SamplingRow
from pkgd.sampling_params import SamplingParams

N = 20000
TEMPERATURE = 0.5  # a tiny random model's logits are flat; this spreads p over ~20 tokens


def chi2_bound(df: int, z: float = 3.090) -> float:
    """Upper quantile of chi-square with ``df`` degrees of freedom (z = 3.090: 1e-3)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``p`` and its degrees of freedom."""
    n = counts.sum().item()
    expected = p * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum().double().view(1)])
    exp = torch.cat([expected[big].double(), expected[~big].sum().double().view(1)])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    return stat, int(keep.sum().item()) - 1


@pytest.fixture(scope="module")
def target_logits(tmp_path_factory):
    """Raw logits ``[2, V]`` of a tiny Llama: after the prompt, and after prompt + draft."""
    model = build_tiny("llama", tmp_path_factory.mktemp("rs-llama"))
    prompt = [3, 14, 15, 92, 65, 35]
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1]
        p0 = torch.softmax(first / TEMPERATURE, -1)
        draft = int(torch.argsort(p0, descending=True)[1])  # a likely but not the likeliest token
        both = model(torch.tensor([prompt + [draft]])).logits[0, -2:]
    return both.float(), draft


def draw(logits: torch.Tensor, draft: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token and, where the draft was kept, of the second."""
    sampler = Sampler((), torch.Generator().manual_seed(seed))
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=8)
    v = logits.shape[1]
    first, second = torch.zeros(v, dtype=torch.int64), torch.zeros(v, dtype=torch.int64)
    for _ in range(N):
        group = VerifyGroup(SamplingRow(params, [1], []), [draft])
        tokens, _ = verify(sampler, logits.clone(), [group])
        first[tokens[0][0]] += 1
        if len(tokens[0]) == 2:
            second[tokens[0][1]] += 1
    return first, second


def test_rejection_sampling_keeps_the_target_distribution(target_logits):
    logits, draft = target_logits
    p0 = torch.softmax(logits[0] / TEMPERATURE, -1).double()
    p1 = torch.softmax(logits[1] / TEMPERATURE, -1).double()
    first, second = draw(logits, draft)
    stat, df = chi2(first, p0)
    assert stat < chi2_bound(df), (stat, df)
    assert second.sum() == first[draft]  # the draft was kept exactly when emitted first
    stat, df = chi2(second, p1)
    assert stat < chi2_bound(df), (stat, df)
    # power: a sampler that keeps x with prob p(x) and otherwise redraws from p (x not
    # removed) emits x with prob p + (1 - p) p; the same test must reject that distribution.
    wrong = p0 * (1 - p0[draft])
    wrong[draft] += p0[draft]
    wrong_counts = (wrong * N).round().long()  # what that sampler would give on average
    stat, df = chi2(wrong_counts, p0)
    assert stat > chi2_bound(df)


def test_greedy_keeps_the_matching_prefix_then_the_argmax():
    sampler = Sampler((), torch.Generator().manual_seed(0))
    logits = torch.full((4, 10), -5.0)
    logits[0, 3] = logits[1, 4] = logits[2, 6] = logits[3, 1] = 5.0  # argmaxes 3, 4, 6, 1
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    tokens, _ = verify(sampler, logits.clone(), [VerifyGroup(SamplingRow(greedy, [1], []), [3, 4, 5])])
    assert tokens == [[3, 4, 6]]  # 3 and 4 kept, 5 rejected for the argmax 6
    tokens, _ = verify(sampler, logits.clone(), [VerifyGroup(SamplingRow(greedy, [1], []), [3, 4, 6])])
    assert tokens == [[3, 4, 6, 1]]  # all kept, plus the bonus token
    tokens, lps = verify(
        sampler,
        logits[:1].clone(),
        [VerifyGroup(SamplingRow(SamplingParams(temperature=0.0, max_tokens=8, logprobs=1), [1], []), [])],
    )
    assert tokens == [[3]] and lps[0] is not None and lps[0][0].token_ids[0] == 3


def test_seeded_verification_is_reproducible(target_logits):
    logits, draft = target_logits
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=8, seed=7)
    runs = []
    for gen_seed in (0, 1):  # the shared generator must not matter for a seeded request
        sampler = Sampler((), torch.Generator().manual_seed(gen_seed))
        out = []
        for _ in range(20):
            row = SamplingRow(params, [1], [], torch.Generator())
            out.append(verify(sampler, logits.clone(), [VerifyGroup(row, [draft])])[0][0])
        runs.append(out)
    assert runs[0] == runs[1]
