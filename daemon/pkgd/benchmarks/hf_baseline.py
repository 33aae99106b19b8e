"""Hugging Face ``generate()`` with static batches: the baseline of ``pkgd bench throughput``.

The same prompts and output lengths as the pkgd run, in batches of ``batch_size`` taken in
order (vLLM's ``benchmark_throughput.py --backend hf`` does the same): each batch is
left-padded to its longest prompt and generates until its longest requested output, so short
requests wait for long ones, which is the cost continuous batching removes. Only the requested
tokens of each request count as output.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pkgd.benchmarks.throughput import RunResult, Workload


def load_hf_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32):
    """``AutoModelForCausalLM`` from an HF directory (safetensors), eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.eval()


@torch.inference_mode()
def run_hf(
    model, workload: Workload, *, batch_size: int, ignore_eos: bool, pad_token_id: int, eos_token_id: int | None
) -> RunResult:
    """Greedy ``generate()`` over static batches; returns the same counters as `run_pkgd`."""
    t0 = time.perf_counter()
    out_tokens = 0
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start : start + batch_size]
        lens = workload.output_lens[start : start + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        max_new = max(lens)
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new if ignore_eos else 0,
            do_sample=False,
            pad_token_id=pad_token_id,
            eos_token_id=None if ignore_eos else eos_token_id,
        )
        new = gen[:, width:]
        for i, n in enumerate(lens):
            row = new[i, :n].tolist()
            if not ignore_eos and eos_token_id in row:
                row = row[: row.index(eos_token_id) + 1]
            out_tokens += len(row)
    elapsed = time.perf_counter() - t0
    return RunResult(elapsed, len(workload.prompts), workload.num_prompt_tokens, out_tokens)
