"""Random LoRA adapters made with ``peft`` over a tiny transformers model (test helper)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base, out_dir: Path, *, r: int = 8, alpha: int = 16, targets=None, seed: int = 0, rslora: bool = False, scale=0.05
):
    """Save a PEFT LoRA adapter of ``base`` (a transformers model, left untouched) with every
    lora_A / lora_B entry random (PEFT's default B = 0 would change nothing) to ``out_dir``;
    returns the `peft.PeftModel` (unmerged, eval)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets or ALL_TARGETS), lora_dropout=0.0, use_rslora=rslora,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(copy.deepcopy(base), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    return model.eval()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def logprobs_of(model, tokens: list[int]) -> torch.Tensor:
    """float32 ``[len(tokens) - 1]``: log p(tokens[i+1] | tokens[:i+1])."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)
