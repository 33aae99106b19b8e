"""The C heap of a CPU engine process (glibc ``malloc``): one policy while the weights load,
another for the steps after.

glibc serves a request above ``M_MMAP_THRESHOLD`` with its own ``mmap`` and unmaps it on
``free``; below it, from a heap that only shrinks from the top (past ``M_TRIM_THRESHOLD``).
By default the threshold starts at 128 KiB and rises to the size of any mmapped block that is
freed (up to 32 MiB).

* Loading (`tune_cpu_allocator`): a fixed 1 MiB threshold, so the big
  temporaries of loading (the float copies of weights, freed after oneDNN packing) are
  unmapped when freed instead of leaving heap holes that are never returned. Measured on
  SmolLM2 (``benchmarks``, 2 threads): resident after loading 842 -> 805 MiB.
* Steps (`step_heap`, once loading is done, and again after a reload): the free memory of
  what ran before is handed back (``malloc_trim``), then every temporary under
  `STEP_MMAP_THRESHOLD_BYTES` comes from the heap and freed memory stays there for the next
  step. A batched step's temporaries (the linears' outputs, the MLP's gate, the logits: MBs
  to tens of MBs) are the same sizes step after step; mmapped, each was page-faulted in
  afresh every step, and a fresh page's first touch is the dearer the more the host
  virtualises memory. The price: the heap keeps its high-water mark of temporaries resident
  (the peak memory `pkgd bench throughput` prints).

An operator's own ``MALLOC_MMAP_THRESHOLD_`` (glibc's tunable) wins over both; on other C
libraries this does nothing.

After loading, the weights are moved onto 2 MiB huge pages (`collapse_to_huge_pages`): decode
reads them from DRAM every step. The KV cache comes from `lazy_zeroed_buffers` instead: fresh
anonymous memory that is zero without being written and becomes resident (on huge pages where
the kernel allows, past a small head of each buffer) only as blocks are first written, so a
cache sized for the worst case costs only what the workload uses.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys

import torch

MMAP_THRESHOLD_BYTES = 1 << 20
# Steps: below this from the heap (mallopt takes an int; glibc's main arena accepts it).
STEP_MMAP_THRESHOLD_BYTES = 1 << 30
STEP_TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # never shrink the heap's top between steps
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>


def _libc() -> ctypes.CDLL | None:
    """The C library if it has glibc's mallopt and malloc_trim and the operator did not set
    ``MALLOC_MMAP_THRESHOLD_``, else None."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    try:
        libc = ctypes.CDLL(None)  # the process namespace: glibc when that is the C library
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def tune_cpu_allocator(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (the loading
    policy); True if applied, False where the operator set ``MALLOC_MMAP_THRESHOLD_`` or the C
    library is not glibc."""
    libc = _libc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1


def step_heap() -> bool:
    """Switch this process to the steps' policy (module docstring): the free memory of what
    ran before handed back to the OS, then temporaries under `STEP_MMAP_THRESHOLD_BYTES` kept
    in the heap. True if applied (as `tune_cpu_allocator`)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return (
        libc.mallopt(_M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD_BYTES) == 1
        and libc.mallopt(_M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD_BYTES) == 1
    )


# ---- huge pages -----------------------------------------------------------------------------

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # <linux/mman.h>; MADV_COLLAPSE since Linux 6.1
_MERGE_GAP_BYTES = 64 << 10


def tensor_span(t: torch.Tensor) -> tuple[int, int]:
    """``(address, bytes)`` of a CPU tensor's data, an opaque oneDNN (mkldnn) tensor included."""
    if t.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
    return t.data_ptr(), t.numel() * t.element_size()


def collapse_to_huge_pages(spans: list[tuple[int, int]]) -> int:
    """Back the given memory (``(address, bytes)`` pairs, e.g. `tensor_span` of every weight)
    with 2 MiB transparent huge pages now (``madvise(MADV_HUGEPAGE)`` then ``MADV_COLLAPSE``);
    returns the bytes of it now on huge pages, those that already were included (0 where the
    kernel or C library cannot).

    Decode streams every weight from DRAM once per token. On 4 KiB pages that stream reads
    slower here: ``torch.sum`` over 128 MiB 26 vs 32 GB/s on 2 MiB pages, and single-stream
    SmolLM2 decode 69 vs 80 tokens/s (same process, alternating runs). Spans closer than
    64 KiB are merged (consecutive allocations), then cut inward to whole huge pages, so no
    memory outside them becomes resident; each page is collapsed on its own, so one that
    straddles two mappings (refused) leaves the rest. Contents are unchanged. Linux only; the
    runner skips it with ``parallel.cpu_huge_pages: false``. (In engine processes torch's
    allocator already puts allocations of 2 MiB or more on huge pages:
    ``THP_MEM_ALLOC_ENABLE``, `pkgd.host.set_torch_huge_pages`;
    tensors under 2 MiB, or not aligned to whole pages, stay on 4 KiB pages: ~70% of
    SmolLM2's weights end up on huge pages.)
    """
    if not sys.platform.startswith("linux"):
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    merged: list[list[int]] = []
    for addr, n in sorted(spans):
        if merged and addr <= merged[-1][1] + _MERGE_GAP_BYTES:
            merged[-1][1] = max(merged[-1][1], addr + n)
        else:
            merged.append([addr, addr + n])
    done = 0
    for start, end in merged:
        for page in range(-(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, end - HUGE_PAGE_BYTES + 1, HUGE_PAGE_BYTES):
            if (
                madvise(page, HUGE_PAGE_BYTES, _MADV_HUGEPAGE) == 0
                and madvise(page, HUGE_PAGE_BYTES, _MADV_COLLAPSE) == 0
            ):
                done += HUGE_PAGE_BYTES
    return done


def lazy_zeroed_buffers(
    sizes: list[int], *, align: int = HUGE_PAGE_BYTES, huge_pages: bool = True, small_head: int = 0
) -> list[torch.Tensor]:
    """Zero-filled ``uint8`` CPU tensors of the given byte sizes that take no memory until written.

    One private anonymous ``mmap`` holds them all, each starting on an ``align`` boundary (2 MiB:
    whole huge pages per tensor). Linux maps such pages to the shared zero page until the first
    write, which then faults in a page of its own, so resident memory follows the bytes written,
    not the size. The region is ``madvise(MADV_HUGEPAGE)`` when ``huge_pages`` is true: a first
    write faults in a 2 MiB page where THP allows it, as `collapse_to_huge_pages` gives the
    weights. The first ``small_head`` bytes of each buffer (rounded up to 4 KiB pages) are
    ``MADV_NOHUGEPAGE`` instead: a first write there faults in 4 KiB, not 2 MiB. The tensors keep
    the mapping alive; it is unmapped when the last one is freed. View them as the dtype and
    shape needed (``t.view(dtype).view(shape)``).

    Raises:
        OSError: the mapping cannot be created (address space or overcommit limits).
    """
    offsets, total = [], 0
    for n in sizes:
        if n < 0:
            raise ValueError(f"negative buffer size {n}")
        offsets.append(total)
        total += -(-n // align) * align
    # one spare ``align`` so the first buffer can start on a boundary wherever mmap placed it
    mm = mmap.mmap(-1, total + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out: 4 KiB pages, still lazy
            pass
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    shift = -whole.data_ptr() % align
    head = -(-small_head // mmap.PAGESIZE) * mmap.PAGESIZE
    if huge_pages and head > 0 and hasattr(mmap, "MADV_NOHUGEPAGE"):
        for n, off in zip(sizes, offsets):
            if n:
                with contextlib.suppress(OSError):
                    mm.madvise(mmap.MADV_NOHUGEPAGE, shift + off, min(head, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE))
    return [whole[shift + off : shift + off + n] for n, off in zip(sizes, offsets)]
