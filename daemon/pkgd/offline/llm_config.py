"""`LLM(**kwargs)` → a validated `VllmConfig`, torch-free.

Keywords go through the command line's own alias table (`pkgd.config.overrides.keyword_ops`),
so every vLLM flag works as a keyword without its dashes (``tensor_parallel_size``,
``allowed_origins``, ``enable_prefix_caching``), besides a leaf's own name (``num_blocks``,
``tp``), a dotted path (``**{"cache.block_size": 32}``) or a whole section as a dict
(``cache={"num_blocks": 64}``). Unknown names raise `TypeError` with a did-you-mean;
invalid values raise `ValueError` with one line per problem and its dotted path.
"""

from __future__ import annotations

from typing import Any

import pydantic

from pkgd import host
from pkgd.config.layers import Provenance
from pkgd.config.overrides import ValueOp, keyword_ops
from pkgd.config.vllm_config import VllmConfig


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """One line per problem: ``dotted.path: message (got value)``."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "config"
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        lines.append(f"{path}: {err['msg']}{got}")
    return "\n".join(lines)


def build_llm_config(model: str | None = None, *, config: VllmConfig | None = None, **overrides: Any) -> VllmConfig:
    """The config of an offline `LLM`.

    Starts from ``config`` (or the defaults), sets ``model.source`` to ``model`` when given,
    applies ``overrides``, and, unless ``parallel.cpu_threads`` is set, uses every core (an
    offline engine has no API process to leave a core for), shared among the ``parallel.tp``
    ranks.

    Raises:
        TypeError: an unknown keyword.
        ValueError: a value the config rejects (one line per problem, dotted paths).
    """
    ops, problems = keyword_ops(overrides)
    if problems:
        raise TypeError("LLM() got " + "; ".join(problems))
    tree = Provenance(config.to_json_dict(reveal_secrets=True) if config is not None else {})
    if model is not None:
        ops.insert(0, ValueOp("model.source", model))
    for op in ops:
        if problem := tree.set_path(op.key, op.value, "keyword", op.origin):
            raise ValueError(f"invalid LLM configuration:\n{problem}")
    parallel = tree.data.get("parallel", {})
    if parallel.get("cpu_threads") is None:
        tp = parallel.get("tp", 1) if isinstance(parallel.get("tp", 1), int) else 1
        tree.set_path("parallel.cpu_threads", max(1, host.available_cores() // max(tp, 1)), "default", "cores")
    try:
        return VllmConfig.model_validate(tree.data)
    except pydantic.ValidationError as exc:
        raise ValueError("invalid LLM configuration:\n" + format_validation_error(exc)) from None
