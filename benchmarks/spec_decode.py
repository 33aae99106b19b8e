"""Speculative decoding (n-gram prompt lookup) against the same run without it, as ratios
measured in one run on the offline engine with the real model (the embedded SmolLM2 unless
``model.source`` says otherwise), single stream, greedy.

Two workloads:

* **edit**: a text of ~150 words with typos and "Rewrite the text above, fixing the typos.
  Output only the corrected text." (chat template): the output mostly repeats the prompt, so
  n-gram lookup finds the continuation (target: >= 1.8x the output tokens/s without it);
* **free**: varied questions answered with ``frequency_penalty`` 1.0, so the answer repeats
  neither the prompt nor itself (a 135M model's plain greedy answers fall into loops, which
  n-gram lookup then predicts well); target >= 0.95x: a proposal that finds no match costs
  nothing, a wrong one a larger verify step.

Each workload runs without and with speculation alternately ``--repeat`` times (default 3);
printed: output tokens/s of each (median), the median ratio and its spread, the acceptance
rate (accepted / proposed tokens) and mean tokens per step of the speculating runs, and
whether the greedy texts are identical. The machine may be shared: alternating runs and the
spread show load from other processes. Run:

    .venv/bin/python benchmarks/spec_decode.py
    .venv/bin/python benchmarks/spec_decode.py --max-tokens 200 --repeat 3 --k 4 --lookup-max 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as under `pkgd`

from pkgd.offline.llm import LLM  # noqa: E402
from pkgd.sampling_params import SamplingParams  # noqa: E402

EDIT_TEXT = (
    "The quick brown fox jumpd over the lazy dog near the river bank. Every morning, the farmer "
    "walkd to the market with a basket of fresh aples and oranges. He sold them to the villagers, "
    "who always greeted him with a smille. One day, a stranger arived in the village and asked "
    "about the old mill on the hill. Nobody knew much about it, exept that it had been closed for "
    "many years. The stranger decided to explore the mill by himself. Inside, he found dusty "
    "machinery, broken windows and a small wooden box hiden under the floor. The box contained "
    "letters writen by the miller's daughter, telling the story of her life in the village a "
    "century ago."
)
EDIT_PROMPTS = [EDIT_TEXT + "\n\nRewrite the text above, fixing the typos. Output only the corrected text."]
FREE_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three tips for a job interview.",
    "What are the main causes of the French Revolution?",
]
FREE_PENALTY = 1.0


def run_once(
    llm: LLM, prompts: list[str], max_tokens: int, frequency_penalty: float = 0.0
) -> tuple[float, int, list[list[int]]]:
    """Seconds, output tokens and token ids of the prompts run one after another (single stream)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, frequency_penalty=frequency_penalty)
    total = 0
    ids = []
    t0 = time.perf_counter()
    for p in prompts:
        out = llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0].outputs[0]
        total += len(out.token_ids)
        ids.append(list(out.token_ids))
    return time.perf_counter() - t0, total, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="speculative.num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    args = ap.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    base = LLM(max_model_len=2048)
    fast = LLM(max_model_len=2048, speculative_config=spec)
    print(f"speculative config: {spec}; single stream, greedy, max_tokens {args.max_tokens}")
    for name, prompts, penalty in (("edit", EDIT_PROMPTS, 0.0), ("free", FREE_PROMPTS, FREE_PENALTY)):
        run_once(base, prompts[:1], 8)  # warm-up
        run_once(fast, prompts[:1], 8)
        before = fast.engine.stats()
        rates: dict[str, list[float]] = {"off": [], "ngram": []}
        same = True
        for _ in range(args.repeat):
            s0, n0, ids0 = run_once(base, prompts, args.max_tokens, penalty)
            s1, n1, ids1 = run_once(fast, prompts, args.max_tokens, penalty)
            rates["off"].append(n0 / s0)
            rates["ngram"].append(n1 / s1)
            same = same and ids0 == ids1
        after = fast.engine.stats()
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
        ratios = [b / a for a, b in zip(rates["off"], rates["ngram"])]
        print(
            f"{name}: off {statistics.median(rates['off']):.1f} tok/s, ngram "
            f"{statistics.median(rates['ngram']):.1f} tok/s, ratio {statistics.median(ratios):.2f}x "
            f"(runs {', '.join(f'{r:.2f}' for r in ratios)}); accepted {accepted}/{drafted} proposed tokens "
            f"({accepted / max(drafted, 1):.0%}) in {drafts} proposals; identical greedy output: {same}"
        )


if __name__ == "__main__":
    main()
