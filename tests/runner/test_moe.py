"""The MoE layer: each family's routing, the grouped expert path against the per-expert
reference, expert-parallel shards that sum to the whole, and loading per-expert weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pkgd.runner.distributed import TPGroup
from pkgd.runner.layers import moe as moe_mod
from pkgd.runner.layers.moe import FusedMoE, experts_grouped, experts_reference, select_experts

pytestmark = pytest.mark.skipif(not moe_mod.GROUPED_MM, reason="torch without grouped_mm")

E, K, H, FEAT = 6, 2, 32, 16


def _random(t: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, H, generator=g).to(dtype)
    w13 = (0.2 * torch.randn(E, 2 * FEAT, H, generator=g)).to(dtype)
    w2 = (0.2 * torch.randn(E, H, FEAT, generator=g)).to(dtype)
    logits = torch.randn(t, E, generator=g)
    return h, w13, w2, logits


def _dense(h, w13, w2, weights, ids):
    """Every token through each of its k experts, one token at a time (the definition)."""
    out = torch.zeros(h.shape, dtype=torch.float32)
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(h[t].float(), w13[e].float()).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[e].float())
    return out


def test_mixtral_routing_is_a_softmax_over_the_top_k_logits():
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(1))
    weights, ids = select_experts(logits, K, renormalize=True)
    top, top_ids = torch.topk(logits, K, dim=-1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1))


def test_qwen3_moe_routing_keeps_softmax_over_all_experts_unless_norm_topk_prob():
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(logits, dim=-1)
    raw, ids = select_experts(logits, K, renormalize=False)
    torch.testing.assert_close(raw, torch.gather(probs, 1, ids))
    assert (raw.sum(-1) < 1).all()
    normed, ids2 = select_experts(logits, K, renormalize=True)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(normed, raw / raw.sum(-1, keepdim=True))
    assert raw.dtype == normed.dtype == torch.float32 and ids.dtype == torch.int64


@pytest.mark.parametrize("t", [1, 3, 40])
def test_reference_is_the_per_token_definition(t):
    h, w13, w2, logits = _random(t, torch.float32)
    weights, ids = select_experts(logits, K, True)
    torch.testing.assert_close(experts_reference(h, w13, w2, weights, ids), _dense(h, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t", [1, 2, 7, 64])
def test_grouped_path_matches_the_reference(t, dtype, tol, cpu_path):
    h, w13, w2, logits = _random(t, dtype, seed=t)
    weights, ids = select_experts(logits, K, False)
    want = experts_reference(h, w13, w2, weights, ids)
    got = experts_grouped(h, w13, w2, weights, ids, kernels=cpu_path)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_grouped_path_runs_two_grouped_gemms_whatever_the_token_count(monkeypatch):
    calls = []
    inner = F.grouped_mm

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return inner(*a, **kw)

    monkeypatch.setattr(F, "grouped_mm", counted)
    for t in (1, 50):
        calls.clear()
        h, w13, w2, logits = _random(t, torch.float32)
        experts_grouped(h, w13, w2, *select_experts(logits, K, True))
        assert calls == [t * K, t * K]  # gate/up, then down, over every (token, slot) pair


def test_an_expert_no_token_picks_contributes_nothing_and_costs_no_error():
    h, w13, w2, logits = _random(5, torch.float32)
    logits[:, 0] = logits[:, 1] = logits[:, 5] = -30.0  # experts 0, 1 and 5: never in the top 2
    weights, ids = select_experts(logits, K, True)
    assert not ({0, 1, 5} & set(ids.flatten().tolist()))
    torch.testing.assert_close(experts_grouped(h, w13, w2, weights, ids), experts_reference(h, w13, w2, weights, ids))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["feature-split", "expert-parallel"])
def test_two_ranks_shards_sum_to_the_whole_layer(expert_parallel):
    """What each of 2 ranks computes from the weights it loads (experts split, or each expert's
    features) adds up to the one-rank layer: the all-reduce's sum."""
    whole = FusedMoE(E, K, H, 2 * FEAT, renormalize=True)
    g = torch.Generator().manual_seed(3)
    router = torch.randn(E, H, generator=g)
    experts = [
        {
            p: 0.2 * torch.randn(*(H, 2 * FEAT) if p == "down" else (2 * FEAT, H), generator=g)
            for p in ("gate", "up", "down")
        }
        for _ in range(E)
    ]
    ranks = [FusedMoE(E, K, H, 2 * FEAT, renormalize=True, tp=TPGroup(r, 2, expert_parallel)) for r in range(2)]
    with torch.no_grad():
        for layer in (whole, *ranks):
            layer.load_router(router)
            for e, parts in enumerate(experts):
                for part, w in parts.items():
                    layer.load_expert(e, part, w)
    if expert_parallel:
        assert [r.num_local_experts for r in ranks] == [3, 3] and ranks[1].first_expert == 3
        assert ranks[0].w13.shape == (3, 4 * FEAT, H)
    else:
        assert ranks[0].w13.shape == (E, 2 * FEAT, H) and ranks[0].w2.shape == (E, H, FEAT)
    h = torch.randn(11, H, generator=g)
    torch.testing.assert_close(ranks[0].forward_local(h) + ranks[1].forward_local(h), whole(h), atol=1e-5, rtol=1e-5)
    for layer in (whole, *ranks):  # the reference path agrees shard by shard too
        weights, ids = select_experts(F.linear(h, layer.gate), K, True)
        torch.testing.assert_close(
            experts_reference(h, layer.w13, layer.w2, weights, ids, layer.first_expert),
            experts_grouped(h, layer.w13, layer.w2, weights, ids, layer.first_expert),
        )


def test_shapes_that_do_not_shard_or_do_not_load_are_refused():
    from pkgd.config.errors import ModelConfigMismatch

    with pytest.raises(ModelConfigMismatch, match=r"num_experts \(expert parallel\) \(6\) is not divisible"):
        FusedMoE(E, K, H, FEAT, renormalize=True, tp=TPGroup(0, 4, expert_parallel=True))
    with pytest.raises(ModelConfigMismatch, match=r"intermediate_size \(16\) is not divisible"):
        FusedMoE(E, K, H, FEAT, renormalize=True, tp=TPGroup(0, 3))
    with pytest.raises(ValueError, match="num_experts_per_tok 7"):
        FusedMoE(E, 7, H, FEAT, renormalize=True)
    layer = FusedMoE(E, K, H, FEAT, renormalize=True)
    with pytest.raises(ValueError, match=r"expert 2 up: checkpoint shape \(16, 31\)"):
        layer.load_expert(2, "up", torch.zeros(FEAT, H - 1))
    with pytest.raises(ValueError, match="expert 6 is outside"):
        layer.load_expert(6, "up", torch.zeros(FEAT, H))


def test_odd_row_sizes_take_the_reference_path():
    """grouped_mm needs 16-byte row strides: an intermediate size of 6 float32 features falls back."""
    layer = FusedMoE(E, K, H, 6, renormalize=True)
    torch.nn.init.normal_(layer.gate)
    torch.nn.init.normal_(layer.w13)
    torch.nn.init.normal_(layer.w2)
    h = torch.randn(4, H)
    assert not layer.grouped_applies(h) and FusedMoE(E, K, H, FEAT, renormalize=True).grouped_applies(h)
    weights, ids = select_experts(F.linear(h, layer.gate), K, True)
    torch.testing.assert_close(layer(h), experts_reference(h, layer.w13, layer.w2, weights, ids))
