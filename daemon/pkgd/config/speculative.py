"""The ``speculative`` section: speculative decoding (vLLM's ``--speculative-config``).

Keys and meanings are vLLM's ``SpeculativeConfig``: ``method: ngram`` proposes the tokens
that followed the latest earlier occurrence of the output's last n-gram (prompt lookup
decoding), ``method: draft_model`` lets a smaller model of the same vocabulary propose them.
The target model verifies ``num_speculative_tokens`` proposals per step in one forward pass
(`pkgd.engine.spec_decode`). Derived values (the effective lookup range) are computed by
`SpeculativeConfig.lookup_range`, never written back into the frozen tree.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from pkgd.config.fields import field
from pkgd.config.sections import Section

# vLLM's default n-gram size when neither bound is given (SpeculativeConfig.__post_init__).
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(Section):
    """Speculative decoding; off while ``method`` is null."""

    method: Literal["ngram", "draft_model"] | None = field(
        None,
        "ngram: propose the tokens that followed the latest earlier occurrence of the last "
        "n-gram of prompt + output (prompt lookup; no second model); draft_model: a smaller "
        "model of the same vocabulary (speculative.model) proposes them greedily. null = off, "
        "unless speculative.model is set (then draft_model).",
        aliases=("--spec-method",),
    )
    num_speculative_tokens: int | None = field(
        None,
        "Tokens proposed per step and verified in one target forward pass; required when a method is set.",
        aliases=("--spec-tokens",),
        ge=1,
        le=32,
    )
    prompt_lookup_min: int | None = field(
        None,
        "ngram: the shortest n-gram matched; null = prompt_lookup_max, or 5 when both are null (vLLM's default).",
        ge=1,
    )
    prompt_lookup_max: int | None = field(
        None,
        "ngram: the longest n-gram matched (tried first); null = prompt_lookup_min, or 5 when both are null.",
        ge=1,
    )
    model: str | None = field(
        None,
        "draft_model: the draft model's source (an HF directory, .gguf file or pkg: path, as "
        "model.source), with the target's vocabulary. It runs in the engine core with its own "
        "KV cache (same blocks as the target's).",
        aliases=("--spec-model",),
    )

    @model_validator(mode="before")
    @classmethod
    def _infer_method(cls, data: Any) -> Any:
        """vLLM infers a draft model from ``model`` alone."""
        if isinstance(data, dict) and data.get("method") is None and data.get("model") is not None:
            return {**data, "method": "draft_model"}
        return data

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def lookup_range(self) -> tuple[int, int]:
        """``(prompt_lookup_min, prompt_lookup_max)`` with vLLM's defaults filled in."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
        return (lo if lo is not None else hi), (hi if hi is not None else lo)  # type: ignore[return-value]


def speculative_problems(spec: SpeculativeConfig, *, tp: int) -> list[str]:
    """The broken rules of ``speculative`` (one line each, dotted paths)."""
    problems: list[str] = []
    if spec.method is None:
        given = [k for k in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max") if getattr(spec, k)]
        if given:
            problems.append(
                f"speculative.method: null, but speculative.{given[0]} is set; set method to ngram or draft_model"
            )
        return problems
    if spec.num_speculative_tokens is None:
        problems.append(f"speculative.num_speculative_tokens: required with speculative.method: {spec.method}")
    if spec.method == "ngram":
        if spec.model is not None:
            problems.append("speculative.model: a draft model is for method draft_model, not ngram")
        lo, hi = spec.lookup_range()
        if lo > hi:
            problems.append(f"speculative.prompt_lookup_min: {lo} is greater than speculative.prompt_lookup_max: {hi}")
    else:
        if spec.model is None:
            problems.append("speculative.model: required with speculative.method: draft_model")
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(spec, key) is not None:
                problems.append(f"speculative.{key}: only for method ngram, not draft_model")
        if tp > 1:
            problems.append(
                f"speculative.method: draft_model runs the draft in the engine-core process and needs "
                f"parallel.tp: 1 (got {tp}); use ngram"
            )
    return problems
