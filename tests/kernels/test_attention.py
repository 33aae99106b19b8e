"""Paged attention: references vs dense causal attention over the unpaged K/V, Triton kernels
(interpreted) vs the references, and input errors.

Tolerances: float32 atol/rtol 1e-5 against the float64 naive result and 2e-6 between kernel and
reference (summation order and the online softmax's rescaling); float16 atol 2e-3 / rtol 1e-2
(P is rounded to float16 before the P @ V product, as on GPUs).
"""

from __future__ import annotations

import math

import pytest
import torch

import pkgd_kernels as K
from pkgd_kernels import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_decode_triton,
    paged_attention_prefill,
    paged_attention_prefill_ref,
    paged_attention_prefill_triton,
)

from .paged import dense_causal_attention, make_batch, zero_padding

NAIVE = dict(atol=1e-5, rtol=1e-5)
KERNEL = dict(atol=2e-6, rtol=2e-6)
CPU_FORM = dict(atol=1e-5, rtol=1e-5)

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size): ragged lengths, GQA 1/2/4/3,
# a head_dim that is not a power of two, block sizes 1 to 16, an empty padding slot (0).
DECODE_CASES = [
    ([1, 5, 17], 2, 2, 8, 4),
    ([9, 3, 0, 12], 4, 2, 16, 8),
    ([33, 2], 4, 1, 12, 16),
    ([6, 7], 3, 1, 8, 1),
]


@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,block_size", DECODE_CASES)
def test_decode_reference_matches_dense_attention(generator, seq_lens, num_heads, num_kv_heads, head_dim, block_size):
    batch = make_batch(
        generator,
        seq_lens,
        [1] * len(seq_lens),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    # The empty slot has no query row in the naive sum; the reference gives zeros there.
    batch.q_lens = [1 if n else 0 for n in seq_lens]
    scale = head_dim**-0.5
    got = paged_attention_decode_ref(*batch.decode_args, scale)
    keep = torch.tensor(seq_lens) > 0
    want = dense_causal_attention(_drop_empty(batch), scale)
    torch.testing.assert_close(got[keep].double(), want, **NAIVE)
    assert torch.equal(got[~keep], torch.zeros_like(got[~keep]))


def _drop_empty(batch):
    """The batch's non-empty sequences with their one query row each (for the naive sum)."""
    keep = [s for s, q in enumerate(batch.q_lens) if q]
    batch.query = batch.query[keep]
    batch.keys = [batch.keys[s] for s in keep]
    batch.values = [batch.values[s] for s in keep]
    batch.q_lens = [1] * len(keep)
    return batch


@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,block_size", DECODE_CASES)
@pytest.mark.parametrize("partition_size", [None, 16])
def test_decode_triton_matches_reference(
    triton_interpreter,
    generator,
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    partition_size,
):
    from pkgd_kernels import attention_decode_triton

    batch = make_batch(
        generator,
        seq_lens,
        [1] * len(seq_lens),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    scale = head_dim**-0.5
    want = paged_attention_decode_ref(*batch.decode_args, scale)
    out = torch.empty_like(batch.query)
    attention_decode_triton.launch_decode(*batch.decode_args, scale, out, partition_size=partition_size, block_n=16)
    torch.testing.assert_close(out, want, **KERNEL)


def test_decode_triton_public_function_fp16(triton_interpreter, generator):
    batch = make_batch(
        generator, [20, 3, 11], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16
    )
    got = paged_attention_decode_triton(*batch.decode_args, 0.25)
    want = paged_attention_decode_ref(*batch.decode_args, 0.25)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-2)


def test_decode_dispatcher_on_cpu_runs_the_cpu_form(generator):
    batch = zero_padding(make_batch(generator, [4, 9], [1, 1], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4))
    got = paged_attention_decode(*batch.decode_args, 0.5)
    assert torch.equal(got, K.paged_attention_decode_cpu(*batch.decode_args, 0.5))
    torch.testing.assert_close(got, paged_attention_decode_ref(*batch.decode_args, 0.5), **CPU_FORM)


# (seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size): whole prompts, chunks
# after cached context (chunked prefill / prefix hits), decodes and a sequence with no query
# rows this step, mixed in one batch.
PREFILL_CASES = [
    ([7, 20, 5, 16], [7, 5, 1, 16], 2, 2, 8, 4),
    ([40, 3, 9], [18, 3, 0], 4, 1, 16, 8),
    ([17, 1, 30], [17, 1, 2], 6, 2, 12, 16),
    ([5, 6], [3, 6], 3, 3, 8, 1),
]


@pytest.mark.parametrize("seq_lens,q_lens,num_heads,num_kv_heads,head_dim,block_size", PREFILL_CASES)
def test_prefill_reference_matches_dense_causal_attention(
    generator, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size
):
    batch = make_batch(
        generator,
        seq_lens,
        q_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    scale = head_dim**-0.5
    got = paged_attention_prefill_ref(*batch.prefill_args, scale)
    torch.testing.assert_close(got.double(), dense_causal_attention(batch, scale), **NAIVE)


@pytest.mark.parametrize("seq_lens,q_lens,num_heads,num_kv_heads,head_dim,block_size", PREFILL_CASES)
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16)])
def test_prefill_triton_matches_reference(
    triton_interpreter,
    generator,
    seq_lens,
    q_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    block_m,
    block_n,
):
    from pkgd_kernels import attention_prefill_triton

    batch = make_batch(
        generator,
        seq_lens,
        q_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    scale = head_dim**-0.5
    want = paged_attention_prefill_ref(*batch.prefill_args, scale)
    out = torch.full_like(batch.query, float("nan"))
    attention_prefill_triton.launch_prefill(*batch.prefill_args, scale, out, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(out, want, **KERNEL)


def test_prefill_triton_public_function_fp16(triton_interpreter, generator):
    batch = make_batch(
        generator, [24, 6], [10, 6], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16
    )
    got = paged_attention_prefill_triton(*batch.prefill_args, 0.25)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, paged_attention_prefill_ref(*batch.prefill_args, 0.25), atol=2e-3, rtol=1e-2)


def test_prefill_with_one_token_each_equals_decode(generator):
    batch = make_batch(generator, [3, 14, 8], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    torch.testing.assert_close(
        paged_attention_prefill_ref(*batch.prefill_args, 0.3),
        paged_attention_decode_ref(*batch.decode_args, 0.3),
        **KERNEL,
    )


def test_prefill_dispatcher_on_cpu_runs_the_cpu_form(generator):
    batch = zero_padding(make_batch(generator, [6, 9], [6, 2], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4))
    got = paged_attention_prefill(*batch.prefill_args, 0.5)
    assert torch.equal(got, K.paged_attention_prefill_cpu(*batch.prefill_args, 0.5))
    torch.testing.assert_close(got, paged_attention_prefill_ref(*batch.prefill_args, 0.5), **CPU_FORM)


def _small(generator):
    return make_batch(generator, [5, 3], [2, 3], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)


_SHAPE_ERRORS = [
    (lambda b: b.update(query=b["query"][:, :3]), r"query heads \(3\) must be a positive"),
    (lambda b: b.update(query=b["query"][..., :4]), "query must have shape"),
    (lambda b: b.update(query=b["query"].half()), "query is torch.float16"),
    (lambda b: b.update(block_tables=b["block_tables"].long()), "block_tables must be int32"),
    (lambda b: b.update(block_tables=b["block_tables"][:1]), "block_tables must have shape"),
    (lambda b: b.update(seq_lens=b["seq_lens"].long()), "seq_lens must be int32"),
    (lambda b: b.update(value_cache=b["value_cache"][:, :2]), "value_cache must have shape"),
    (lambda b: b.update(scale=math.nan), "scale must be finite"),
]


@pytest.mark.parametrize("mutate,message", _SHAPE_ERRORS)
@pytest.mark.parametrize("op", [paged_attention_decode_ref, paged_attention_decode_triton])
def test_decode_bad_shapes_raise(generator, op, mutate, message):
    batch = _small(generator)
    args = dict(
        query=batch.query[:2],
        key_cache=batch.key_cache,
        value_cache=batch.value_cache,
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        scale=0.5,
    )
    mutate(args)
    with pytest.raises(ValueError, match=message):
        op(**args)


@pytest.mark.parametrize(
    "mutate,message",
    _SHAPE_ERRORS
    + [
        (lambda b: b.update(query_start_loc=b["query_start_loc"][:2]), "query_start_loc must h"),
        (lambda b: b.update(query_start_loc=b["query_start_loc"].long()), "query_start_loc must b"),
    ],
)
@pytest.mark.parametrize("op", [paged_attention_prefill_ref, paged_attention_prefill_triton])
def test_prefill_bad_shapes_raise(generator, op, mutate, message):
    batch = _small(generator)
    args = dict(
        zip(["query", "key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens"], batch.prefill_args),
        scale=0.5,
    )
    mutate(args)
    with pytest.raises(ValueError, match=message):
        op(**args)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(seq_lens=[5, 13]), r"seq_lens must lie in \[0, 12\]"),
        (dict(query_start_loc=[0, 2, 4]), "query_start_loc must rise from 0 to T=5"),
        (dict(query_start_loc=[0, 1, 5]), "more query tokens than keys"),
        (dict(block_id=99), r"block id outside \[0, "),
    ],
)
def test_prefill_reference_rejects_bad_values(generator, change, message):
    batch = _small(generator)
    if "seq_lens" in change:
        batch.seq_lens = torch.tensor(change["seq_lens"], dtype=torch.int32)
    if "query_start_loc" in change:
        batch.query_start_loc = torch.tensor(change["query_start_loc"], dtype=torch.int32)
    if "block_id" in change:
        batch.block_tables[1, 0] = change["block_id"]
    with pytest.raises(ValueError, match=message):
        paged_attention_prefill_ref(*batch.prefill_args, 0.5)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2 along the last dim."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def test_triton_accepts_strided_metadata(triton_interpreter, generator):
    batch = make_batch(generator, [9, 20, 4], [3, 1, 4], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    want = paged_attention_prefill_ref(*batch.prefill_args, 0.25)
    q, kc, vc, bt, qsl, lens = batch.prefill_args
    got = paged_attention_prefill_triton(q, kc, vc, _strided(bt), _strided(qsl), _strided(lens), 0.25)
    torch.testing.assert_close(got, want, **KERNEL)
    decode = make_batch(generator, [9, 20, 4], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    q, kc, vc, bt, lens = decode.decode_args
    got = paged_attention_decode_triton(q, kc, vc, _strided(bt), _strided(lens), 0.25)
    torch.testing.assert_close(got, paged_attention_decode_ref(*decode.decode_args, 0.25), **KERNEL)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_steps_through_the_cache_match_one_dense_pass(request, generator, impl):
    """Two sequences advance together: a prompt chunk, a second chunk over the cached first
    (chunked prefill), then a decode step, each writing its K/V with reshape_and_cache
    first. Every token's output equals causal attention over the whole sequence at once."""
    import pkgd_kernels as K

    if impl == "triton":
        request.getfixturevalue("triton_interpreter")
    cache_op = getattr(K, f"reshape_and_cache_{impl}")
    prefill = getattr(K, f"paged_attention_prefill_{impl}")
    decode = getattr(K, f"paged_attention_decode_{impl}")
    num_heads, num_kv_heads, head_dim, block_size, scale = 4, 2, 16, 4, 0.25
    lengths, chunks = [13, 9], [(7, 5), (4, 4)]  # per sequence: first chunk, second chunk
    tables = torch.tensor([[5, 2, 7, 0], [1, 6, 3, 0]], dtype=torch.int32)
    q = [torch.randn(n, num_heads, head_dim, generator=generator) for n in lengths]
    k = [torch.randn(n, num_kv_heads, head_dim, generator=generator) for n in lengths]
    v = [torch.randn(n, num_kv_heads, head_dim, generator=generator) for n in lengths]
    cache_shape = (8, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(cache_shape), torch.zeros(cache_shape)
    outputs = [torch.empty_like(x) for x in q]
    done = [0, 0]
    for step in range(3):
        spans = [(done[s], done[s] + (chunks[s][step] if step < 2 else 1)) for s in range(2)]
        pos = torch.cat([torch.arange(a, b) for a, b in spans])
        seq = torch.cat([torch.full((b - a,), s) for s, (a, b) in enumerate(spans)])
        slots = tables[seq, pos // block_size].long() * block_size + pos % block_size
        cache_op(
            torch.cat([k[s][a:b] for s, (a, b) in enumerate(spans)]),
            torch.cat([v[s][a:b] for s, (a, b) in enumerate(spans)]),
            key_cache,
            value_cache,
            slots,
        )
        query = torch.cat([q[s][a:b] for s, (a, b) in enumerate(spans)])
        seq_lens = torch.tensor([b for _, b in spans], dtype=torch.int32)
        if step < 2:
            q_lens = [b - a for a, b in spans]
            starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
            out = prefill(query, key_cache, value_cache, tables, starts, seq_lens, scale)
        else:
            out = decode(query, key_cache, value_cache, tables, seq_lens, scale)
        rows = out.split([b - a for a, b in spans])
        for s, (a, b) in enumerate(spans):
            outputs[s][a:b] = rows[s]
            done[s] = b
    for s in range(2):
        group = num_heads // num_kv_heads
        keys, values = k[s].repeat_interleave(group, 1), v[s].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s], keys) * scale
        causal = torch.ones(lengths[s], lengths[s], dtype=torch.bool).tril()
        want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, -torch.inf).softmax(-1), values)
        torch.testing.assert_close(outputs[s], want, **NAIVE)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_empty_batches_and_empty_sequences(request, impl):
    """No sequences at all, and sequences with no keys (padded slots): zeros, no error."""
    import pkgd_kernels as K

    if impl == "triton":
        request.getfixturevalue("triton_interpreter")
    decode = getattr(K, f"paged_attention_decode_{impl}")
    prefill = getattr(K, f"paged_attention_prefill_{impl}")
    cache = torch.randn(3, 4, 2, 16)
    for num_seqs in (0, 2):
        query = torch.randn(num_seqs, 4, 16)
        tables = torch.zeros(num_seqs, 2, dtype=torch.int32)
        lens = torch.zeros(num_seqs, dtype=torch.int32)
        out = decode(query, cache, cache, tables, lens, 0.25)
        assert out.shape == query.shape and not out.any()
        starts = torch.zeros(num_seqs + 1, dtype=torch.int32)
        out = prefill(query[:0], cache, cache, tables, starts, lens, 0.25)
        assert out.shape == (0, 4, 16)


# Sliding window and soft cap: (sliding_window, soft_cap); windows shorter and longer than
# the sequences (a window that cuts nothing must equal none), a cap that bites on scores of
# randn inputs (|scale * q . k| reaches ~4 at head_dim 16).
OPTIONS = [(5, 0.0), (0, 2.0), (3, 1.5), (64, 0.0)]
WINDOW_DECODE = ([1, 5, 17, 40], 4, 2, 16, 4)
WINDOW_PREFILL = ([7, 20, 5, 40, 9], [7, 5, 1, 40, 1], 4, 2, 16, 4)


def _window_batch(generator, prefill: bool, dtype=torch.float32):
    if prefill:
        seq_lens, q_lens, hq, hkv, d, bs = WINDOW_PREFILL
    else:
        seq_lens, hq, hkv, d, bs = WINDOW_DECODE
        q_lens = [1] * len(seq_lens)
    return make_batch(
        generator, seq_lens, q_lens, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype
    )


@pytest.mark.parametrize("sliding_window,soft_cap", OPTIONS)
def test_references_with_window_and_soft_cap_match_dense_attention(generator, sliding_window, soft_cap):
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    for prefill in (False, True):
        batch = _window_batch(generator, prefill)
        if prefill:
            got = paged_attention_prefill_ref(*batch.prefill_args, 0.25, **opts)
        else:
            got = paged_attention_decode_ref(*batch.decode_args, 0.25, **opts)
        torch.testing.assert_close(got.double(), dense_causal_attention(batch, 0.25, **opts), **NAIVE)


def test_window_and_soft_cap_change_the_result(generator):
    """The options are not silently ignored: each moves the output of long sequences."""
    batch = _window_batch(generator, prefill=True)
    plain = paged_attention_prefill_ref(*batch.prefill_args, 0.25)
    for opts in (dict(sliding_window=5), dict(soft_cap=1.0)):
        assert not torch.allclose(paged_attention_prefill_ref(*batch.prefill_args, 0.25, **opts), plain)


@pytest.mark.parametrize("sliding_window,soft_cap", OPTIONS)
@pytest.mark.parametrize("partition_size", [None, 16])
def test_decode_triton_with_window_and_soft_cap(
    triton_interpreter, generator, sliding_window, soft_cap, partition_size
):
    from pkgd_kernels import attention_decode_triton

    batch = _window_batch(generator, prefill=False)
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    want = paged_attention_decode_ref(*batch.decode_args, 0.25, **opts)
    out = torch.empty_like(batch.query)
    attention_decode_triton.launch_decode(
        *batch.decode_args, 0.25, out, partition_size=partition_size, block_n=16, **opts
    )
    torch.testing.assert_close(out, want, **KERNEL)


@pytest.mark.parametrize("sliding_window,soft_cap", OPTIONS)
def test_prefill_triton_with_window_and_soft_cap(triton_interpreter, generator, sliding_window, soft_cap):
    from pkgd_kernels import attention_prefill_triton

    batch = _window_batch(generator, prefill=True)
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    want = paged_attention_prefill_ref(*batch.prefill_args, 0.25, **opts)
    out = torch.full_like(batch.query, float("nan"))
    attention_prefill_triton.launch_prefill(*batch.prefill_args, 0.25, out, block_m=32, block_n=16, **opts)
    torch.testing.assert_close(out, want, **KERNEL)


@pytest.mark.parametrize("sliding_window,soft_cap", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_forms_with_window_and_soft_cap(generator, sliding_window, soft_cap, dtype):
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    tol = CPU_FORM if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    batch = zero_padding(_window_batch(generator, prefill=False, dtype=dtype))
    got = paged_attention_decode(*batch.decode_args, 0.25, **opts)
    torch.testing.assert_close(got, paged_attention_decode_ref(*batch.decode_args, 0.25, **opts), **tol)
    batch = zero_padding(_window_batch(generator, prefill=True, dtype=dtype))
    got = paged_attention_prefill(*batch.prefill_args, 0.25, **opts)
    torch.testing.assert_close(got, paged_attention_prefill_ref(*batch.prefill_args, 0.25, **opts), **tol)


@pytest.mark.parametrize("op", [paged_attention_decode_ref, paged_attention_prefill_ref])
def test_negative_options_raise(generator, op):
    batch = _window_batch(generator, prefill=op is paged_attention_prefill_ref)
    args = batch.prefill_args if op is paged_attention_prefill_ref else batch.decode_args
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        op(*args, 0.25, sliding_window=-1)
    with pytest.raises(ValueError, match="soft_cap must be finite"):
        op(*args, 0.25, soft_cap=-1.0)
