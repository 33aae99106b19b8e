"""Perplexity of a fixed text under pkgd, from prompt logprobs, the way ``llama-perplexity``
computes it, quantized GGUF weights against the dequantized float ones in one run.

The text (``benchmarks/data/perplexity.txt`` by default) is tokenized without special tokens
and cut into chunks of ``--ctx`` tokens (the tail that fills no chunk is dropped); each chunk
is one prompt, and only the logprobs of its second half count, every scored token having at
least ``ctx / 2`` tokens of context (llama.cpp's ``perplexity`` example; it also puts BOS first
in each chunk when the tokenizer adds one, as here). Perplexity = ``exp(-mean logprob)`` over
the scored tokens. Pass the same file and ``-c`` to ``llama-perplexity`` for its figure on
the same GGUF.

    .venv/bin/python benchmarks/perplexity.py                          # gguf (kept quantized) and none
    .venv/bin/python benchmarks/perplexity.py --quantization gguf --ctx 512 --model FILE.gguf
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from pkgd.config.sections import DEFAULT_MODEL_SOURCE

TEXT = Path(__file__).with_name("data") / "perplexity.txt"


def chunk_prompts(token_ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """The chunks of ``ctx`` tokens (BOS replacing each chunk's first token when given)."""
    chunks = [token_ids[i : i + ctx] for i in range(0, len(token_ids) - ctx + 1, ctx)]
    return [[bos, *c[1:]] if bos is not None else c for c in chunks]


def perplexity(llm, text: str, ctx: int) -> tuple[float, int, float]:
    """``(perplexity, tokens scored, seconds)`` of ``text`` under the loaded ``llm``.

    Raises:
        ValueError: the text is shorter than one chunk.
    """
    from pkgd.sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) else None
    prompts = chunk_prompts(ids, ctx, bos)
    if not prompts:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    t0 = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
        use_tqdm=False,
    )
    seconds = time.perf_counter() - t0
    total, n = 0.0, 0
    for prompt, out in zip(prompts, outs):
        for pos in range(ctx // 2, ctx):
            total += out.prompt_logprobs[pos][prompt[pos]].logprob
            n += 1
    return math.exp(-total / n), n, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL_SOURCE, help="model.source (a .gguf file for the comparison)")
    ap.add_argument("--file", type=Path, default=TEXT, help="the text (default: %(default)s)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per chunk (llama-perplexity's -c)")
    ap.add_argument("--quantization", choices=["gguf", "none", "both"], default="both")
    ap.add_argument("--threads", type=int, default=None, help="parallel.cpu_threads")
    args = ap.parse_args()
    from pkgd.offline.llm import LLM

    text = args.file.read_text(encoding="utf-8")
    results = {}
    for q in ("gguf", "none") if args.quantization == "both" else (args.quantization,):
        llm = LLM(
            model=args.model, quantization=q, dtype="float32", cpu_threads=args.threads
        )  # one arithmetic for both
        info = llm.engine.model_runner.model_info
        ppl, n, seconds = perplexity(llm, text, args.ctx)
        llm.shutdown()
        results[q] = ppl
        print(
            f"quantization={q} ({info.quantization}, {info.weight_bytes / 1e6:.0f} MB of weights): "
            f"perplexity {ppl:.4f} "
            f"over {n} tokens ({args.ctx}-token chunks of {args.file.name}), {seconds:.1f} s"
        )
    if len(results) == 2:
        print(f"perplexity ratio quantized / dequantized: {results['gguf'] / results['none']:.4f}")


if __name__ == "__main__":
    main()
