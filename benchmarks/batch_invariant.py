"""The cost of ``model.batch_invariant``: the same offline work with it off and on, in one run.

Two workloads on the offline `LLM` (the embedded SmolLM2-135M-Instruct, or ``--model``), each
measured with the mode off, then on (a warm-up generation first on each engine):

* single stream: one prompt of ``--tokens`` random token ids, ``--max-tokens`` generated
  (greedy, EOS ignored): time to the first token (prefill) and decode tokens/s after it, from
  the request's own timestamps;
* batch: ``--batch`` such prompts at once: generated tokens/s over the whole run.

Printed: each figure with the mode off and on, and on/off ratios. Batch invariance computes
every token as its own one-token forward, so a prefill of T tokens costs about T decode steps
and a batch of B requests about B single-stream steps per token.

    .venv/bin/python benchmarks/batch_invariant.py [--tokens 128] [--max-tokens 32] [--batch 8]
"""

from __future__ import annotations

import argparse
import time

import torch

from pkgd import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model.source (default: the embedded SmolLM2)")
    p.add_argument("--tokens", type=int, default=128, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--batch", type=int, default=8, help="requests of the batch workload")
    p.add_argument("--threads", type=int, default=None, help="parallel.cpu_threads (default: every core)")
    return p.parse_args()


def measure(args: argparse.Namespace, invariant: bool) -> dict[str, float]:
    kw = {"batch_invariant": invariant, "enable_prefix_caching": False}
    if args.threads:
        kw["cpu_threads"] = args.threads
    with LLM(args.model, **kw) as llm:
        vocab = llm.engine.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (args.tokens,), generator=g).tolist() for _ in range(args.batch + 1)]
        full = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate([prompts[-1]], full, use_tqdm=False)  # warm-up
        m = llm.generate([prompts[0]], full, use_tqdm=False)[0].metrics or {}
        ttft = m["first_token_time"] - m["arrival_time"]
        decode = m["last_token_time"] - m["first_token_time"]
        t0 = time.perf_counter()
        llm.generate(prompts[: args.batch], full, use_tqdm=False)
        batch = time.perf_counter() - t0
    return {
        "ttft_s": ttft,
        "decode_tok_s": (args.max_tokens - 1) / decode,
        "batch_tok_s": args.batch * args.max_tokens / batch,
    }


def main() -> None:
    args = parse_args()
    off, on = measure(args, False), measure(args, True)
    print(f"prompt {args.tokens} tokens, {args.max_tokens} generated, batch {args.batch}")
    print(f"{'figure':<14}{'off':>10}{'on':>10}{'on/off':>9}")
    for key in off:
        print(f"{key:<14}{off[key]:>10.3f}{on[key]:>10.3f}{on[key] / off[key]:>9.2f}")


if __name__ == "__main__":
    main()
