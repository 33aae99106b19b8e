"""How long running decodes wait while one long prompt prefills, for each value of
``scheduler.long_prefill_token_threshold``, measured in one run on the default model.

``--streams`` requests decode (short prompts, ``ignore_eos``); once all of them have their
first token a ``--prompt-len`` prompt arrives. Every engine step until that prompt's first
token is timed: each step gives every stream one token, so the longest step is the longest
gap any stream saw between two tokens. Printed per threshold (0 = only
``scheduler.max_num_batched_tokens`` limits a chunk): the worst and median gap, the long
prompt's time to first token (what the cap costs it), and the ratios against threshold 0. The
thresholds run alternately, ``--repeats`` times each; the median round is printed. Run:

    .venv/bin/python benchmarks/prefill_stall.py
    .venv/bin/python benchmarks/prefill_stall.py --thresholds 0,128,512 --prompt-len 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pkgd.offline.llm import LLM
from pkgd.sampling_params import SamplingParams


def one_round(llm: LLM, *, streams: int, prompt_len: int, tag: str) -> dict[str, float]:
    """One measurement: returns ``max_gap_s``, ``median_gap_s``, ``long_ttft_s``, ``steps``."""
    engine, rng = llm.engine, random.Random(0)
    vocab = engine.vocab_size
    engine.reset_prefix_cache()  # the long prompt must be computed, not served from the cache

    def add(rid: str, n: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        engine.add_request(llm.input_processor.process(rid, ids, params).engine_requests[0])

    ids = [f"{tag}-s{i}" for i in range(streams)]
    for rid in ids:
        add(rid, 32, 1024)  # outlasts the long prefill: one token a step, it takes fewer steps
    started: set[str] = set()
    while len(started) < streams:
        started |= {o.request_id for o in engine.step()}
    long_id = f"{tag}-long"
    t_add = time.perf_counter()
    add(long_id, prompt_len, 1)
    gaps: list[float] = []
    while True:
        t0 = time.perf_counter()
        outs = engine.step()
        gaps.append(time.perf_counter() - t0)
        if any(o.request_id == long_id for o in outs):
            ttft = time.perf_counter() - t_add
            break
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "max_gap_s": max(gaps),
        "median_gap_s": statistics.median(gaps),
        "long_ttft_s": ttft,
        "steps": len(gaps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thresholds", default="0,256", help="comma-separated values of the cap (0 = none)")
    ap.add_argument("--prompt-len", type=int, default=4096, help="tokens of the long prompt")
    ap.add_argument("--streams", type=int, default=8, help="requests decoding meanwhile")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    thresholds = [int(t) for t in args.thresholds.split(",")]
    llms = {
        t: LLM(max_model_len=max(args.prompt_len, 1024) + 64, **{"scheduler.long_prefill_token_threshold": t})
        for t in thresholds
    }
    rounds: dict[int, list[dict[str, float]]] = {t: [] for t in thresholds}
    for rep in range(args.repeats):
        for t in thresholds:
            rounds[t].append(one_round(llms[t], streams=args.streams, prompt_len=args.prompt_len, tag=f"r{rep}t{t}"))
    budget = llms[thresholds[0]].config.scheduler.max_num_batched_tokens
    print(
        f"{args.streams} decoding streams, one {args.prompt_len}-token prompt arriving; "
        f"max_num_batched_tokens {budget}; median of {args.repeats} rounds (alternating)"
    )
    print(f"{'threshold':>10} {'worst gap s':>12} {'median gap s':>13} {'long TTFT s':>12} {'steps':>6}")
    med = {}
    for t in thresholds:
        r = sorted(rounds[t], key=lambda x: x["max_gap_s"])[len(rounds[t]) // 2]
        med[t] = r
        print(f"{t:>10} {r['max_gap_s']:>12.3f} {r['median_gap_s']:>13.3f} {r['long_ttft_s']:>12.2f} {r['steps']:>6}")
    base = med[thresholds[0]]
    for t in thresholds[1:]:
        print(
            f"threshold {t} vs {thresholds[0]}: worst gap {med[t]['max_gap_s'] / base['max_gap_s']:.2f}x, "
            f"long prompt's TTFT {med[t]['long_ttft_s'] / base['long_ttft_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
