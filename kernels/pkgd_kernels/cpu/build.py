"""Build, cache and load a C library of CPU kernels, and check it against its ctypes bindings.

A library is described by a `LibrarySpec`: a name, one C source (which may include
``kernels.h`` from this directory, on the include path), the ABI version its bindings expect and
the ctypes structs they pass. Build: ``$CC`` (default ``gcc``; may carry arguments, e.g. ``ccache
gcc``) with ``-O3 -march=native -fopenmp`` into ``<cache_dir>/<name>-<hash>.so``; the hash
covers the source, the headers beside ``kernels.h`` (any may be included), the flags and this
CPU's feature flags, so a cache moved to another host is rebuilt rather than crashing,
and a cache filled in advance needs no compiler.
Beside the library, ``<name>-<hash>.so.sha256`` holds its digest, checked before loading (a
truncated library can crash the loader with SIGBUS). The file is written under a temporary name
and renamed, so concurrent first starts (several engine cores) never load a half-written
library; builds of earlier sources of the same name are removed.

Every library exports ``int pkgd_abi_version(void)`` and ``int64_t pkgd_struct_layout(const
char* name, int64_t* out, int64_t cap)`` (``[sizeof, offsetof each field]`` of a struct it
takes). `open_library` compares both with the spec: a cached library that fails its digest,
does not load or disagrees is built again once; one that still disagrees after a fresh build
(the C source and the Python bindings were edited apart) raises `CpuKernelsUnavailable`
naming the struct and both layouts, so the caller falls back instead of passing a struct the
library reads wrongly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

HEADER = Path(__file__).with_name("kernels.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120
_LAYOUT_CAP = 64


class CpuKernelsUnavailable(RuntimeError):
    """The C kernels cannot be used here; the message says why (no compiler, build error,
    not an x86-64/aarch64 CPU, a library that disagrees
    with its bindings)."""


@dataclasses.dataclass(frozen=True)
class LibrarySpec:
    """One C library: ``name`` (file name prefix), its ``source``, the ``abi_version`` its
    ``pkgd_abi_version()`` must return, and the ctypes ``structs`` whose layouts its
    ``pkgd_struct_layout`` must report (each class names its C struct in ``_c_name_``)."""

    name: str
    source: Path
    abi_version: int
    structs: tuple[type[ctypes.Structure], ...] = ()


def check_enabled() -> None:
    """Raise `CpuKernelsUnavailable` when this CPU architecture has no C kernels."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        raise CpuKernelsUnavailable(f"no C kernels for {platform.machine()}")


def default_cache_dir() -> Path:
    """``$CACHE_DIRECTORY`` (systemd, first entry) ``/kernels``, else ``~/.cache/pkgd/kernels``."""
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0]) / "kernels"
    return Path.home() / ".cache" / "pkgd" / "kernels"


def struct_layout(struct: type[ctypes.Structure]) -> list[int]:
    """``[sizeof, offset of each field]`` of a ctypes struct, as ``pkgd_struct_layout`` reports."""
    return [ctypes.sizeof(struct)] + [getattr(struct, name).offset for name, *_ in struct._fields_]


@functools.cache
def open_library(spec: LibrarySpec, cache_dir: Path) -> tuple[ctypes.CDLL, Path]:
    """Build (once per host and source) and load ``spec``'s library from ``cache_dir``,
    checked against the spec; the same arguments return the same library.

    Returns:
        ``(library, path)``.

    Raises:
        CpuKernelsUnavailable: no compiler and nothing cached, the build failed, or the
            library disagrees with ``spec`` even when freshly built (the message says which).
    """
    path = build(spec, cache_dir)
    try:
        lib = _open(spec, path)
    except CpuKernelsUnavailable:
        path.unlink(missing_ok=True)  # damaged or stale: build it again, once
        _digest_path(path).unlink(missing_ok=True)
        path = build(spec, cache_dir)
        lib = _open(spec, path)
    return lib, path


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _open(spec: LibrarySpec, path: Path) -> ctypes.CDLL:
    # dlopen of a cut-short library (an interrupted copy of a prefilled cache, a full disk)
    # can kill the process with SIGBUS instead of failing: check it against the digest
    # written beside it at build time first.
    try:
        intact = _digest_path(path).read_text().strip() == _digest(path)
    except OSError:
        intact = False
    if not intact:
        raise CpuKernelsUnavailable(f"{path} does not match {_digest_path(path).name} (damaged or incomplete)")
    try:
        lib = ctypes.CDLL(str(path))
        lib.pkgd_struct_layout.restype = ctypes.c_int64
        lib.pkgd_struct_layout.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
        version = lib.pkgd_abi_version()
    except (OSError, AttributeError) as e:
        raise CpuKernelsUnavailable(f"cannot load {path}: {e}") from e
    if version != spec.abi_version:
        raise CpuKernelsUnavailable(f"{path} has ABI {version}, its bindings expect {spec.abi_version}")
    for struct in spec.structs:
        out = (ctypes.c_int64 * _LAYOUT_CAP)()
        # a plain str class attribute; ctypes' stubs type every Structure attribute as a field
        c_name = str(struct._c_name_)
        n = lib.pkgd_struct_layout(c_name.encode(), out, _LAYOUT_CAP)
        got, want = list(out[: max(n, 0)]), struct_layout(struct)
        if got != want:
            raise CpuKernelsUnavailable(
                f"{path.name}: struct {struct._c_name_} is [size, offsets...] {got or 'unknown'} in C "
                f"but {want} in its ctypes binding {struct.__module__}.{struct.__qualname__}"
            )
    return lib


def library_path(spec: LibrarySpec, cache_dir: Path) -> Path:
    """Where the library for this source, these flags and this CPU lives in ``cache_dir``
    (the compiler is not part of the key, so a cache filled in advance serves a host without
    one)."""
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(HEADER.parent.glob("*.h"))]  # any of them may be included
    for part in (spec.source.read_bytes(), *headers, " ".join(CFLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
    return cache_dir / f"{spec.name}-{key.hexdigest()[:16]}.so"


def build(spec: LibrarySpec, cache_dir: Path) -> Path:
    """The path of ``spec``'s library in ``cache_dir``, compiled first when it is not there.

    Raises:
        CpuKernelsUnavailable: no compiler, an unwritable directory or a failed build.
    """
    path = library_path(spec, cache_dir)
    if path.exists():
        return path
    cc = shlex.split(os.environ.get("CC") or "gcc")  # e.g. CC="ccache gcc"
    if not cc or shutil.which(cc[0]) is None:
        raise CpuKernelsUnavailable(f"no C compiler ({os.environ.get('CC') or 'gcc'!r} not on PATH)")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".build-", suffix=".so")
        os.close(fd)
    except OSError as e:
        raise CpuKernelsUnavailable(f"cannot write to {cache_dir}: {e}") from e
    try:
        cmd = [*cc, *CFLAGS, f"-I{HEADER.parent}", str(spec.source), "-o", tmp, "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if r.returncode:
            raise CpuKernelsUnavailable(f"{' '.join(cc)} failed on {spec.source.name}: {r.stderr.strip()[-500:]}")
        digest_tmp = Path(tmp + ".sha256")
        digest_tmp.write_text(_digest(Path(tmp)) + "\n")
        os.replace(digest_tmp, _digest_path(path))  # the digest first: a library is never without it
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuKernelsUnavailable(f"building {spec.source.name} failed: {e}") from e
    finally:
        for leftover in (tmp, tmp + ".sha256"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    keep = {path.name, _digest_path(path).name}
    for old in cache_dir.glob(f"{spec.name}-*"):  # builds of earlier sources (a loaded one stays mapped)
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return path


@functools.cache
def _cpu_flags() -> str:
    """This CPU's feature flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
