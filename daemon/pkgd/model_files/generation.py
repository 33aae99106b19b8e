"""Sampling defaults from a model's ``generation_config.json`` (vLLM's ``--generation-config``).

``model.generation_config``: ``auto`` reads the model directory's file, ``vllm`` reads none, any
other value is a directory holding the file. Of the file's keys pkgd takes the ones it has
defaults for (`pkgd.config.sections.GenerationDefaults`): ``temperature``, ``top_p``,
``top_k``, ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``), as vLLM does;
``model.generation`` beats them and a request's own values beat both. Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pkgd.model_files.errors import ModelSourceError

_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(setting: str, model_dir: Path) -> dict[str, Any]:
    """The sampling defaults ``setting`` (``model.generation_config``) gives for the model in
    ``model_dir``: pkgd's field name → value; empty when there are none.

    Raises:
        ModelSourceError: ``setting`` names a directory without a readable
            generation_config.json, or the file is not a JSON object.
    """
    if setting == "vllm":
        return {}
    path = (model_dir if setting == "auto" else Path(setting).expanduser()) / "generation_config.json"
    if not path.is_file():
        if setting == "auto":
            return {}
        raise ModelSourceError(f"model.generation_config: {setting!r} holds no generation_config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"model.generation_config: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"model.generation_config: {path} is not a JSON object")
    return {ours: data[theirs] for theirs, ours in _KEYS.items() if data.get(theirs) is not None}
