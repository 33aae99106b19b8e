"""`pkgd.runner.allocator`: the engine fixes glibc's mmap threshold unless the operator did."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pkgd.runner.allocator import step_heap, tensor_span, tune_cpu_allocator

# A child process: mallopt changes the whole process, and the test must not change pytest's.
PROBE = """
import ctypes, sys
from pkgd.runner.allocator import tensor_span, tune_cpu_allocator
applied = tune_cpu_allocator() if sys.argv[1] == "tune" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))  # by default this raises glibc's threshold to 4 MiB
p = libc.malloc(3 << 19)  # 1.5 MiB: mmapped only while the threshold stays at 1 MiB
mmapped = bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)  # IS_MMAPPED
print(applied, mmapped)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_threshold_stays_fixed_so_freed_blocks_go_back():
    def probe(mode):
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        return subprocess.run(
            [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env
        ).stdout.split()

    assert probe("default") == ["None", "False"]  # glibc's dynamic threshold: heap
    assert probe("tune") == ["True", "True"]


STEP_PROBE = """
import ctypes, sys
from pkgd.runner.allocator import step_heap, tune_cpu_allocator
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def mmapped(p):  # glibc's own mmap (IS_MMAPPED) or the heap
    return bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
tune_cpu_allocator()
p = libc.malloc(3 << 19)
out = [mmapped(p)]  # loading: 1.5 MiB mmapped
libc.free(p)
out.append(step_heap())
blocks = [libc.malloc(40 << 20) for _ in range(5)]  # steps: a batch's logits, from the heap
out.append(any(mmapped(b) for b in blocks))
for b in blocks:
    ctypes.memset(b, 1, 40 << 20)
before = resident_mib()
for b in blocks:
    libc.free(b)
kept = resident_mib()  # freed, kept for the next step
step_heap()  # as after a reload: the free memory handed back
print(*out, before - kept < 20, kept - resident_mib() > 150)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_steps_keep_their_temporaries_in_the_heap_until_handed_back():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", STEP_PROBE], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["True", "True", "False", "True", "True"]


def test_operator_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(4 << 20))
    assert tune_cpu_allocator() is False
    assert step_heap() is False
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == str(4 << 20)


def _huge_kib(addr: int, nbytes: int) -> int:
    """KiB of transparent huge pages in the mappings overlapping [addr, addr + nbytes)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps", encoding="ascii", errors="replace"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < addr + nbytes and addr < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise only")
def test_collapse_moves_a_tensor_onto_huge_pages_and_keeps_its_contents():
    import torch

    from pkgd.runner.allocator import HUGE_PAGE_BYTES, collapse_to_huge_pages, tensor_span

    t = torch.arange(3 * HUGE_PAGE_BYTES // 4 + 1000, dtype=torch.float32)  # spans >= 2 whole huge pages
    want = t.clone()
    done = collapse_to_huge_pages([tensor_span(t)])
    if done == 0:
        pytest.skip("this kernel does not collapse (MADV_COLLAPSE needs Linux 6.1 and THP not 'never')")
    assert done >= 2 * HUGE_PAGE_BYTES and done % HUGE_PAGE_BYTES == 0
    assert done <= tensor_span(t)[1]  # only whole pages inside the tensor
    assert _huge_kib(*tensor_span(t)) * 1024 >= done
    assert torch.equal(t, want)


def test_tensor_span_of_a_packed_onednn_weight():
    import torch

    from pkgd.runner.allocator import tensor_span
    from pkgd.runner.layers.linear import pack_for_onednn

    w = torch.randn(128, 64)
    packed = pack_for_onednn(w)
    if packed is None:
        pytest.skip("no oneDNN packed linear in this torch build")
    addr, n = tensor_span(packed)
    assert addr == torch.ops.mkldnn.data_ptr(packed) and n == 128 * 64 * 4
    assert tensor_span(w) == (w.data_ptr(), 128 * 64 * 4)


def _smaps_kib(addr: int, nbytes: int, field: str) -> int:
    """KiB of ``field`` (Rss:, AnonHugePages:) in the mappings overlapping [addr, addr + nbytes)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps", encoding="ascii", errors="replace"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < addr + nbytes and addr < hi
        elif inside and head == field:
            total += int(line.split()[1])
    return total


def test_the_runner_puts_weights_on_huge_pages_and_the_kv_cache_in_lazy_zero_memory(tiny_dirs):
    from structlog.testing import capture_logs
    from tests.runner.factory import make_runner

    model_dir, _ = tiny_dirs("llama")
    with capture_logs() as logs:
        runner = make_runner(model_dir)
        runner.initialize_kv_cache(4096, 16)  # several MiB per layer
    events = {e["memory"]: e for e in logs if e["event"] == "huge_pages"}
    assert set(events) == {"weights"}  # the KV cache is not collapsed: that would make it resident
    weights = events["weights"]
    assert weights["of_bytes"] == sum(tensor_span(p)[1] for p in runner.model.parameters())
    assert 0 <= weights["bytes"] <= weights["of_bytes"] + 2 * (2 << 20)
    k0, v0 = runner.kv_caches[0]
    assert k0.shape == (4096, 16, *k0.shape[2:]) and k0.dtype == runner.kv_dtype
    assert all(bool((c == 0).all()) for pair in runner.kv_caches for c in pair)  # zero, as torch.zeros gave
    if not sys.platform.startswith("linux"):
        return
    span = sum(c.numel() * c.element_size() for pair in runner.kv_caches for c in pair)
    first = runner.kv_caches[0][0].data_ptr()
    assert all(c.data_ptr() % (2 << 20) == 0 for pair in runner.kv_caches for c in pair)  # whole huge pages each
    assert _smaps_kib(first, span, "Rss:") * 1024 < span // 8  # read (above), never written: not resident
    assert all("nh" in _vm_flags(c.data_ptr()) for pair in runner.kv_caches for c in pair)  # the first blocks: 4 KiB
    v0[:64].fill_(1.0)  # the first 64 blocks of one layer's V written
    written = v0[:64].numel() * v0.element_size()
    assert written <= _smaps_kib(v0.data_ptr(), written, "Rss:") * 1024 < span // 8


def test_the_runner_leaves_pages_alone_with_cpu_huge_pages_off(tiny_dirs, monkeypatch):
    from tests.runner.factory import make_runner

    from pkgd.runner import model_runner

    calls, lazy = [], []
    monkeypatch.setattr(model_runner, "collapse_to_huge_pages", lambda spans: calls.append(spans) or 0)
    real_lazy = model_runner.lazy_zeroed_buffers
    monkeypatch.setattr(
        model_runner,
        "lazy_zeroed_buffers",
        lambda sizes, **kw: lazy.append(kw.get("huge_pages", True)) or real_lazy(sizes, **kw),
    )
    model_dir, _ = tiny_dirs("llama")
    runner = make_runner(model_dir)
    assert calls  # on by default: the weights
    calls.clear()
    runner.config = runner.config.model_copy(
        update={"parallel": runner.config.parallel.model_copy(update={"cpu_huge_pages": False})}
    )
    runner.initialize_kv_cache(4, 16)
    assert calls == [] and lazy == [False]  # nor is the KV cache's mapping madvised


def test_torch_huge_pages_follow_the_config_unless_the_operator_chose(monkeypatch):
    import os

    from pkgd import host

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    host.set_torch_huge_pages(False)
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
    host.set_torch_huge_pages(True)  # the first choice (or the operator's) stands
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def _vm_flags(addr: int) -> set[str]:
    """The ``VmFlags`` of the mapping holding ``addr`` (``hg``: MADV_HUGEPAGE, ``nh``: NOHUGEPAGE)."""
    inside = False
    for line in open("/proc/self/smaps", encoding="ascii", errors="replace"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise only")
def test_lazy_buffers_keep_a_small_page_head_and_huge_pages_after_it():
    from pkgd.runner.allocator import lazy_zeroed_buffers

    mib = 1 << 20
    bufs = lazy_zeroed_buffers([8 * mib, 8 * mib, 4096], huge_pages=True, small_head=2 * mib)
    if "hg" not in _vm_flags(bufs[0].data_ptr() + 4 * mib):
        pytest.skip("this kernel has no transparent huge pages")
    for b in bufs[:2]:
        assert "nh" in _vm_flags(b.data_ptr()) and "nh" in _vm_flags(b.data_ptr() + 2 * mib - 1)
        assert "hg" in _vm_flags(b.data_ptr() + 2 * mib) and "hg" in _vm_flags(b.data_ptr() + 8 * mib - 1)
        b[0] = 1  # a first write in the head: 4 KiB, not a huge page
        assert _smaps_kib(b.data_ptr(), 2 * mib, "AnonHugePages:") == 0
        assert int(b[:4096].sum()) == 1 and int(b.sum()) == 1  # zero elsewhere, head or not
    assert "nh" in _vm_flags(bufs[2].data_ptr())  # a buffer smaller than the head: all of it
    plain = lazy_zeroed_buffers([8 * mib], huge_pages=True)
    assert "hg" in _vm_flags(plain[0].data_ptr())  # no head asked: huge pages from the start
