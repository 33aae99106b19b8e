"""pkgd: an LLM serving daemon with vLLM's engine and OpenAI-compatible API.

``from pkgd import LLM, SamplingParams`` works as in vLLM. The names are resolved lazily
(PEP 562), so ``import pkgd`` stays light: torch loads only when an `LLM` is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pkgd.offline.llm",
    "SamplingParams": "pkgd.sampling_params",
    "BeamSearchParams": "pkgd.sampling_params",
    "RequestOutputKind": "pkgd.sampling_params",
    "PoolingParams": "pkgd.pooling_params",
    "StructuredOutputsParams": "pkgd.sampling_params",
    "RequestOutput": "pkgd.outputs",
    "PoolingOutput": "pkgd.outputs",
    "PoolingRequestOutput": "pkgd.outputs",
    "EmbeddingOutput": "pkgd.outputs",
    "EmbeddingRequestOutput": "pkgd.outputs",
    "ClassificationOutput": "pkgd.outputs",
    "ClassificationRequestOutput": "pkgd.outputs",
    "ScoringOutput": "pkgd.outputs",
    "ScoringRequestOutput": "pkgd.outputs",
    "CompletionOutput": "pkgd.outputs",
    "Logprob": "pkgd.outputs",
    "BeamSearchOutput": "pkgd.offline.beam_search",
    "BeamSearchSequence": "pkgd.offline.beam_search",
    "VllmConfig": "pkgd.config.vllm_config",
    "LoRARequest": "pkgd.lora_request",
}

__all__ = [*_LAZY, "__version__"]

if TYPE_CHECKING:
    from pkgd.config.vllm_config import VllmConfig
    from pkgd.lora_request import LoRARequest
    from pkgd.offline.beam_search import BeamSearchOutput, BeamSearchSequence
    from pkgd.offline.llm import LLM
    from pkgd.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from pkgd.pooling_params import PoolingParams
    from pkgd.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pkgd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
