"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary
Position Embedding"), applied to query and key heads with a precomputed cos/sin table.

Pairs of channels among the first ``rot_dim`` of each head are rotated by the angle of the
token's position; channels past ``rot_dim`` (partial rotary) pass through unchanged. Two
pairings exist: GPT-NeoX style (``is_neox=True``, Llama/Qwen/Hugging Face's ``rotate_half``)
pairs channel ``i`` with ``i + rot_dim/2``; GPT-J style pairs ``2i`` with ``2i + 1``. In both,
pair ``i`` uses ``cos_sin_cache[pos, i]`` and ``cos_sin_cache[pos, rot_dim/2 + i]`` (vLLM's
table layout: cos in the first half of the columns, sin in the second)::

    out_a = a * cos - b * sin
    out_b = b * cos + a * sin

The rotation is computed in float32 and rounded once to the input dtype.
"""

from __future__ import annotations

import dataclasses

import torch

from pkgd_kernels._util import (
    FLOAT_DTYPES,
    check_dtype,
    check_same,
    check_shape,
    next_power_of_2,
    on_device,
    triton_module,
    unit_stride,
    use_triton,
)

_OP = "rotary_embedding"


def _check(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> int:
    """Check the arguments and return ``rot_dim``."""
    check_shape(_OP, "positions", positions, [None])
    check_dtype(_OP, "positions", positions, [torch.int64])
    num_tokens = positions.shape[0]
    if head_size <= 0:
        raise ValueError(f"{_OP}: head_size must be > 0, got {head_size}")
    for name, t in (("query", query), ("key", key)):
        check_shape(_OP, name, t, [num_tokens, None])
        if t.shape[1] % head_size != 0:
            raise ValueError(f"{_OP}: {name} must have shape [T, heads * {head_size}], got {list(t.shape)}")
    check_dtype(_OP, "query", query, FLOAT_DTYPES)
    check_shape(_OP, "cos_sin_cache", cos_sin_cache, [None, None])
    check_dtype(_OP, "cos_sin_cache", cos_sin_cache, FLOAT_DTYPES + (torch.float64,))
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 != 0 or not 0 < rot_dim <= head_size:
        raise ValueError(
            f"{_OP}: cos_sin_cache must have shape [max_position, rot_dim] with rot_dim even and "
            f"0 < rot_dim <= head_size={head_size}, got {list(cos_sin_cache.shape)}"
        )
    check_same(_OP, {"query": query, "key": key})
    check_same(_OP, {"query": query, "positions": positions, "cos_sin_cache": cos_sin_cache}, dtype=False)
    return rot_dim


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, is_neox: bool) -> torch.Tensor:
    """Rotate ``x`` ``[T, H*D]`` with ``cos``/``sin`` ``[T, rot_dim/2]`` float32; new tensor."""
    heads = x.view(x.shape[0], x.shape[1] // head_size, head_size)
    rot_dim = 2 * cos.shape[-1]
    rot = heads[..., :rot_dim].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    if is_neox:
        a, b = rot.chunk(2, dim=-1)
        rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    out = torch.cat((rotated.to(x.dtype), heads[..., rot_dim:]), dim=-1)
    return out.view(x.shape)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to ``query`` and ``key`` (PyTorch reference).

    Args:
        positions: int64 ``[T]``, each token's position, in ``[0, max_position)``.
        query: ``[T, num_heads * head_size]`` float32/float16/bfloat16, unit last-dim stride
            (a view into a fused QKV row is fine).
        key: ``[T, num_kv_heads * head_size]``, same dtype and device.
        head_size: channels per head.
        cos_sin_cache: ``[max_position, rot_dim]``, any float dtype: cos in columns
            ``[0, rot_dim/2)``, sin in ``[rot_dim/2, rot_dim)``; rot_dim even, <= head_size.
        is_neox: GPT-NeoX pairing (``i``, ``i + rot_dim/2``) if True, GPT-J (``2i``, ``2i+1``)
            otherwise.

    Returns:
        ``(query, key)``: new tensors, same shapes and dtype as the inputs.

    Raises:
        ValueError: shapes, dtypes or devices disagree, or a position lies outside the table.
    """
    rot_dim = _check(positions, query, key, head_size, cos_sin_cache)
    max_position = cos_sin_cache.shape[0]
    bad = (positions < 0) | (positions >= max_position)
    if bool(bad.any()):
        raise ValueError(f"{_OP}: positions must lie in [0, {max_position}), got {positions[bad][0].item()}")
    cos_sin = cos_sin_cache.index_select(0, positions).float()
    cos, sin = cos_sin[:, : rot_dim // 2], cos_sin[:, rot_dim // 2 :]
    return _rotate(query, cos, sin, head_size, is_neox), _rotate(key, cos, sin, head_size, is_neox)


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rotary_embedding_ref` (same arguments and results): one program
    per (token, tile of heads), writing rotated and pass-through channels in one pass.

    Raises:
        ValueError: shapes, dtypes or devices disagree. Positions are not checked (that would
            need a device sync): one outside the table is undefined behaviour here.
    """
    _check(positions, query, key, head_size, cos_sin_cache)
    kernels = triton_module("rotary_triton")
    positions, cos_sin_cache = unit_stride(positions), unit_stride(cos_sin_cache)
    block_d = next_power_of_2(head_size)
    block_h = max(1, min(16, 2048 // block_d))
    outputs = []
    for x in (query, key):
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if out.numel() > 0:
            with on_device(x):
                kernels.launch_rotary_embedding(
                    positions,
                    x,
                    out,
                    head_size,
                    cos_sin_cache,
                    is_neox,
                    block_h=block_h,
                    block_d=block_d,
                )
        outputs.append(out)
    return outputs[0], outputs[1]


@dataclasses.dataclass
class RotaryPlan:
    """The rotations of one step's positions for `rotary_embedding_cpu`: ``cos``/``sin``
    float32 ``[T, 1, rot_dim/2]`` and, for GPT-J pairs, ``turn = cos + i sin`` (complex64)."""

    cos: torch.Tensor
    sin: torch.Tensor
    turn: torch.Tensor | None


def plan_rotary(positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool) -> RotaryPlan | None:
    """What `rotary_embedding_cpu` computes from ``positions`` (int64 ``[T]``) alone, once for
    every layer of a step; None for CUDA tensors (the Triton kernel reads the table itself)."""
    if use_triton(positions):
        return None
    cos_sin = cos_sin_cache.index_select(0, positions)
    if cos_sin.dtype != torch.float32:
        cos_sin = cos_sin.float()
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    return RotaryPlan(cos, sin, None if is_neox else torch.complex(cos, sin))


def rotary_embedding_cpu(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    plan: RotaryPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU form of :func:`rotary_embedding_ref` (same arguments and results; unchecked), with
    ``plan`` from `plan_rotary` for these positions when the caller has one: GPT-J pairs are
    adjacent, so each pair is one complex number and the rotation one complex multiplication
    (3 ATen ops a tensor instead of ~10); NeoX pairs take the rotate-half form."""
    p = plan or plan_rotary(positions, cos_sin_cache, is_neox)
    assert p is not None  # plan_rotary plans every CPU call
    return (_rotate_cpu(query, p.cos, p.sin, p.turn, head_size), _rotate_cpu(key, p.cos, p.sin, p.turn, head_size))


def _rotate_cpu(x, cos, sin, turn, head_size: int) -> torch.Tensor:
    """``x [T, H*D]`` rotated with ``cos``/``sin [T, 1, rot/2]`` float32 (``turn`` their
    complex ``cos + i sin`` for adjacent pairs, None for NeoX pairs); a new ``[T, H*D]``."""
    t, h, rot = x.shape[0], x.shape[1] // head_size, 2 * cos.shape[-1]
    heads = x.view(t, h, head_size)
    xr = heads if rot == head_size else heads[..., :rot]
    if xr.dtype != torch.float32:
        xr = xr.float()
    if turn is not None:
        out = torch.view_as_real(torch.view_as_complex(xr.reshape(t, h, rot // 2, 2)) * turn).view(t, h, rot)
    else:
        a, b = xr.chunk(2, dim=-1)
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if rot < head_size:
        out = torch.cat((out, heads[..., rot:]), dim=-1)
    return out.view(x.shape)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    plan: RotaryPlan | None = None,
    kernels=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on query and key: :func:`rotary_embedding_triton` on CUDA tensors; on CPU the C form
    when ``kernels`` (a `pkgd_kernels.cpu.CpuKernels`) takes the tensors, else
    :func:`rotary_embedding_cpu` with ``plan`` (see :func:`rotary_embedding_ref` for shapes and
    errors)."""
    if use_triton(query):
        return rotary_embedding_triton(positions, query, key, head_size, cos_sin_cache, is_neox)
    _check(positions, query, key, head_size, cos_sin_cache)
    if kernels is not None and kernels.takes_rotary_embedding(query, key, cos_sin_cache):
        return kernels.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    return rotary_embedding_cpu(positions, query, key, head_size, cos_sin_cache, is_neox, plan=plan)
