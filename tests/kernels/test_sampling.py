"""top_k_top_p_mask: reference vs a per-token loop over sorted probabilities, Triton
(interpreted) vs reference. Exact equality: both keep or drop whole logits, and the test rows'
nucleus masses sit far from top_p, so summation order cannot flip a token."""

from __future__ import annotations

import math

import pytest
import torch

from pkgd_kernels import top_k_top_p_mask, top_k_top_p_mask_ref, top_k_top_p_mask_triton

INF = float("inf")


def _naive_row(row: list[float], k: int, p: float) -> list[float]:
    """Keep the k largest (ties kept), then the shortest prefix of the rest, most likely
    first, whose probability reaches p (ties kept), in float64."""
    ordered = sorted(row, reverse=True)
    threshold = -INF
    if 0 < k < len(row):
        threshold = ordered[k - 1]
    if p < 1:
        kept = [x for x in ordered if x >= threshold]
        top = kept[0]
        weights = [math.exp(x - top) if top > -INF else 0.0 for x in kept]
        total, mass, boundary = sum(weights), 0.0, kept[0]
        for x, w in zip(kept, weights):
            boundary = x
            mass += w
            if total > 0 and mass / total >= p:
                break
        threshold = max(threshold, boundary)
    return [x if x >= threshold else -INF for x in row]


def _rows(generator):
    """Logit rows with the (top_k, top_p) each is filtered with."""
    v = 37
    rand = lambda: (torch.randn(v, generator=generator) * 2).tolist()  # noqa: E731
    ties = (torch.randint(0, 4, (v,), generator=generator).float()).tolist()  # many ties
    with_inf = rand()
    with_inf[3] = with_inf[10] = -INF
    return [
        (rand(), 5, 1.0),  # top-k only
        (rand(), 0, 0.7),  # top-p only
        (rand(), 10, 0.5),  # both
        (rand(), 0, 1.0),  # neither
        (rand(), v, 1.0),  # k = V: off
        (rand(), -1, 0.0),  # k < 0: off; p = 0 keeps the argmax
        (ties, 3, 1.0),  # the 3rd largest value is tied: all ties kept
        (ties, 0, 0.2),  # nucleus boundary inside a tie
        (with_inf, 8, 0.9),
        ([-INF] * v, 2, 0.5),  # nothing finite
        ([0.0, -0.0] + [-1.0] * (v - 2), 1, 1.0),  # -0.0 ties with 0.0
    ]


def _batch(rows):
    logits = torch.tensor([r for r, _, _ in rows], dtype=torch.float32)
    top_k = torch.tensor([k for _, k, _ in rows], dtype=torch.int32)
    top_p = torch.tensor([p for _, _, p in rows], dtype=torch.float32)
    return logits, top_k, top_p


def test_reference_matches_naive_loop(generator):
    rows = _rows(generator)
    got = top_k_top_p_mask_ref(*_batch(rows))
    for s, (row, k, p) in enumerate(rows):
        want = torch.tensor(_naive_row(row, k, p), dtype=torch.float32)
        assert torch.equal(got[s], want), f"row {s} (k={k}, p={p})"
    assert (got[0] > -INF).sum() == 5 and (got[3] == torch.tensor(rows[3][0])).all()
    assert (got[6] > -INF).sum() > 3  # ties at the top-k boundary kept


@pytest.mark.parametrize("head", [1, 4, 12])
def test_reference_with_a_short_sorted_prefix(generator, monkeypatch, head):
    """Rows resolved within the top-``head`` values and rows that fall back to a full sort
    (top-p alone with a wide nucleus) give the naive result too."""
    from pkgd_kernels import sampling

    monkeypatch.setattr(sampling, "_HEAD", head)
    rows = _rows(generator) + [((torch.randn(37, generator=generator) * 0.1).tolist(), 0, 0.95)]
    got = top_k_top_p_mask_ref(*_batch(rows))
    for s, (row, k, p) in enumerate(rows):
        want = torch.tensor(_naive_row(row, k, p), dtype=torch.float32)
        assert torch.equal(got[s], want), f"row {s} (k={k}, p={p})"


def test_reference_ignores_token_order(generator):
    logits, top_k, top_p = _batch(_rows(generator))
    perm = torch.randperm(logits.shape[1], generator=generator)
    got = top_k_top_p_mask_ref(logits[:, perm], top_k, top_p)
    assert torch.equal(got, top_k_top_p_mask_ref(logits, top_k, top_p)[:, perm])


@pytest.mark.parametrize("block_v", [16, 64])
def test_triton_matches_reference(triton_interpreter, generator, block_v):
    from pkgd_kernels import sampling_triton

    logits, top_k, top_p = _batch(_rows(generator))
    out = torch.empty_like(logits)
    sampling_triton.launch_top_k_top_p_mask(logits, top_k, top_p, out, block_v=block_v)
    assert torch.equal(out, top_k_top_p_mask_ref(logits, top_k, top_p))


def test_triton_public_function_on_strided_rows(triton_interpreter, generator):
    wide = torch.randn(3, 70, generator=generator)
    logits = wide[:, 3:53]
    top_k = torch.tensor([4, 0, 20], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.6, 0.8], dtype=torch.float32)
    got = top_k_top_p_mask_triton(logits, top_k, top_p)
    assert torch.equal(got, top_k_top_p_mask_ref(logits, top_k, top_p))
    assert torch.equal(wide[:, 3:53], logits)  # input untouched


def test_dispatcher_on_cpu_runs_the_reference(generator):
    logits, top_k, top_p = _batch(_rows(generator))
    assert torch.equal(top_k_top_p_mask(logits, top_k, top_p), top_k_top_p_mask_ref(logits, top_k, top_p))


@pytest.mark.parametrize("op", [top_k_top_p_mask_ref, top_k_top_p_mask_triton])
@pytest.mark.parametrize(
    "logits,top_k,top_p,message",
    [
        (
            torch.zeros(2, 5, dtype=torch.float16),
            torch.zeros(2, dtype=torch.int32),
            torch.ones(2),
            "logits must be float32",
        ),
        (torch.zeros(2, 5), torch.zeros(2, dtype=torch.int64), torch.ones(2), "top_k must be int"),
        (torch.zeros(2, 5), torch.zeros(3, dtype=torch.int32), torch.ones(2), "top_k must have"),
        (torch.zeros(2, 5), torch.zeros(2, dtype=torch.int32), torch.ones(2, 1), "top_p must have"),
        (torch.zeros(5), torch.zeros(1, dtype=torch.int32), torch.ones(1), "logits must have"),
    ],
)
def test_bad_inputs_raise(op, logits, top_k, top_p, message):
    with pytest.raises(ValueError, match=message):
        op(logits, top_k, top_p)
