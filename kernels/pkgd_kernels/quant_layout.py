"""GGUF quantized blocks repacked for the quantized-weight kernels, and unpacked again.

A weight ``W [N, K]`` whose GGUF tensor is of one of `QTYPES` is kept in that type's bits:
`QuantWeight` holds it as one or more *segments* of rows (the parts of a fused projection
may differ in type), each laid out 16 output rows (a *group*) at a time, block by block along
K, so that one 64-byte line holds the same 4 inputs of 16 rows: the operand layout of AVX-512
VNNI's ``vpdpbusd`` (one 32-bit lane per output row). Per group and block (``cpu/quant.h``
has the same description; `pack_gguf_rows` writes it, `dequantize` reads it):

* ``Q4_0`` / ``Q4_1`` (32 inputs, 320 bytes): fp16 ``d[16]``, fp16 ``m[16]``, then 4 lines of
  nibbles: line s, row j, byte i = ``q[j][4s+i] | q[j][16+4s+i] << 4``; ``w = d * q + m``
  (``Q4_0``: ``m = -8 d``, exact in fp16).
* ``Q8_0`` (32 inputs, 576 bytes): fp16 ``d[16]``, int16 ``sum(q)[16]``, 8 lines of int8:
  line t, row j, byte i = ``q[j][4t+i]``; ``w = d * q``.
* ``Q4_K`` (256 inputs, 2368 bytes): fp16 ``d[16]``, fp16 ``dmin[16]``, u8 ``sc[8][16]``, u8
  ``mn[8][16]``, 8 chunks of 32 inputs in the Q4 nibble layout; ``w = d * sc * q - dmin * mn``.
* ``Q6_K`` (256 inputs, 3392 bytes): fp16 ``d[16]``, 32 unused bytes, int8 ``sc[16][16]`` (one
  per 16 inputs), 8 chunks of 32 inputs: 4 lines of the low nibbles (Q4 layout), 2 lines of
  the high bit pairs (line u, row j, byte i, bits 2p..2p+1: ``q >> 4`` of input
  ``4(4u+p)+i``); ``w = d * sc * (q - 32)``.

The values are GGUF's, bit for bit: `dequantize` of a packed weight equals
``gguf.quants.dequantize`` of its blocks (ggml's block formats, ``ggml-common.h``). Memory is
the GGUF file's to within the scales' padding (Q4_K: 4.625 bits a weight against 4.5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
"""GGML type name -> type id of the quantized types the kernels read."""
QTYPE_NAMES = {v: k for k, v in QTYPES.items()}
GROUP_ROWS = 16
MAX_SEGMENTS = 4
BLOCK = {2: 32, 3: 32, 8: 32, 12: 256, 14: 256}
"""Inputs per block of each type."""
GGUF_BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 12: 144, 14: 210}
GROUP_BLOCK_BYTES = {2: 320, 3: 320, 8: 576, 12: 2368, 14: 3392}
LAYOUT_VERSION = 1
"""Bump whenever `pack_gguf_rows` writes other bytes for the same blocks: packed weights
stored on disk (the runner's packed-weights cache) record it and are ignored when it differs."""


@dataclasses.dataclass(frozen=True)
class QuantSegment:
    """Rows of one type: ``qtype`` (GGML id), ``rows`` (a multiple of 16, padding included),
    ``offset``/``nbytes`` of its bytes in `QuantWeight.data`."""

    qtype: int
    rows: int
    offset: int
    nbytes: int


@dataclasses.dataclass(eq=False)
class QuantWeight:
    """A quantized ``W [n, k]``: ``data`` (uint8, contiguous) holds the `segments` back to back.
    Rows past ``n`` (padding of the last segment to 16) are zero and never returned.
    ``cache`` is the C binding's (its descriptor of this weight)."""

    data: torch.Tensor
    segments: tuple[QuantSegment, ...]
    n: int
    k: int
    cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def rows(self) -> int:
        """Rows held, padding included."""
        return sum(s.rows for s in self.segments)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def qtype_names(self) -> list[str]:
        return [QTYPE_NAMES[s.qtype] for s in self.segments]


def supports(qtype: int, k: int) -> bool:
    """Whether the kernels read GGML type ``qtype`` for rows of ``k`` inputs."""
    return qtype in BLOCK and k % BLOCK[qtype] == 0


def packed_segments(parts: Sequence[tuple[int, int]], k: int) -> tuple[QuantSegment, ...]:
    """The segments `pack_gguf_rows` makes of parts ``(qtype, rows)`` of ``k`` inputs per row
    (adjacent parts of one type merged, each segment padded to 16 rows), without packing: what
    a stored `QuantWeight` of those parts must hold."""
    merged: list[list[int]] = []
    for qtype, rows in parts:
        if merged and merged[-1][0] == qtype:
            merged[-1][1] += rows
        else:
            merged.append([qtype, rows])
    out, offset = [], 0
    for qtype, rows in merged:
        rows += -rows % GROUP_ROWS
        nbytes = rows // GROUP_ROWS * (k // BLOCK[qtype]) * GROUP_BLOCK_BYTES[qtype]
        out.append(QuantSegment(qtype, rows, offset, nbytes))
        offset += nbytes
    return tuple(out)


def pack_gguf_rows(parts: Sequence[tuple[int, torch.Tensor]], k: int) -> QuantWeight:
    """Repack GGUF block rows into a `QuantWeight` (parts stacked along the output rows).

    Args:
        parts: ``(qtype, raw)`` pairs, ``raw`` uint8 ``[rows, k / block * block_bytes]`` (a GGUF
            tensor's data, one row per output feature). Adjacent parts of one type are merged;
            every part but the last must have a multiple of 16 rows.
        k: inputs per row.

    Raises:
        ValueError: an unsupported type, a row size that does not fit ``k``, more than
            `MAX_SEGMENTS` segments, misaligned parts, or a scale fp16 cannot hold (Q4_0's -8 d).
    """
    merged: list[tuple[int, list[torch.Tensor]]] = []
    for i, (qtype, raw) in enumerate(parts):
        if not supports(qtype, k):
            raise ValueError(f"GGML type {qtype} with {k} inputs per row is not one the quantized kernels read")
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != k // BLOCK[qtype] * GGUF_BLOCK_BYTES[qtype]:
            raise ValueError(
                f"part {i}: expected uint8 [rows, {k // BLOCK[qtype] * GGUF_BLOCK_BYTES[qtype]}], got "
                f"{raw.dtype} {tuple(raw.shape)}"
            )
        if i < len(parts) - 1 and raw.shape[0] % GROUP_ROWS:
            raise ValueError(f"part {i}: {raw.shape[0]} rows is not a multiple of {GROUP_ROWS}")
        if merged and merged[-1][0] == qtype:
            merged[-1][1].append(raw)
        else:
            merged.append((qtype, [raw]))
    if not merged or len(merged) > MAX_SEGMENTS:
        raise ValueError(f"a quantized weight has 1 to {MAX_SEGMENTS} segments of one type, not {len(merged)}")
    n = sum(raw.shape[0] for _, raw in parts)
    chunks, segments, offset = [], [], 0
    for qtype, raws in merged:
        raw = torch.cat(raws) if len(raws) > 1 else raws[0]
        pad = -raw.shape[0] % GROUP_ROWS
        if pad:
            raw = torch.cat((raw, torch.zeros(pad, raw.shape[1], dtype=torch.uint8)))
        blocks = raw.contiguous().view(raw.shape[0], k // BLOCK[qtype], GGUF_BLOCK_BYTES[qtype])
        packed = _PACK[qtype](blocks).reshape(-1)
        segments.append(QuantSegment(qtype, raw.shape[0], offset, packed.numel()))
        chunks.append(packed)
        offset += packed.numel()
    data = torch.cat(chunks) if len(chunks) > 1 else chunks[0].contiguous()
    return QuantWeight(data, tuple(segments), n, k)


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The float32 ``[n, k]`` matrix a `QuantWeight` holds (what ``gguf.quants.dequantize``
    gives for its blocks)."""
    out = [_DEQUANT[s.qtype](weight.data[s.offset : s.offset + s.nbytes], s.rows, weight.k) for s in weight.segments]
    return (torch.cat(out) if len(out) > 1 else out[0])[: weight.n]


# ---- the line layouts ------------------------------------------------------------------------


def _h16_bytes(v: torch.Tensor) -> torch.Tensor:
    """``[N, C, 2]`` uint8 (a 16-bit value per row and block) -> ``[G, C, 32]``, rows innermost."""
    n, c, _ = v.shape
    return v.reshape(n // GROUP_ROWS, GROUP_ROWS, c, 2).permute(0, 2, 1, 3).reshape(n // GROUP_ROWS, c, 32)


def _u8_rows(v: torch.Tensor) -> torch.Tensor:
    """``[N, C, S]`` uint8 (S values per row and block) -> ``[G, C, S * 16]``: value s of the 16 rows."""
    n, c, s = v.shape
    return v.reshape(n // GROUP_ROWS, GROUP_ROWS, c, s).permute(0, 2, 3, 1).reshape(n // GROUP_ROWS, c, s * GROUP_ROWS)


def _q4_lines(q: torch.Tensor) -> torch.Tensor:
    """Nibbles ``q [N, C, 32]`` (0..15) -> ``[G, C, 256]``: line s, row j, byte i holds inputs
    4s+i (low) and 16+4s+i (high)."""
    n, c, _ = q.shape
    g = q.reshape(n // GROUP_ROWS, GROUP_ROWS, c, 2, 4, 4)
    return (g[:, :, :, 0] | (g[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(n // GROUP_ROWS, c, 256)


def _q4_unlines(lines: torch.Tensor) -> torch.Tensor:
    g, c, _ = lines.shape
    v = lines.reshape(g, c, 4, GROUP_ROWS, 4)
    q = torch.stack((v & 15, v >> 4), dim=-1)  # (G, C, s, j, i, half)
    return q.permute(0, 3, 1, 5, 2, 4).reshape(g * GROUP_ROWS, c, 32)


def _q8_lines(q: torch.Tensor) -> torch.Tensor:
    n, c, _ = q.shape
    return q.reshape(n // GROUP_ROWS, GROUP_ROWS, c, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // GROUP_ROWS, c, 512)


def _q8_unlines(lines: torch.Tensor) -> torch.Tensor:
    g, c, _ = lines.shape
    return lines.reshape(g, c, 8, GROUP_ROWS, 4).permute(0, 3, 1, 2, 4).reshape(g * GROUP_ROWS, c, 32)


def _q6_hi_lines(hi: torch.Tensor) -> torch.Tensor:
    """High bit pairs ``hi [N, C, 32]`` (0..3) -> ``[G, C, 128]``: line u, row j, byte i, bits
    2p..2p+1 = input 4(4u+p)+i."""
    n, c, _ = hi.shape
    g = hi.reshape(n // GROUP_ROWS, GROUP_ROWS, c, 2, 4, 4)  # (G, j, C, u, p, i)
    b = g[:, :, :, :, 0] | (g[:, :, :, :, 1] << 2) | (g[:, :, :, :, 2] << 4) | (g[:, :, :, :, 3] << 6)
    return b.permute(0, 2, 3, 1, 4).reshape(n // GROUP_ROWS, c, 128)


def _q6_hi_unlines(lines: torch.Tensor) -> torch.Tensor:
    g, c, _ = lines.shape
    v = lines.reshape(g, c, 2, GROUP_ROWS, 4)  # (G, C, u, j, i)
    p = torch.stack([(v >> (2 * s)) & 3 for s in range(4)], dim=3)  # (G, C, u, p, j, i)
    return p.permute(0, 4, 1, 2, 3, 5).reshape(g * GROUP_ROWS, c, 32)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` uint8 -> float32 ``[...]`` (the bytes as an IEEE half)."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """16-bit ``[...]`` -> uint8 ``[..., 2]``."""
    return t.contiguous().view(torch.uint8).reshape(*t.shape, 2)


# ---- per type ------------------------------------------------------------------------------------


def _pack_q4_legacy(blocks: torch.Tensor, has_min: bool) -> torch.Tensor:
    d = blocks[..., 0:2]
    qs = blocks[..., 4:20] if has_min else blocks[..., 2:18]
    if has_min:
        m = blocks[..., 2:4]
    else:
        m16 = (_f16(d) * -8.0).half()
        if not torch.isfinite(m16).all():
            raise ValueError("Q4_0 scale too large for the packed layout (-8 d overflows fp16)")
        m = _as_bytes(m16)
    q = torch.cat((qs & 15, qs >> 4), dim=-1)
    return torch.cat((_h16_bytes(d), _h16_bytes(m), _q4_lines(q)), dim=-1)


def _unpack_q4_legacy(data: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    g, nb = rows // GROUP_ROWS, k // 32
    v = data.view(g, nb, 320)
    d, m = (_f16(v[..., o : o + 32].reshape(g, nb, 16, 2)).permute(0, 2, 1).reshape(rows, nb, 1) for o in (0, 32))
    q = _q4_unlines(v[..., 64:]).float()
    return (d * q + m).reshape(rows, k)


def _pack_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[..., 2:34].contiguous().view(torch.int8)
    wsum = _as_bytes(q.to(torch.int16).sum(-1, dtype=torch.int16))
    return torch.cat((_h16_bytes(blocks[..., 0:2]), _h16_bytes(wsum), _q8_lines(q.view(torch.uint8))), dim=-1)


def _unpack_q8_0(data: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    g, nb = rows // GROUP_ROWS, k // 32
    v = data.view(g, nb, 576)
    d = _f16(v[..., 0:32].reshape(g, nb, 16, 2)).permute(0, 2, 1).reshape(rows, nb, 1)
    q = _q8_unlines(v[..., 64:].contiguous()).view(torch.int8).float()
    return (q * d).reshape(rows, k)


def _q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes -> 6-bit ``(sc [..., 8], mn [..., 8])`` (ggml's get_scale_min_k4)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((a & 63, (c & 15) | ((a >> 2) & 48)), dim=-1)
    mn = torch.cat((b & 63, (c >> 4) | ((b >> 2) & 48)), dim=-1)
    return sc, mn


def _pack_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n, nb, _ = blocks.shape
    sc, mn = _q4k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:144].reshape(n, nb, 4, 1, 32)
    q = torch.cat((qs & 15, qs >> 4), dim=3).reshape(n, nb * 8, 32)  # sub-block 2c: low nibbles, 2c+1: high
    lines = _q4_lines(q).reshape(n // GROUP_ROWS, nb, 2048)
    return torch.cat(
        (_h16_bytes(blocks[..., 0:2]), _h16_bytes(blocks[..., 2:4]), _u8_rows(sc), _u8_rows(mn), lines), dim=-1
    )


def _unpack_q4_k(data: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    g, nb = rows // GROUP_ROWS, k // 256
    v = data.view(g, nb, 2368)
    d, dmin = (_f16(v[..., o : o + 32].reshape(g, nb, 16, 2)).permute(0, 2, 1).reshape(rows, nb, 1, 1) for o in (0, 32))
    sc, mn = (
        v[..., o : o + 128].reshape(g, nb, 8, 16).permute(0, 3, 1, 2).reshape(rows, nb, 8, 1).float() for o in (64, 192)
    )
    q = _q4_unlines(v[..., 320:].reshape(g, nb * 8, 256)).reshape(rows, nb, 8, 32).float()
    return ((d * sc) * q - dmin * mn).reshape(rows, k)


def _pack_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n, nb, _ = blocks.shape
    ql = blocks[..., 0:128].reshape(n, nb, 2, 1, 64)
    low = torch.cat((ql & 15, ql >> 4), dim=3).reshape(n, nb, 256)  # input h*128 + nib*64 + i
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)
    high = torch.cat([(qh >> (2 * s)) & 3 for s in range(4)], dim=3).reshape(n, nb, 256)  # h*128 + s*32 + i
    q = (low | (high << 4)).reshape(n, nb * 8, 32)
    chunks = torch.cat((_q4_lines(q & 15), _q6_hi_lines(q >> 4)), dim=-1).reshape(n // GROUP_ROWS, nb, 3072)
    head = torch.cat(
        (_h16_bytes(blocks[..., 208:210]), torch.zeros(n // GROUP_ROWS, nb, 32, dtype=torch.uint8)), dim=-1
    )
    return torch.cat((head, _u8_rows(blocks[..., 192:208]), chunks), dim=-1)


def _unpack_q6_k(data: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    g, nb = rows // GROUP_ROWS, k // 256
    v = data.view(g, nb, 3392)
    d = _f16(v[..., 0:32].reshape(g, nb, 16, 2)).permute(0, 2, 1).reshape(rows, nb, 1, 1)
    sc = (
        v[..., 64:320]
        .contiguous()
        .view(torch.int8)
        .reshape(g, nb, 16, 16)
        .permute(0, 3, 1, 2)
        .reshape(rows, nb, 16, 1)
        .float()
    )
    ch = v[..., 320:].reshape(g, nb * 8, 384)
    q = _q4_unlines(ch[..., :256]) | (_q6_hi_unlines(ch[..., 256:]) << 4)
    q = q.reshape(rows, nb, 16, 16).to(torch.int8).float() - 32.0
    return ((d * sc) * q).reshape(rows, k)


_PACK = {
    2: lambda b: _pack_q4_legacy(b, has_min=False),
    3: lambda b: _pack_q4_legacy(b, has_min=True),
    8: _pack_q8_0,
    12: _pack_q4_k,
    14: _pack_q6_k,
}
_DEQUANT = {2: _unpack_q4_legacy, 3: _unpack_q4_legacy, 8: _unpack_q8_0, 12: _unpack_q4_k, 14: _unpack_q6_k}
