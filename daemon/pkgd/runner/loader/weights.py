"""Build a model and load its safetensors weights (HF names, full tensors; each layer keeps
its tensor-parallel shard, see `pkgd.runner.layers.linear`)."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pkgd.model_files.errors import ModelSourceError
from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.models import get_model_class
from pkgd.runner.models.config import ArchConfig

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of every ``*.safetensors`` file in ``model_dir``.

    Each tensor is a view of a private memory map of its file, which the caller copies into
    the model's own storage and must not write to. When the caller asks for the next one, the
    tensor's pages are dropped from this process (``MADV_DONTNEED``; the page cache keeps them
    and a later read of the view faults them back in). So the whole file never counts in the
    loading process's peak RSS (for SmolLM2 540 MB), as it would with the safetensors
    library's map held open, and its bytes are not copied twice (into a fresh tensor, then into
    the model) as with ``readinto``. A tensor whose offset is not a multiple of its element
    size is read with ``readinto`` into a fresh tensor instead. Format
    (huggingface/safetensors): 8-byte little-endian header length, a JSON header mapping names
    to ``dtype``, ``shape`` and ``data_offsets`` relative to the end of the header, the data.

    Raises:
        ModelSourceError: no file, or one that is not valid safetensors (names the path).
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"no *.safetensors file in {model_dir}")
    for path in files:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header, base = _read_header(f, size, path)
                # ACCESS_COPY: a writable private map, so torch's views of it are not flagged
                # read-only; nothing writes to it.
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                for name, info in header.items():
                    if name == "__metadata__":
                        continue
                    t, span = _read_tensor(f, mm, name, info, base, size, path)
                    yield name, t
                    del t
                    if span is not None:
                        _drop_pages(mm, *span)
        except OSError as e:
            raise ModelSourceError(f"{path}: cannot read ({e})") from e


def _drop_pages(mm: mmap.mmap, start: int, end: int) -> None:
    """Drop this process's pages of the map's bytes ``[start, end)`` (rounded out to pages);
    a later read of them faults them back in from the file."""
    lo = start - start % mmap.PAGESIZE
    if end > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, end - lo)


def count_tensors(model_dir: Path) -> int:
    """How many tensors `iter_safetensors` yields for ``model_dir`` (headers only).

    Raises:
        ModelSourceError: as `iter_safetensors`.
    """
    n = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                header, _ = _read_header(f, os.fstat(f.fileno()).st_size, path)
        except OSError as e:
            raise ModelSourceError(f"{path}: cannot read ({e})") from e
        n += sum(1 for name in header if name != "__metadata__")
    return n


def _counted(tensors: Iterator[tuple[str, torch.Tensor]], progress: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for item in tensors:
        yield item
        progress.advance()


def _read_header(f, size: int, path: Path) -> tuple[dict, int]:
    raw = f.read(8)
    n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
    if n < 2 or 8 + n > size:
        raise ModelSourceError(f"{path}: not a valid safetensors file (bad header length)")
    try:
        header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelSourceError(f"{path}: not a valid safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise ModelSourceError(f"{path}: not a valid safetensors file (header is not an object)")
    return header, 8 + n


def _read_tensor(
    f, mm: mmap.mmap, name: str, info: dict, base: int, size: int, path: Path
) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """The tensor ``name`` and the byte span of the map it views (None: read into a fresh
    tensor, see `iter_safetensors`)."""
    try:
        dtype = _ST_DTYPES[info["dtype"]]
        shape = [int(d) for d in info["shape"]]
        start, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelSourceError(f"{path}: tensor {name!r} has a malformed header entry ({e!r})") from e
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if end - start != nbytes or start < 0 or base + end > size:
        raise ModelSourceError(
            f"{path}: tensor {name!r} data does not match its shape or lies past the end of the file"
        )
    offset = base + start
    if nbytes and offset % dtype.itemsize == 0:
        mm.madvise(mmap.MADV_WILLNEED, offset - offset % mmap.PAGESIZE, nbytes + offset % mmap.PAGESIZE)
        return torch.frombuffer(mm, dtype=dtype, count=numel, offset=offset).view(shape), (offset, offset + nbytes)
    t = torch.empty(shape, dtype=dtype)
    f.seek(offset)
    if nbytes and f.readinto(t.view(-1).view(torch.uint8).numpy().data) != nbytes:
        raise ModelSourceError(f"{path}: tensor {name!r} is truncated")
    return t, None


def pooling_names(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of an embedding checkpoint under the ``*ForCausalLM`` names: one saved from the
    base model (sentence-transformers' Qwen3-Embedding: ``layers.0...``, ``embed_tokens``,
    ``norm``) gets the ``model.`` prefix; a causal-LM checkpoint, and a sequence classifier's
    ``score`` head, pass unchanged."""
    for name, tensor in weights:
        if not name.startswith(("model.", "lm_head.", "score.")):
            name = "model." + name
        yield name, tensor


def load_model(
    cfg: ArchConfig,
    model_dir: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE,
    progress: Any = None,
    kernels=None,
    pooling: bool = False,
) -> nn.Module:
    """Build ``cfg.architecture`` on ``device`` in ``dtype`` and load its weights.
    ``kernels``: the `pkgd_kernels.cpu.CpuKernels` the model's ops may use (CPU), or None.

    ``progress`` (a `pkgd.phases.Phase`) is told one step per tensor read, then one for the
    post-loading processing (repacking for the CPU kernels). ``pooling``
    (``model.runner: pooling``): the LM head is never used, so a checkpoint without one
    loads, and base-model tensor names are accepted (`pooling_names`).

    Raises:
        UnsupportedArchitectureError: the architecture is not registered.
        ModelSourceError: the weight files are missing or unreadable.
        ValueError: the weights do not fit the architecture (names, shapes, missing tensors).
    """
    cls = get_model_class(cfg.architecture)
    with torch.device(device):
        model = cls(cfg, tp=tp, dtype=dtype, kernels=kernels)
    model.requires_lm_head = not pooling
    tensors = iter_safetensors(model_dir)
    if progress is not None:
        progress.set_total(count_tensors(model_dir) + 1)
        tensors = _counted(tensors, progress)
    with torch.no_grad():
        model.load_weights(pooling_names(tensors) if pooling else tensors)
        # Submodules before the modules holding them (e.g. linear weights repacked for oneDNN
        # on CPU, then the model's one-call decode step over those packed weights).
        for module in reversed(list(model.modules())):
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
    if progress is not None:
        progress.advance()
    return model.eval()
