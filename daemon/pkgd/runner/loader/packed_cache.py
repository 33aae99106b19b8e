"""A model's packed quantized weights kept on disk, so a later start reads them instead of
repacking the GGUF's blocks (`pkgd_kernels.quant_layout.pack_gguf_rows`).

One file per GGUF file and architecture, ``<model.cache_dir>/quantized-weights/<digest>.safetensors``
(the digest of the GGUF's resolved path and the architecture: a changed GGUF overwrites its
stale file rather than leaving it beside the new one). Plain safetensors: each `QuantWeight`'s
bytes as a uint8 ``[nbytes]`` tensor named after its module (``layers.0.self_attn.qkv_proj``),
and in the ``__metadata__`` entry ``pkgd`` (JSON) the GGUF's identity (resolved path, size,
``mtime_ns``), `LAYOUT_VERSION`, the architecture, a digest of the model config (the packing
follows its Q/K row order) and each weight's ``n``, ``k`` and segments. The header is padded
with spaces (the format allows it) so the data starts on a page boundary; every tensor's size
is a multiple of 64 bytes.

`PackedWeightsCache.load` checks the identity from the header, then reads all the data with
one sequential read into one allocation (SmolLM2 Q4_1: 98 MB in ~0.05 s from the page cache,
against ~0.3-2.7 s of packing on this 2-core host, the latter under load). It reads rather
than maps: a private file mapping cannot be collapsed into 2 MiB pages
(``MADV_COLLAPSE`` answers EINVAL), so the runner's huge-page pass (decode streams every
weight per token; README: 69 vs 80 tokens/s on 4 KiB pages) would leave the weights on
whatever folios the page cache happens to hold; an anonymous copy is collapsed whole. A
file that is missing, unreadable, truncated, of another GGUF version (size or mtime
changed), layout version, architecture or config yields None with the reason; the loader
then packs from the GGUF and stores the file anew. `store` writes under a temporary name
and renames into place (one sequential write, ~0.2 s for 98 MB; a failure is a warning only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from pkgd_kernels.quant_layout import LAYOUT_VERSION, QuantSegment, QuantWeight

logger = structlog.get_logger(__name__)

DIRECTORY = "quantized-weights"
"""The cache's directory under ``model.cache_dir``."""
_ALIGN = 4096  # the data starts on a page: a reader that maps the file gets 64-byte aligned tensors
_MAX_HEADER = 64 << 20


def _identity(gguf_path: Path) -> dict[str, Any]:
    st = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class PackedWeightsCache:
    """Packed weights of GGUF models under ``directory`` (module docstring).

    Args:
        directory: ``<model.cache_dir>/quantized-weights`` (created on the first store).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, gguf_path: Path, architecture: str) -> Path:
        """The file for ``gguf_path`` as ``architecture``: one per pair, so a changed GGUF
        overwrites its stale file instead of leaving it beside the new one."""
        name = json.dumps([str(Path(gguf_path).resolve()), architecture])
        return self.directory / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.safetensors"

    @staticmethod
    def _header(gguf_path: Path, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
        digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return {
            **_identity(Path(gguf_path)),
            "layout_version": LAYOUT_VERSION,
            "architecture": architecture,
            "config": digest,
        }

    def load(
        self, gguf_path: Path, architecture: str, config: dict[str, Any]
    ) -> tuple[dict[str, QuantWeight] | None, str]:
        """The stored weights of ``gguf_path`` by module name (``data``: uint8 views of one
        allocation holding the file's data), or None and why not. ``config``: the model's config (JSON-ready; the
        packing depends on it through the Q/K row order)."""
        path = self.path(gguf_path, architecture)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return None, "no packed weights stored yet"
        except OSError as e:
            return None, f"unreadable: {e}"
        with f:
            try:
                return _read(f, self._header(gguf_path, architecture, config))
            except (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error, OSError) as e:
                return None, f"not a packed-weights file ({type(e).__name__}: {e})"

    def store(
        self, gguf_path: Path, architecture: str, config: dict[str, Any], weights: dict[str, QuantWeight]
    ) -> bool:
        """Write ``weights`` (by module name) for ``gguf_path``; whether it was written (a
        failure is logged as ``packed_weights_not_cached`` and changes nothing else)."""
        target = self.path(gguf_path, architecture)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        t0 = time.perf_counter()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            meta = {**self._header(gguf_path, architecture, config), "weights": {}}
            header: dict[str, Any] = {}
            offset = 0
            for name, w in weights.items():
                meta["weights"][name] = {"n": w.n, "k": w.k, "segments": [_segment_row(s) for s in w.segments]}
                header[name] = {"dtype": "U8", "shape": [w.nbytes], "data_offsets": [offset, offset + w.nbytes]}
                offset += w.nbytes
            header["__metadata__"] = {"pkgd": json.dumps(meta)}
            raw = json.dumps(header).encode()
            raw += b" " * (-(8 + len(raw)) % _ALIGN)
            with open(tmp, "wb") as f:
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
                for w in weights.values():
                    f.write(w.data.contiguous().numpy().data)
            os.replace(tmp, target)
        except OSError as e:
            logger.warning("packed_weights_not_cached", path=str(target), error=str(e))
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return False
        logger.info(
            "packed_weights",
            action="stored",
            path=str(target),
            bytes=offset,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return True


def _segment_row(s: QuantSegment) -> list[int]:
    return [s.qtype, s.rows, s.offset, s.nbytes]


def _read(f: Any, expected: dict[str, Any]) -> tuple[dict[str, QuantWeight] | None, str]:
    file_size = os.fstat(f.fileno()).st_size
    (size,) = struct.unpack("<Q", f.read(8))
    if not 0 < size <= min(_MAX_HEADER, file_size - 8):
        raise ValueError(f"header size {size} does not fit a {file_size}-byte file")
    header = json.loads(f.read(size))
    meta = json.loads(header.pop("__metadata__")["pkgd"])
    for field, want in expected.items():
        if meta.get(field) != want:
            return None, f"stale: {field} is {meta.get(field)!r}, now {want!r}"
    base = 8 + size
    # One allocation read in one pass (not a mapping: see the module docstring).
    buf = torch.empty(file_size - base, dtype=torch.uint8)
    view, done = buf.numpy().data, 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"file ends {len(view) - done} bytes early")
        done += n
    out = {}
    for name, info in meta["weights"].items():
        entry = header[name]
        start, end = (int(x) for x in entry["data_offsets"])
        if entry["dtype"] != "U8" or entry["shape"] != [end - start] or not 0 <= start < end <= len(buf):
            raise ValueError(f"tensor {name}: {entry} does not fit the file")
        segments = tuple(QuantSegment(*(int(x) for x in row)) for row in info["segments"])
        out[name] = QuantWeight(buf[start:end], segments, int(info["n"]), int(info["k"]))
    return out, ""
