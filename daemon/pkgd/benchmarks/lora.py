"""``pkgd bench throughput --lora N``: the same workload through the base model alone and spread
round-robin over N random LoRA adapters, in one engine, alternating, so both see the same load.

The adapters are written in the PEFT format to a temporary directory (rank ``rank`` on every
projection that takes adapters: q/k/v/o and gate/up/down, shapes from the loaded model's
adapter slots), with small random A and B, so they load and compute as trained ones do; their
values do not matter to the speed. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from pkgd.benchmarks.throughput import RunResult, Workload, run_pkgd
from pkgd.lora_request import LoRARequest

_HF_NAMES = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


def write_random_adapters(shapes: dict, out_dir: Path, n: int, rank: int, seed: int = 0) -> list[LoRARequest]:
    """``n`` PEFT adapters of ``rank`` under ``out_dir`` for a model whose adapter slots have
    ``shapes`` (``(layer, linear) -> LinearShape``, `pkgd.runner.lora.manager.LoRAManager.shapes`);
    their `LoRARequest`\\ s (ids 1..n)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(n):
        path = out_dir / f"adapter-{i}"
        path.mkdir(parents=True)
        tensors = {}
        for (layer, linear), shape in shapes.items():
            group, names = _HF_NAMES[linear]
            for name, out in zip(names, shape.part_sizes, strict=True):
                key = f"base_model.model.model.layers.{layer}.{group}.{name}"
                tensors[f"{key}.lora_A.weight"] = 0.01 * torch.randn(rank, shape.in_features, generator=gen)
                tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(out, rank, generator=gen)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        targets = sorted({n for lin in {k[1] for k in shapes} for n in _HF_NAMES[lin][1]})
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
        (path / "adapter_config.json").write_text(json.dumps(config))
        requests.append(LoRARequest(f"bench-{i}", i + 1, str(path)))
    return requests


@dataclasses.dataclass
class LoRAComparison:
    """The fastest run of each: ``base`` (no adapter) and ``lora`` (round-robin over N)."""

    base: RunResult
    lora: RunResult
    all_base_s: list[float]
    all_lora_s: list[float]

    @property
    def ratio(self) -> float:
        """LoRA output tokens/s over the base model's (1.0 = no cost)."""
        return self.lora.output_tokens_per_s / self.base.output_tokens_per_s


def compare(llm: Any, workload: Workload, n: int, *, rank: int, repeats: int, ignore_eos: bool) -> LoRAComparison:
    """Run ``workload`` on the base model and over ``n`` adapters, ``repeats`` times each,
    alternating. ``llm`` must serve LoRA (``lora.enable_lora``, ``max_loras >= n``)."""
    manager = getattr(llm.engine.model_runner, "lora", None)
    if manager is None:
        raise ValueError("--lora needs an engine serving LoRA (one in this process, lora.enable_lora)")
    with tempfile.TemporaryDirectory(prefix="pkgd-bench-lora-") as tmp:
        adapters = write_random_adapters(manager.shapes, Path(tmp), n, rank)
        per_prompt = [adapters[i % n] for i in range(len(workload.prompts))]
        run_pkgd(llm, workload, ignore_eos=ignore_eos, lora_requests=per_prompt)  # loads them; warms the slots
        base, lora = [], []
        for _ in range(repeats):
            base.append(run_pkgd(llm, workload, ignore_eos=ignore_eos))
            lora.append(run_pkgd(llm, workload, ignore_eos=ignore_eos, lora_requests=per_prompt))
    return LoRAComparison(
        min(base, key=lambda r: r.elapsed),
        min(lora, key=lambda r: r.elapsed),
        [r.elapsed for r in base],
        [r.elapsed for r in lora],
    )
