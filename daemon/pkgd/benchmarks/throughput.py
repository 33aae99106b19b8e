"""Offline throughput workloads and runs (vLLM's ``vllm bench throughput``).

A `Workload` is a list of token-id prompts and the output length each should produce. Random
prompts draw token ids uniformly from the vocabulary without special tokens (vLLM's random
dataset); fixed prompts tile a fixed English paragraph, each prompt led by its own number so
that prompts do not share a prefix (the prefix cache would otherwise make them free).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pkgd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pkgd.offline.llm import LLM

PARAGRAPH = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines "
    "were programmed by rewiring panels; later, stored programs let the same hardware run any "
    "algorithm, and compilers let people write those algorithms in languages close to thought. "
)


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def _lengths(rng: random.Random, n: int, base: int, ratio: float, span: tuple[int, int] | None) -> list[int]:
    if span is not None:
        return [rng.randint(span[0], span[1]) for _ in range(n)]
    lo, hi = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_workload(
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    random_range_ratio: float = 0.0,
    output_len_range: tuple[int, int] | None = None,
    prompt_kind: Literal["random", "fixed"] = "random",
    tokenizer: Any = None,
    seed: int = 0,
) -> Workload:
    """Prompts of ``input_len`` tokens (± ``random_range_ratio``) and output lengths of
    ``output_len`` (± the same ratio), or uniform in ``output_len_range`` when given.

    Raises `ValueError` for fixed prompts without a tokenizer or non-positive sizes.
    """
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be at least 1")
    rng = random.Random(seed)
    in_lens = _lengths(rng, num_prompts, input_len, random_range_ratio, None)
    out_lens = _lengths(rng, num_prompts, output_len, random_range_ratio, output_len_range)
    if prompt_kind == "random":
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        allowed = [t for t in range(vocab_size) if t not in special]
        prompts = [[rng.choice(allowed) for _ in range(n)] for n in in_lens]
    else:
        if tokenizer is None:
            raise ValueError("fixed prompts need the model's tokenizer")
        body = tokenizer.encode(PARAGRAPH, add_special_tokens=False)
        prompts = []
        for i, n in enumerate(in_lens):
            head = tokenizer.encode(f"Document {i}. ", add_special_tokens=False)
            ids = head + body * (n // len(body) + 1)
            prompts.append(ids[:n])
    return Workload(prompts, out_lens)


@dataclasses.dataclass
class RunResult:
    """Counts and wall time (seconds) of one run; each request's time to first token and
    latency (seconds from its arrival, the start of the run, to its first / last token)."""

    elapsed: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    ttfts: list[float] = dataclasses.field(default_factory=list)
    latencies: list[float] = dataclasses.field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed


def run_pkgd(
    llm: LLM,
    workload: Workload,
    *,
    ignore_eos: bool,
    temperature: float = 0.0,
    use_tqdm: bool = False,
    lora_requests: list | None = None,
) -> RunResult:
    """All prompts through `LLM.generate` at once (continuous batching); ``lora_requests``:
    one `pkgd.lora_request.LoRARequest` (or None) per prompt."""
    params = [
        SamplingParams(max_tokens=n, ignore_eos=ignore_eos, temperature=temperature, seed=i, detokenize=False)
        for i, n in enumerate(workload.output_lens)
    ]
    llm.engine.reset_prefix_cache()  # a repeated workload must not be served from the cache
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=use_tqdm, lora_request=lora_requests)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    timed = [o.metrics for o in outs if o.metrics and "first_token_time" in o.metrics]
    return RunResult(
        elapsed,
        len(outs),
        workload.num_prompt_tokens,
        out_tokens,
        ttfts=[m["first_token_time"] - m["arrival_time"] for m in timed],
        latencies=[m["last_token_time"] - m["arrival_time"] for m in timed],
    )


@dataclasses.dataclass
class SingleStreamResult:
    """One request alone: end-to-end seconds, time to first token, decode tokens/s; with a probe,
    the harmonic mean of its readings before the decode steps (``paced_bandwidth``, bytes/s;
    the probe's own time is left out of ``elapsed`` and of the decode rate)."""

    elapsed: float
    ttft: float
    decode_tokens_per_s: float
    output_tokens: int
    paced_bandwidth: float | None = None


class _PacedEngine:
    """An `EngineCore` seen through a probe called before each ``step()``; records each reading
    with the wall-clock interval (``time.time()``, the clock of the output metrics) it took."""

    def __init__(self, engine: Any, probe: Callable[[], float]) -> None:
        self._engine, self._probe = engine, probe
        self.readings: list[tuple[float, float, float]] = []  # (start, end, value)

    def step(self) -> Any:
        t0 = time.time()
        value = self._probe()
        self.readings.append((t0, time.time(), value))
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def run_single_stream(
    llm: LLM,
    *,
    input_len: int = 128,
    output_len: int = 128,
    vocab_size: int,
    seed: int = 1,
    probe: Callable[[], float] | None = None,
) -> SingleStreamResult:
    """1 request, ``input_len`` in / ``output_len`` out, greedy, ignore_eos. Decode rate =
    (output tokens − 1) ÷ (last token time − first token time).

    With ``probe`` (e.g. `pkgd.benchmarks.hardware.BandwidthProbe.read`), it is called before
    every engine step; the readings taken between the first and the last token are averaged
    (harmonic mean: each weighs as the time its step would take at that bandwidth) into
    ``paced_bandwidth``, and their time is subtracted from the decode time."""
    (prompt,) = make_workload(
        num_prompts=1,
        input_len=input_len,
        output_len=output_len,
        vocab_size=vocab_size,
        tokenizer=llm.get_tokenizer(),
        seed=seed,
    ).prompts
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    engine = llm.engine
    paced = _PacedEngine(engine, probe) if probe is not None else None
    t0 = time.time()
    try:
        if paced is not None:
            llm.engine = paced  # type: ignore[assignment]  # duck-typed: step() paced, the rest forwarded
        (out,) = llm.generate([prompt], sp, use_tqdm=False)
    finally:
        llm.engine = engine
    elapsed = time.time() - t0
    m = out.metrics or {}
    n = len(out.outputs[0].token_ids)
    first, last = m.get("first_token_time", t0), m.get("last_token_time", t0 + elapsed)
    ttft, decode_s, bandwidth = first - t0, last - first, None
    if paced is not None:
        elapsed -= sum(end - start for start, end, _ in paced.readings)
        ttft -= sum(end - start for start, end, _ in paced.readings if end <= first)
        during = [(end - start, v) for start, end, v in paced.readings if first <= start and end <= last]
        decode_s -= sum(s for s, _ in during)
        if during:
            bandwidth = len(during) / sum(1.0 / v for _, v in during)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    return SingleStreamResult(elapsed, ttft, rate, n, bandwidth)
