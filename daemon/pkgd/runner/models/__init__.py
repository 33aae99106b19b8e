"""Model implementations written for the paged KV cache, one file per family, and the
registry that picks one by the HF ``architectures`` name in ``config.json``."""

from __future__ import annotations

import importlib

# HF architectures name -> "module:class" (imported on use).
MODEL_REGISTRY: dict[str, str] = {
    "Gemma2ForCausalLM": "pkgd.runner.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "pkgd.runner.models.gemma3:Gemma3ForCausalLM",
    "LlamaForCausalLM": "pkgd.runner.models.llama:LlamaForCausalLM",
    "LlamaForSequenceClassification": "pkgd.runner.models.classifier:LlamaForSequenceClassification",
    "MixtralForCausalLM": "pkgd.runner.models.mixtral:MixtralForCausalLM",
    "MistralForCausalLM": "pkgd.runner.models.mistral:MistralForCausalLM",
    "Phi3ForCausalLM": "pkgd.runner.models.phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "pkgd.runner.models.qwen2:Qwen2ForCausalLM",
    "Qwen2ForSequenceClassification": "pkgd.runner.models.classifier:Qwen2ForSequenceClassification",
    "Qwen3ForCausalLM": "pkgd.runner.models.qwen3:Qwen3ForCausalLM",
    "Qwen3ForSequenceClassification": "pkgd.runner.models.classifier:Qwen3ForSequenceClassification",
    "Qwen3MoeForCausalLM": "pkgd.runner.models.qwen3_moe:Qwen3MoeForCausalLM",
}


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no implementation here."""


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type:
    """The model class for an HF ``architectures`` name.

    Raises:
        UnsupportedArchitectureError: naming the architecture and listing the supported ones.
    """
    target = MODEL_REGISTRY.get(architecture)
    if target is None:
        raise UnsupportedArchitectureError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
