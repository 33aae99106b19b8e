"""Shared fixtures of the engine tests."""

from tests.smollm2 import SMOLLM2_FILE, smollm2_gguf

__all__ = ["SMOLLM2_FILE", "smollm2_gguf"]
