"""Mistral (Jiang et al., 2023, "Mistral 7B"): Llama's architecture with sliding-window
attention where ``config.json`` sets ``sliding_window`` (each token attends to the last W
positions up to its own; `ArchConfig.window_of`, applied by the attention backend); a null
window (Mistral v0.2 and later) is plain causal attention. ``head_dim`` may be set apart from
``hidden_size`` (Mistral NeMo)."""

from __future__ import annotations

from pkgd.runner.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama model as is (the window comes from the config, per layer)."""
