"""Resolving ``model.dtype`` to a torch dtype: the one place that decides.

``auto`` means:

* CUDA: the checkpoint's dtype (``torch_dtype`` in ``config.json``), float32 when unknown.
* CPU: bfloat16 when the CPU computes bf16 natively (x86 ``amx_bf16`` or ``avx512_bf16``, Arm
  ``bf16``) **and** a start-up measurement on this model's shapes confirms it: oneDNN's packed
  GEMMs at the batch sizes the scheduler builds (`BATCH_SIZES` rows) and the decode GEMV (one
  row, through the C kernel where it is loaded, over as many copies of a layer's weights as
  the model has layers, up to twice the last-level cache: read from DRAM as a decode step
  reads them), each at least `BF16_MIN_SPEEDUP` times faster
  than float32; float32 otherwise, whatever the checkpoint's dtype (vLLM also runs a float32
  checkpoint in 16 bits by default; SmolLM2's GGUF is 4-bit, so its float32 copy holds nothing
  bf16 loses). Without those instructions bf16 GEMMs go through conversion paths (measured on
  an AVX2 machine: bf16 ``torch.mm`` ~200x slower than fp32), so such a host never measures and
  ``auto`` is float32 there: never slower than float32.

`choose_dtype` returns a `DtypeChoice` (dtype, reason, the CPU features that decided and the
figures measured), which the runner logs as one ``dtype_choice`` line; `probe_cpu_dtype`
gives the same for a model's shapes without loading it (what ``pkgd collect-env`` can show).

The measurement is kept in a small JSON file per host and shapes (`MeasurementCache`, under
``model.cache_dir``'s ``dtype-choice/``): a restart reuses the first start's figures, so on a
host where bf16's gain sits near `BF16_MIN_SPEEDUP` every start runs the same dtype (measured
on one shared host: two starts 30 s apart chose differently). The key covers what the figures
depend on (the CPU's model name and flags, torch's version, the shapes and layer count, the C
kernel library and its bf16 path, `MEASUREMENT_VERSION`); deleting the file measures again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

logger = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHECKPOINT_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "bf16")
"""The CPU features a `DtypeChoice` reports (those present)."""

BATCH_SIZES = (64, 256)
"""Rows of the batched GEMMs measured: the decode batches and prefill chunks a busy engine runs."""
BF16_MIN_SPEEDUP = 1.1
"""bf16 must beat float32 by this factor on both measurements: a smaller gain is within the
noise of a shared host and not worth bf16's rounding."""

MEASUREMENT_VERSION = 2
"""Part of a cached measurement's key: raise it when `measure_bf16_speedup` changes what it
times, so figures of the old method are not reused (2: the decode GEMV reads its weights from
DRAM; version 1 timed one layer's, which sit in the last-level cache and hid bf16's gain)."""

DECODE_READ_CACHE_MULTIPLE = 2
"""The decode measurement streams at least this many times the last-level cache's bytes of
float32 weights (when the model has that many), so neither dtype's weights stay cached."""

Shape = tuple[int, int]  # (out_features, in_features) of one linear


def _cpuinfo_field(*names: str) -> str | None:
    """The first ``/proc/cpuinfo`` line named one of ``names``, its value; None where absent
    or unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in names:
                    return value.strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (x86 ``flags`` / Arm ``Features``); empty
    where unreadable."""
    return frozenset((_cpuinfo_field("flags", "Features") or "").split())


@functools.cache
def cpu_model_name() -> str:
    """The CPU's name in ``/proc/cpuinfo`` (x86 ``model name``, Arm ``CPU part``); empty where
    unreadable."""
    return _cpuinfo_field("model name", "CPU part") or ""


def last_level_cache_bytes() -> int:
    """Bytes of the largest CPU cache sysfs lists for cpu0 (``/sys/devices/system/cpu/cpu0/
    cache/index*/size``); 0 where unreadable."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text(encoding="ascii").strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes)


def decode_copies(shapes: Sequence[Shape], layers: int, cache_bytes: int | None = None) -> int:
    """How many copies of one layer's linears (``shapes``) the decode measurement reads in
    turn: enough float32 bytes to exceed `DECODE_READ_CACHE_MULTIPLE` x ``cache_bytes``
    (default: `last_level_cache_bytes`), at most ``layers`` (a model that fits in the cache is
    measured in the cache, as it runs), at least 1."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    layer_bytes = 4 * sum(n * k for n, k in shapes) or 1
    return max(1, min(layers, -(-DECODE_READ_CACHE_MULTIPLE * cache // layer_bytes)))


def cpu_has_native_bf16(flags: frozenset[str] | set[str] | None = None) -> bool:
    """Whether the CPU computes bf16 natively (``flags`` defaults to this machine's)."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else set(flags)))


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """What ``model.dtype`` resolved to and why.

    ``reason``: ``requested`` (not ``auto``), ``checkpoint`` (CUDA), ``no native bf16``,
    ``nothing measured`` (no shapes given), ``bf16 measured faster`` or ``bf16 not faster
    enough``. ``features``: the `REPORTED_FLAGS`
    this CPU has. ``figures``: the measurement (`measure_bf16_speedup`), empty when none ran.
    """

    dtype: torch.dtype
    requested: str
    reason: str
    features: tuple[str, ...] = ()
    figures: dict[str, float] = dataclasses.field(default_factory=dict)
    measurement: str = ""
    """Where ``figures`` came from: ``measured now``, ``cached <file>`` (`MeasurementCache`),
    empty when none ran."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``dtype``, ``requested``, ``reason``, ``features``, ``figures``,
        ``measurement``."""
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "requested": self.requested,
            "reason": self.reason,
            "features": list(self.features),
            "figures": dict(self.figures),
            "measurement": self.measurement,
        }


class MeasurementCache:
    """`measure_bf16_speedup`'s figures kept as one JSON file per key in ``directory``
    (created on first store). A file that is unreadable or not this layout counts as absent;
    a failed store is logged (``dtype_measurement_not_cached``) and changes nothing else."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @staticmethod
    def key(shapes: Sequence[Shape], kernels: Any = None, flags: frozenset[str] | None = None, layers: int = 1) -> str:
        """A 16-hex-digit digest of what the figures depend on (module docstring)."""
        return MeasurementCache.digest(
            {
                "version": MEASUREMENT_VERSION,
                "shapes": [list(s) for s in shapes],
                "layers": layers,
                "kernels": None if kernels is None else [Path(kernels.path).name, kernels.bf16_impl],
            },
            flags,
        )

    @staticmethod
    def digest(ident: dict[str, Any], flags: frozenset[str] | set[str] | None = None) -> str:
        """A 16-hex-digit digest of ``ident`` (JSON-ready) together with this host's torch
        version, CPU name and ``flags`` (default: this CPU's): the key of a measurement."""
        full = {**ident, "torch": torch.__version__, "cpu": cpu_model_name()}
        full["flags"] = sorted(cpu_flags() if flags is None else flags)
        return hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:16]

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> dict[str, float] | None:
        """The figures stored under ``key``, or None."""
        try:
            figures = json.loads(self.path(key).read_text(encoding="utf-8"))["figures"]
            if all(isinstance(figures[k], (int, float)) for k in ("batched_speedup", "decode_speedup")):
                return {k: float(v) for k, v in figures.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return None

    def store(self, key: str, figures: dict[str, float]) -> None:
        """Write ``figures`` under ``key`` atomically (a temporary file renamed into place)."""
        target = self.path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"cpu": cpu_model_name(), "figures": figures}, indent=1), encoding="utf-8")
            os.replace(tmp, target)
        except OSError as exc:
            logger.warning("dtype_measurement_not_cached", path=str(target), error=str(exc))


def linear_shapes(arch: Any, tp_size: int = 1) -> list[Shape]:
    """``(out, in)`` of one decoder layer's linears on one tensor-parallel rank: QKV, o_proj,
    gate/up, down_proj (the LM head is left out: measuring it would allocate ~170 MB for
    SmolLM2's vocabulary, and it has the body's shapes' speed)."""
    d, h, i = arch.head_dim, arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * d // tp_size, max(1, arch.num_key_value_heads // tp_size) * d
    return [(q + 2 * kv, h), (h, q), (2 * i // tp_size, h), (h, i // tp_size)]


def measure_bf16_speedup(
    shapes: Sequence[Shape], kernels: Any = None, layers: int = 1, *, repeat: int = 5, threads: int = 1
) -> dict[str, float]:
    """Time one layer's linears in float32 and bfloat16 as the model would run them: oneDNN's
    packed GEMM at each of `BATCH_SIZES` rows, and one row through the C GEMV of ``kernels``
    (a `pkgd_kernels.cpu.CpuKernels`) where it reads the packing, else oneDNN. Each call is
    warmed up once (oneDNN builds its kernels on a shape's first call), then timed ``repeat``
    times, the float32 and bf16 forms of one call back to back (in alternating order), so a
    burst of load from other processes hits both alike; a call's best time counts.

    The decode GEMV runs over `decode_copies` copies of the layer (``layers``: the model's
    layer count), one after another as a decode step runs its layers: a model larger than the
    last-level cache streams its weights from DRAM, where bf16 reads half the bytes, and one
    layer's weights alone would sit in the cache (measured on a 32 MiB-L3 host: 1.09-1.13x
    from the cache where the whole model decodes 1.5x faster in bf16).

    On ``threads`` torch threads (restored after): the ratio is the instruction set's, not the
    thread count's, and on a shared host a 2-thread OpenMP region stalls whenever another
    process takes a core (measured here: the same bf16 GEMMs 3-30x slower on two threads
    than on one in a busy minute), which one thread does not.

    Returns:
        ``{"batched_fp32_ms", "batched_bf16_ms", "batched_speedup", "decode_fp32_ms",
        "decode_bf16_ms", "decode_speedup", "decode_copies"}``: milliseconds for one layer
        (batched: summed over the batch sizes; decode: a pass over the copies divided by
        their number), speedups as fp32 time / bf16 time.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(shapes, kernels, repeat, decode_copies(shapes, layers))
    finally:
        torch.set_num_threads(before)


def float_linear_call(
    x: torch.Tensor, weight: torch.Tensor, kernels: Any, alive: list[torch.Tensor]
) -> Callable[[], object]:
    """``x @ weight^T`` as the model calls it, as a callable to time: oneDNN's packed GEMM, or
    one row through the C GEMV of ``kernels`` where it reads the packing, else ``F.linear``.
    ``alive`` keeps the packed weights a GEMV view reads until the caller drops it."""
    import pkgd_kernels as pk
    from pkgd.runner.layers.linear import onednn_linear, pack_for_onednn, packed_view

    pack = pack_for_onednn(weight)
    if pack is None:
        return functools.partial(torch.nn.functional.linear, x, weight)
    n, k = weight.shape
    view = packed_view(pack, n, k) if kernels is not None and x.shape[0] == 1 else None
    if view is None:
        return functools.partial(onednn_linear, x, pack, None)
    alive.append(pack)
    return functools.partial(pk.gemv_packed, x, view, None, kernels=kernels)


def time_pairs(pairs: Sequence[Sequence[Callable[[], object]]], repeat: int) -> tuple[float, float]:
    """Seconds of two forms of the same calls (``pair[0]``, ``pair[1]`` of each pair), each
    call's best of ``repeat`` after one warm-up (oneDNN builds its kernels on a shape's first
    call), summed over the pairs. The two forms of a call run back to back, in alternating
    order, so a burst of load from other processes hits both alike."""
    total = [0.0, 0.0]
    for pair in pairs:
        best = [float("inf"), float("inf")]
        for call in pair:
            call()
        for rep in range(repeat):
            for i in (0, 1) if rep % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                pair[i]()
                best[i] = min(best[i], time.perf_counter() - t0)
        total = [total[0] + best[0], total[1] + best[1]]
    return total[0], total[1]


def _measure(shapes: Sequence[Shape], kernels: Any, repeat: int, copies: int = 1) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16)
    plain = [{dt: torch.randn(n, k, generator=g).to(dt) for dt in dtypes} for n, k in shapes]
    alive: list[torch.Tensor] = []  # the packed weights the GEMV views read, until the end
    pairs: dict[str, list[list[Callable[[], object]]]] = {"batched": [], "decode": []}
    for w in plain:
        for m in BATCH_SIZES:
            pairs["batched"].append(
                [
                    float_linear_call(torch.randn(m, w[dt].shape[1], generator=g).to(dt), w[dt], kernels, alive)
                    for dt in dtypes
                ]
            )
    # One decode pass runs layer after layer: every linear of copy 0, then of copy 1, ...; a
    # copy beyond the first is a fresh buffer, so each is read from memory, not the cache.
    passes: dict[torch.dtype, list[Callable[[], object]]] = {dt: [] for dt in dtypes}
    for c in range(copies):
        for w in plain:
            for dt in dtypes:
                weight = w[dt] if c == 0 else w[dt].clone()
                x = torch.randn(1, weight.shape[1], generator=g).to(dt)
                passes[dt].append(float_linear_call(x, weight, kernels, alive))
    pairs["decode"].append([functools.partial(run_all, passes[dt]) for dt in dtypes])
    out: dict[str, float] = {}
    for kind, calls in pairs.items():
        fp32, bf16 = time_pairs(calls, repeat)
        per = copies if kind == "decode" else 1
        out[f"{kind}_fp32_ms"] = round(fp32 * 1e3 / per, 3)
        out[f"{kind}_bf16_ms"] = round(bf16 * 1e3 / per, 3)
        out[f"{kind}_speedup"] = round(fp32 / bf16, 3)
    out["decode_copies"] = copies
    return out


def run_all(calls: Sequence[Callable[[], object]]) -> None:
    """Call each of ``calls`` in turn (one timed pass)."""
    for call in calls:
        call()


def choose_dtype(
    requested: str,
    checkpoint_dtype: str | None,
    device_type: str,
    *,
    shapes: Sequence[Shape] = (),
    layers: int = 1,
    kernels: Any = None,
    flags: frozenset[str] | set[str] | None = None,
    measure: Callable[..., dict[str, float]] = measure_bf16_speedup,
    cache: MeasurementCache | None = None,
) -> DtypeChoice:
    """The dtype to run in, and why (module docstring for ``auto``).

    Args:
        requested: ``model.dtype``: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
        checkpoint_dtype: ``torch_dtype`` of ``config.json`` (None when absent).
        device_type: ``"cpu"`` or ``"cuda"``.
        shapes: one layer's linears (`linear_shapes`), measured on a bf16-capable CPU; with
            none given there is nothing to confirm bf16 by, so ``auto`` stays float32.
        layers: the model's decoder layers (how much the decode measurement may stream).
        kernels: the loaded `pkgd_kernels.cpu.CpuKernels` (the decode GEMV measured through it).
        flags: CPU feature flags (tests); default: this machine's.
        measure: the measurement (tests pass a fake): ``measure(shapes, kernels, layers) ->
            figures``.
        cache: where the figures are looked up before measuring, and stored after; None
            measures every time.

    Raises:
        ValueError: an unknown ``requested`` value.
    """
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"model.dtype {requested!r} is not one of auto, {', '.join(_DTYPES)}")
        return DtypeChoice(_DTYPES[requested], requested, "requested")
    if device_type == "cuda":
        ckpt = _CHECKPOINT_DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)
        return DtypeChoice(ckpt, requested, "checkpoint")
    have = cpu_flags() if flags is None else frozenset(flags)
    features = tuple(f for f in REPORTED_FLAGS if f in have)
    if not cpu_has_native_bf16(have):
        return DtypeChoice(torch.float32, requested, "no native bf16", features)
    if not shapes:
        return DtypeChoice(torch.float32, requested, "nothing measured", features)
    key = MeasurementCache.key(shapes, kernels, have, layers) if cache is not None else ""
    figures = cache.load(key) if cache is not None else None
    if figures is not None:
        assert cache is not None
        source = f"cached {cache.path(key)}"
    else:
        figures, source = measure(list(shapes), kernels, layers), "measured now"
        if cache is not None:
            cache.store(key, figures)
    faster = figures["batched_speedup"] >= BF16_MIN_SPEEDUP and figures["decode_speedup"] >= BF16_MIN_SPEEDUP
    if faster:
        return DtypeChoice(torch.bfloat16, requested, "bf16 measured faster", features, figures, source)
    return DtypeChoice(torch.float32, requested, "bf16 not faster enough", features, figures, source)


def probe_cpu_dtype(
    arch: Any,
    tp_size: int = 1,
    kernels: Any = None,
    requested: str = "auto",
    cache: MeasurementCache | None = None,
) -> DtypeChoice:
    """`choose_dtype` on this CPU for ``arch`` (an `ArchConfig`) without loading weights: the
    features, choice and figures a ``collect-env`` report shows (from ``cache`` where the
    engine stored them, so the report shows the engine's choice)."""
    return choose_dtype(
        requested,
        arch.checkpoint_dtype,
        "cpu",
        shapes=linear_shapes(arch, tp_size),
        layers=arch.num_hidden_layers,
        kernels=kernels,
        cache=cache,
    )
