"""Cost of structured outputs on the engine, as ratios measured in one run.

Prints, for ``--streams`` concurrent greedy requests (default 16) of ``--max-tokens`` outputs
on the offline engine (the model of the config, by default the embedded SmolLM2):

* TPOT (mean time per output token after the first) and output tokens/s with a JSON schema
  against the same requests without one (target: at most 10 % slower). The schema asks for
  an array of at least 1000 integers, so no stream can finish early and both runs produce
  the same number of tokens; it is compiled before the timed runs.
* The share of the constrained steps' time spent on structured outputs (bitmask fill, mask
  applied to the logits, matcher advance), timed inside the same steps: the overhead
  measured without the noise between runs.
* TTFT of a request whose schema (a 24-property object) is not compiled yet against one
  whose schema is (what a first compile costs), each the median of ``--repeat`` requests
  run alone, and the difference in milliseconds.
* The compile-cache hit rate over ``--streams`` requests sharing one schema.

Constrained and free runs alternate ``--repeat`` times; the median ratio is printed with its
spread, so a burst of load from other processes shows as spread. Run:

    .venv/bin/python benchmarks/structured_outputs.py
    .venv/bin/python benchmarks/structured_outputs.py --streams 16 --max-tokens 64 --repeat 3
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as under `pkgd`

import pkgd.runner.model_runner as model_runner  # noqa: E402
from pkgd.engine.scheduler import Scheduler  # noqa: E402
from pkgd.offline.llm import LLM  # noqa: E402
from pkgd.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

_ids = itertools.count()


def numbers_schema(name: str = "numbers") -> dict:
    return {
        "type": "object",
        "properties": {
            name: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100000}, "minItems": 1000}
        },
        "required": [name],
    }


def wide_schema(tag: str) -> dict:
    kinds = [
        {"type": "integer", "minimum": 0, "maximum": 9},
        {"type": "string", "maxLength": 8},
        {"enum": ["a", "b", "c"]},
        {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    ]
    props = {f"{tag}_{i}": kinds[i % 4] for i in range(24)}
    return {"type": "object", "properties": props, "required": list(props)}


class Timers:
    """Seconds spent in the structured-output parts of each step, and in whole steps."""

    def __init__(self, llm: LLM) -> None:
        self.so = 0.0
        self.step = 0.0
        mgr = llm.engine.structured_output
        self._wrap(mgr, "fill_bitmask", mgr.fill_bitmask)
        self._wrap(model_runner, "apply_grammar_bitmask", model_runner.apply_grammar_bitmask)
        done = Scheduler._grammar_done
        Scheduler._grammar_done = staticmethod(self._timed(done))  # type: ignore[method-assign]
        step = llm.engine.step

        def timed_step():
            t = time.perf_counter()
            try:
                return step()
            finally:
                self.step += time.perf_counter() - t

        llm.engine.step = timed_step  # type: ignore[method-assign]

    def _timed(self, fn):
        def inner(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.so += time.perf_counter() - t

        return inner

    def _wrap(self, owner, name, fn) -> None:
        setattr(owner, name, self._timed(fn))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Run the requests together; TTFT / TPOT means (s) and output tokens/s."""
    engine = llm.engine
    start = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    for p in prompts:
        rid = f"b{next(_ids)}"
        processed = llm.input_processor.process(rid, p, params)
        engine.add_request(processed.engine_requests[0])
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
        if engine.pop_failed_requests():
            raise RuntimeError("a constraint failed to compile")
    wall = time.perf_counter() - start
    tpot = statistics.mean((last[r] - first[r]) / max(1, count[r] - 1) for r in count)
    return {
        "ttft": statistics.mean(first[r] - start for r in first),
        "tpot": tpot,
        "tok_s": sum(count.values()) / wall,
        "tokens": sum(count.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(max_model_len=1024)
    ip = llm.input_processor
    prompts = [
        ip.tokenize(
            ip.render_chat([{"role": "user", "content": f"List {i + 3} numbers as JSON."}]), add_special_tokens=False
        )
        for i in range(args.streams)
    ]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    so = StructuredOutputsParams(json=numbers_schema())
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)

    timers = Timers(llm)
    manager = llm.engine.structured_output
    q0, h0 = manager.num_queries, manager.num_hits
    run(llm, prompts, constrained)  # compiles the schema; warms both paths
    hit_rate = (manager.num_hits - h0) / (manager.num_queries - q0)
    run(llm, prompts, free)

    tpot, tok_s, share = [], [], []
    for _ in range(args.repeat):
        a = run(llm, prompts, free)
        timers.so = timers.step = 0.0
        b = run(llm, prompts, constrained)
        share.append(timers.so / timers.step)
        assert a["tokens"] == b["tokens"], (a, b)
        tpot.append(b["tpot"] / a["tpot"])
        tok_s.append(b["tok_s"] / a["tok_s"])

    cold, warm = [], []
    one = prompts[:1]
    for i in range(args.repeat):
        fresh = SamplingParams(
            temperature=0,
            max_tokens=2,
            structured_outputs=StructuredOutputsParams(json=wide_schema(f"k{i}_{time.time_ns()}")),
        )
        cold.append(run(llm, one, fresh)["ttft"])
        warm.append(run(llm, one, fresh)["ttft"])

    def show(name: str, values: list[float]) -> None:
        print(f"{name:<44} {statistics.median(values):6.3f}  (spread {min(values):.3f}-{max(values):.3f})")

    print(f"{args.streams} greedy streams x {args.max_tokens} tokens, {args.repeat} alternating rounds")
    show("TPOT, JSON schema / unconstrained", tpot)
    show("output tok/s, JSON schema / unconstrained", tok_s)
    show("structured-output time / constrained step time", share)
    show("TTFT, schema not compiled / compiled", [c / w for c, w in zip(cold, warm, strict=True)])
    show("TTFT, not compiled - compiled (ms)", [1000 * (c - w) for c, w in zip(cold, warm, strict=True)])
    print(f"{'compile-cache hit rate, one repeated schema':<44} {hit_rate:6.3f}  ({args.streams} requests)")
    llm.shutdown()


if __name__ == "__main__":
    main()
