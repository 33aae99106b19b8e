"""Offline throughput workloads and runs (the seeds' ``vllm bench throughput``).

A `Workload` is a list of token-id prompts and the output length each should produce. Random
prompts draw token ids uniformly from the vocabulary without special tokens (vLLM's random
dataset); fixed prompts tile a fixed English paragraph, each prompt led by its own number so
that prompts do not share a prefix (the prefix cache would otherwise make them free).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import TYPE_CHECKING, Any, Literal

from pkgd.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pkgd.engine.llm import LLM

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
    """Counts and wall time (seconds) of one run."""

    elapsed: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed


def run_pkgd(llm: LLM, workload: Workload, *, ignore_eos: bool, temperature: float = 0.0, use_tqdm: bool = False) -> RunResult:
    """All prompts through `LLM.generate` at once (continuous batching)."""
    params = [
        SamplingParams(max_tokens=n, ignore_eos=ignore_eos, temperature=temperature, seed=i, detokenize=False)
        for i, n in enumerate(workload.output_lens)
    ]
    llm.engine.reset_prefix_cache()  # a repeated workload must not be served from the cache
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return RunResult(elapsed, len(outs), workload.num_prompt_tokens, out_tokens)


@dataclasses.dataclass
class SingleStreamResult:
    """One request alone: end-to-end seconds, time to first token, decode tokens/s."""

    elapsed: float
    ttft: float
    decode_tokens_per_s: float
    output_tokens: int


def run_single_stream(llm: LLM, *, input_len: int = 128, output_len: int = 128, vocab_size: int, seed: int = 1) -> SingleStreamResult:
    """1 request, ``input_len`` in / ``output_len`` out, greedy, ignore_eos. Decode rate =
    (output tokens − 1) ÷ (last token time − first token time)."""
    (prompt,) = make_workload(num_prompts=1, input_len=input_len, output_len=output_len, vocab_size=vocab_size,
                              tokenizer=llm.get_tokenizer(), seed=seed).prompts
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    t0 = time.time()
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    elapsed = time.time() - t0
    m = out.metrics or {}
    n = len(out.outputs[0].token_ids)
    first, last = m.get("first_token_time", t0), m.get("last_token_time", t0 + elapsed)
    rate = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return SingleStreamResult(elapsed, first - t0, rate, n)
