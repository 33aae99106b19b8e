"""The tensor table of a GGUF file, read without building its metadata values (torch-free:
numpy and the ``gguf`` package's constants).

`gguf.GGUFReader` makes a numpy view of every part of every metadata value on opening a file;
for a tokenizer's vocabulary and merges (SmolLM2: ~98k strings) that took 2.5-4 s of each
start with quantized weights kept (``model.quantization: auto``), which need only the
architecture and the tensors. `scan_gguf` steps over metadata values by their lengths and
gives the tensors as `GGUFReader` does (same names, types, dims and data views), from one
read-only memory map of the file. Conversion (`pkgd.model_files.gguf_convert`), which needs
the metadata values, keeps using `GGUFReader`.

Format (ggml's ``docs/gguf.md``, versions 2 and 3, little-endian): ``GGUF``, ``u32`` version,
``u64`` tensor count, ``u64`` key-value count; each key-value: a string key (``u64`` length +
UTF-8), a ``u32`` value type, the value (an array: ``u32`` item type, ``u64`` count, the
items); each tensor info: a string name, ``u32`` dim count, ``u64`` dims (innermost first),
``u32`` GGML type, ``u64`` offset; the data, at the next multiple of ``general.alignment``
(default 32), each tensor at its offset from there.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SIZES = {t: struct.calcsize(f) for t, f in _SCALARS.items()}
# Element types whose data GGUFReader gives as numbers; every other type as rows of bytes.
_NUMPY_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    """One tensor, as `gguf.ReaderTensor` gives it: ``shape`` the GGUF dims (innermost
    first, ``uint64``); ``data`` a read-only view of the file shaped by the dims reversed, in
    the element type for float and integer types, else ``uint8 [..., row_bytes]``."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


class GGUFIndex(NamedTuple):
    """``architecture``: ``general.architecture`` (None when absent); ``tensors`` in file order."""

    architecture: str | None
    tensors: list[GGUFTensor]


def scan_gguf(path: Path) -> GGUFIndex:
    """The architecture and tensors of the GGUF file at ``path`` (module docstring).

    Raises:
        OSError: the file cannot be opened or mapped.
        ValueError: not a little-endian GGUF of version 2 or 3, a malformed or truncated
            header, an unknown value or tensor type, a duplicate tensor name, or tensor data
            past the end of the file (the message says which).
    """
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)  # type: ignore[arg-type]  # np.memmap exports the buffer protocol
    try:
        return _scan(mm, buf)
    except (struct.error, UnicodeDecodeError, IndexError) as e:
        raise ValueError(f"malformed or truncated GGUF header ({e})") from e


def _scan(mm: np.ndarray, buf: memoryview) -> GGUFIndex:
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}: only little-endian versions 2 and 3 are read")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos, arch, alignment = 24, None, GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        vtype, pos = _value_type(buf, pos)
        if key == "general.architecture" and vtype == GGUFValueType.STRING:
            arch, pos = _string(buf, pos)
        elif key == "general.alignment" and vtype in _SCALARS:
            (alignment,) = struct.unpack_from(_SCALARS[vtype], buf, pos)
            pos += _SIZES[vtype]
        else:
            pos = _skip(buf, pos, vtype)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}, not a positive integer")
    infos = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = np.frombuffer(buf, dtype="<u8", count=n_dims, offset=pos + 4).copy()
        pos += 4 + 8 * n_dims
        raw_type, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append((name, dims, raw_type, offset))
    start = pos + (-pos % alignment)
    tensors: list[GGUFTensor] = []
    seen: set[str] = set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        tensors.append(_tensor(mm, name, dims, raw_type, start + offset))
    return GGUFIndex(arch, tensors)


def _tensor(mm: np.ndarray, name: str, dims: np.ndarray, raw_type: int, at: int) -> GGUFTensor:
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {name!r} has an unknown GGML type {raw_type}") from None
    n_elems = int(np.prod(dims, dtype=np.uint64)) if len(dims) else 1
    n_bytes = n_elems * type_size // block
    np_dims = tuple(int(d) for d in reversed(dims.tolist()))
    if at + n_bytes > len(mm):
        raise ValueError(f"tensor {name!r} lies past the end of the file")
    raw = mm[at : at + n_bytes]
    item: Any = _NUMPY_TYPES.get(ggml_type)
    if item is not None:
        data = raw.view(item).reshape(np_dims)
    else:  # quantized: rows of blocks, as gguf.quants.quant_shape_to_byte_shape
        if np_dims[-1] % block:
            raise ValueError(f"tensor {name!r}: {np_dims[-1]} values per row is not a whole number of blocks")
        data = raw.reshape((*np_dims[:-1], np_dims[-1] // block * type_size))
    return GGUFTensor(name, ggml_type, dims, data)


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise ValueError("a string runs past the end of the file")
    return str(buf[pos + 8 : end], "utf-8"), end


def _value_type(buf: memoryview, pos: int) -> tuple[GGUFValueType, int]:
    (raw,) = struct.unpack_from("<I", buf, pos)
    try:
        return GGUFValueType(raw), pos + 4
    except ValueError:
        raise ValueError(f"unknown metadata value type {raw}") from None


def _skip(buf: memoryview, pos: int, vtype: GGUFValueType) -> int:
    """The position after a value of type ``vtype`` starting at ``pos``."""
    if vtype in _SIZES:
        return pos + _SIZES[vtype]
    if vtype == GGUFValueType.STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    item, pos = _value_type(buf, pos)  # an array
    (count,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    if item in _SIZES:
        return pos + count * _SIZES[item]
    for _ in range(count):  # strings or nested arrays: each has its own length
        pos = _skip(buf, pos, item)
        if pos > len(buf):
            raise ValueError("a metadata array runs past the end of the file")
    return pos
