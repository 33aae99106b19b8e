"""Model-side numbers for the roofline figures: parameter count and bytes per weight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float": 4}


def count_parameters(model_dir: str | Path) -> int:
    """Parameters in the safetensors files of an HF directory (tied weights counted once),
    read from the file headers without loading tensors. Raises `FileNotFoundError` when the
    directory has no safetensors file."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {str(model_dir)!r}")
    total = 0
    for f in files:
        with safe_open(str(f), framework="numpy") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype or its name (``float32``, ``torch.bfloat16`` …)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None
