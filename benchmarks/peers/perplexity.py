"""Perplexity of a fixed text, computed as ``llama-perplexity`` computes it, by pkgd and by llama.cpp.

The text: CPython's own help topics (``pydoc_data.topics``, English prose shipped with every
CPython), joined in key order and cut to ``--chars`` characters, so both engines read the same
file without anything being downloaded (`write_text`).

llama-perplexity's method (tools/perplexity/perplexity.cpp, ``perplexity()``): tokenize the whole
text (with BOS when the vocabulary adds one), cut it into ``n_ctx``-token chunks, give each
chunk a BOS in place of its first token when the vocabulary adds one, and score the tokens of
the second half only: ``-log p(t[k+1] | t[..k])`` for ``k`` in ``[n_ctx/2, n_ctx-2]``;
PPL = exp(mean). `pkgd_perplexity` does the same with pkgd's prompt logprobs (entry ``k+1``
of ``prompt_logprobs`` is that term).

Usage (in pkgd's venv): ``python perplexity.py TEXT_FILE [--ctx 512] [KEY=VALUE ...]`` prints one
JSON line ``{"ppl": ..., "tokens": ..., "chunks": ...}``; ``KEY=VALUE`` are `LLM` keywords.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path


def write_text(path: Path, chars: int = 60_000) -> Path:
    """Write the fixed text (the first ``chars`` characters of CPython's help topics) to ``path``."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k].strip() for k in sorted(topics.topics))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text[:chars], encoding="utf-8")
    return path


def gguf_adds_bos(gguf_path: Path) -> tuple[bool, int | None]:
    """``(add_bos, bos_token_id)`` from a GGUF file's tokenizer metadata (False when unset)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))

    def scalar(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.parts[field.data[0]].tolist()[0]

    return bool(scalar("tokenizer.ggml.add_bos_token")), scalar("tokenizer.ggml.bos_token_id")


def pkgd_perplexity(text: str, n_ctx: int, llm_kwargs: dict) -> dict:
    """PPL of ``text`` through pkgd's offline `LLM` with llama-perplexity's chunking."""
    from pkgd.offline.llm import LLM
    from pkgd.sampling_params import SamplingParams

    llm = LLM(**llm_kwargs)
    gguf_path = getattr(llm.engine.model_files, "gguf_path", None)
    add_bos, bos = gguf_adds_bos(gguf_path) if gguf_path else (False, None)
    tokens = llm.get_tokenizer().encode(text, add_special_tokens=False)
    if add_bos and bos is not None:
        tokens = [bos, *tokens]
    n_chunks = len(tokens) // n_ctx
    if n_chunks < 2:
        raise SystemExit(f"the text has {len(tokens)} tokens: fewer than two chunks of {n_ctx}")
    chunks = []
    for i in range(n_chunks):
        c = tokens[i * n_ctx : (i + 1) * n_ctx]
        if add_bos and bos is not None:
            c[0] = bos
        chunks.append(c)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    first, nll, count = n_ctx // 2, 0.0, 0
    for c, out in zip(chunks, outs):
        lps = out.prompt_logprobs
        for k in range(first, n_ctx - 1):
            nll -= lps[k + 1][c[k + 1]].logprob
            count += 1
    return {"ppl": math.exp(nll / count), "tokens": len(tokens), "chunks": n_chunks, "scored": count}


def parse_llama_perplexity(log: str) -> dict:
    """The final estimate and chunk count from llama-perplexity's output."""
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if not m:
        raise ValueError("no 'Final estimate' in llama-perplexity's output")
    return {
        "ppl": float(m.group(1)),
        "ppl_stderr": float(m.group(2)),
        "chunks": int(chunks.group(1)) if chunks else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="perplexity.py", description=__doc__.split("\n\n")[0])
    p.add_argument("text", type=Path)
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    p.add_argument("kwargs", nargs="*", metavar="KEY=VALUE", help="LLM keywords, e.g. dtype=bfloat16")
    args = p.parse_intermixed_args(argv)  # KEY=VALUE may follow --ctx
    import yaml

    kwargs = {k: yaml.safe_load(v) for k, _, v in (a.partition("=") for a in args.kwargs)}
    print(json.dumps(pkgd_perplexity(args.text.read_text(encoding="utf-8"), args.ctx, kwargs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
