"""Batched LoRA (Hu et al., 2021): every token of a step adds the low-rank update of its own
adapter to a linear layer's output, all tokens in one call.

``y[t] += B[s_t] @ (A[s_t] @ x[t])`` for each token ``t`` whose slot ``s_t >= 0``; tokens of
slot -1 (the base model) are left as they are. ``A`` and ``B`` hold one adapter per slot,
zero-padded to the slots' rank, with the adapter's scaling (``lora_alpha / r``, or
``/ sqrt(r)`` for rsLoRA) already folded into ``B``. This is the "shrink then expand" of
Punica's BGMV/SGMV kernels (Chen et al., 2023, "Punica: Multi-Tenant LoRA Serving"): many
adapters over one base model in one batch.

Forms (same positional signature, ``y`` updated in place and returned):

* `add_lora_ref`: the definition: each token's adapter gathered and applied with ``bmm``;
* `add_lora_cpu`: one GEMM shrinks every token against the stacked ``A`` of the slots in use,
  a mask keeps each token's own slot's columns, then one ``addmm`` against the stacked
  ``B^T`` of those slots expands (no loop over requests or slots; the masked columns add
  exact zeros). The caller may pass ``B`` also laid out ``[S, R, N]`` (``lora_b_t``) so
  that expand reads it as one matrix without a copy;
* `add_lora_triton` (:mod:`.lora_triton`): a shrink kernel and an expand kernel, one program
  per token and block of outputs (BGMV).
"""

from __future__ import annotations

import torch

from pkgd_kernels._util import FLOAT_DTYPES, check_dtype, check_same, next_power_of_2, on_device, triton_module


def _check(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> None:
    op = "add_lora"
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"{op}: x [T, K] and y [T, N] must share T, got {list(x.shape)} and {list(y.shape)}")
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(
            f"{op}: lora_a must be [S, R, K] and lora_b [S, N, R], got {list(lora_a.shape)}, {list(lora_b.shape)}"
        )
    s, r, k = lora_a.shape
    if k != x.shape[1] or tuple(lora_b.shape) != (s, y.shape[1], r):
        raise ValueError(
            f"{op}: shapes disagree: x {list(x.shape)}, y {list(y.shape)}, lora_a {list(lora_a.shape)}, "
            f"lora_b {list(lora_b.shape)} (expected lora_a [S, R, {x.shape[1]}], lora_b [S, {y.shape[1]}, R])"
        )
    if slots.shape != (x.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{op}: token_slots must be int32/int64 [T={x.shape[0]}], got {slots.dtype} {list(slots.shape)}"
        )
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_same(op, {"x": x, "y": y, "lora_a": lora_a, "lora_b": lora_b})
    check_same(op, {"x": x, "token_slots": slots}, dtype=False)


def add_lora_ref(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """Add each token's LoRA update to ``y`` (PyTorch reference).

    Args:
        y: ``[T, N]`` the base layer's output, float32/float16/bfloat16; updated in place.
        x: ``[T, K]`` the layer's input, same dtype and device.
        lora_a: ``[S, R, K]`` the slots' A matrices (rank padded with zero rows to R).
        lora_b: ``[S, N, R]`` the slots' B matrices, scaling folded in (zero columns past a
            slot's rank).
        token_slots: int32/int64 ``[T]``: each token's slot in ``[0, S)``, or -1 for none.

    Returns:
        ``y``. Accumulates in float32, rounds once to ``y.dtype``.

    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    _check(y, x, lora_a, lora_b, token_slots)
    rows = (token_slots >= 0).nonzero().flatten()
    if rows.numel() == 0:
        return y
    slots = token_slots.index_select(0, rows).long()
    a, b = lora_a.index_select(0, slots).float(), lora_b.index_select(0, slots).float()
    shrink = torch.bmm(a, x.index_select(0, rows).float().unsqueeze(-1))  # [M, R, 1]
    delta = torch.bmm(b, shrink).squeeze(-1)  # [M, N]
    y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))
    return y


def add_lora_cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    active: list[int] | None = None,
    lora_b_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """`add_lora_ref` written for speed on CPU (module docstring): one shrink GEMM over the
    slots in use, a mask, one expand ``addmm``. ``active``: the slots some token uses,
    ascending (computed from ``token_slots`` when None; the runner passes its step's list so
    each of a step's layers skips that scan). ``lora_b_t``: ``lora_b`` transposed to
    ``[S, R, N]`` (contiguous), kept by the caller; None = transposed here (a copy). Same
    arguments, result and errors otherwise."""
    _check(y, x, lora_a, lora_b, token_slots)
    if active is None:
        active = sorted(set(token_slots.tolist()) - {-1})
    if not active:
        return y
    s, r, k = lora_a.shape
    lo, hi = active[0], active[-1] + 1  # one contiguous run of slots: a view, no copy
    shrink = x @ lora_a[lo:hi].reshape((hi - lo) * r, k).t()  # [T, (hi-lo)*R]
    col_slot = torch.arange(lo, hi, device=x.device).repeat_interleave(r)
    shrink = shrink * (token_slots.unsqueeze(1) == col_slot.unsqueeze(0)).to(shrink.dtype)
    b_t = lora_b_t[lo:hi] if lora_b_t is not None else lora_b[lo:hi].transpose(1, 2).contiguous()
    return y.addmm_(shrink, b_t.reshape((hi - lo) * r, y.shape[1]))


def add_lora_triton(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """Triton version of `add_lora_ref` (same arguments, result and errors): a shrink kernel
    writes float32 ``[T, R]``, an expand kernel adds ``B @`` it to ``y``; tokens of slot -1
    return at once in both."""
    _check(y, x, lora_a, lora_b, token_slots)
    if y.shape[1] > 1 and y.stride(1) != 1:
        raise ValueError("add_lora: y must have unit stride along its last dim (it is written in place)")
    t = x.shape[0]
    if t == 0:
        return y
    with on_device(x):
        triton_module("lora_triton").launch_add_lora(
            y, x.contiguous(), lora_a.contiguous(), lora_b.contiguous(), token_slots.contiguous(),
            block_r=next_power_of_2(lora_a.shape[1]),
        )  # fmt: skip
    return y


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    active: list[int] | None = None,
    lora_b_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch `add_lora_ref`'s computation: Triton on CUDA, `add_lora_cpu` elsewhere
    (``active``, ``lora_b_t``: its hints)."""
    if y.is_cuda:
        return add_lora_triton(y, x, lora_a, lora_b, token_slots)
    return add_lora_cpu(y, x, lora_a, lora_b, token_slots, active=active, lora_b_t=lora_b_t)
