"""Build a model and load its safetensors weights (HF names, full tensors; each layer keeps
its tensor-parallel shard, see `pkgd.runner.layers.linear`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.loader.resolve import ModelSourceError
from pkgd.runner.models import get_model_class
from pkgd.runner.models.config import ArchConfig


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of every ``*.safetensors`` file in ``model_dir``.

    Raises:
        ModelSourceError: no file, or one that is not valid safetensors (names the path).
    """
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"no *.safetensors file in {model_dir}")
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ModelSourceError(f"{path}: not a valid safetensors file ({e})") from e


def load_model(cfg: ArchConfig, model_dir: Path, *, dtype: torch.dtype, device: torch.device, tp: TPGroup = SINGLE) -> nn.Module:
    """Build ``cfg.architecture`` on ``device`` in ``dtype`` and load its weights.

    Raises:
        UnsupportedArchitectureError: the architecture is not registered.
        ModelSourceError: the weight files are missing or unreadable.
        ValueError: the weights do not fit the architecture (names, shapes, missing tensors).
    """
    cls = get_model_class(cfg.architecture)
    with torch.device(device):
        model = cls(cfg, tp=tp, dtype=dtype)
    with torch.no_grad():
        model.load_weights(iter_safetensors(model_dir))
    return model.eval()
