"""Machine ceilings measured in the same run as a benchmark: GEMM FLOP/s, memory read
bandwidth, peak RSS. Ratios against these are what stays meaningful on a shared, noisy CPU.
"""

from __future__ import annotations

import resource
import time

import torch

from pkgd.runner.allocator import collapse_to_huge_pages, tensor_span


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gemm_flops(n: int = 2048, *, dtype: torch.dtype = torch.float32, repeats: int = 5, device: str = "cpu") -> float:
    """Best FLOP/s of ``torch.mm`` on two ``n × n`` matrices (2·n³ FLOPs per product), on the
    current torch thread count."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)  # warm-up: MKL/oneDNN set-up, page faults
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def read_bandwidth(nbytes: int = 256 * 1024 * 1024, *, repeats: int = 5, device: str = "cpu") -> float:
    """Best bytes/s reading an fp32 buffer of ``nbytes`` once (``torch.sum``), the access pattern
    of decode: every weight streamed from memory once per step (`BandwidthProbe.best`)."""
    return BandwidthProbe(nbytes, device=device).best(repeats)


class BandwidthProbe:
    """Read-bandwidth samples of one buffer, e.g. taken between the steps of a run so that each
    step is compared with the bandwidth of its own moment: on a shared host another tenant's
    traffic comes and goes within seconds, and a bound read once before a run (or the best of
    a few reads) catches a quiet burst that the run itself may not see.

    ``read()`` sums an fp32 buffer of ``nbytes`` (default 128 MiB, 4x this machine's 32 MiB L3,
    ~3 ms at 40 GB/s) once and returns bytes/s; the buffer is allocated and touched at
    construction, so the first sample pays no page faults, and on CPU it is on 2 MiB pages
    like the engine's weights (`pkgd.runner.allocator.collapse_to_huge_pages`): on 4 KiB pages
    the same sum reads ~25% slower here, which would flatter the ratio."""

    def __init__(self, nbytes: int = 128 * 1024 * 1024, *, device: str = "cpu") -> None:
        self.nbytes, self.device = nbytes, device
        self._buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        if device == "cpu":
            collapse_to_huge_pages([tensor_span(self._buf)])
        self._buf.sum()

    def read(self) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        self._buf.sum()
        _sync(self.device)
        return self.nbytes / (time.perf_counter() - t0)

    def best(self, repeats: int = 5) -> float:
        """The fastest of ``repeats`` reads, bytes/s."""
        return max(self.read() for _ in range(repeats))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
