"""`LoRARequest`: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

A seam type: the frontend (or the offline `LLM`) sets it on a request, it crosses the wire
inside ``EngineCoreRequest``, the scheduler counts distinct adapters by ``lora_int_id``, the
runner loads ``lora_path`` into a slot. Field names and positional order are vLLM's:
``LoRARequest(lora_name, lora_int_id, lora_path)``. Torch-free; imports nothing of pkgd.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, frozen=True):
    """One adapter.

    Attributes:
        lora_name: the adapter's name (what a request's ``model`` says).
        lora_int_id: its id, unique among the engine's adapters, > 0 (0 means the base model
            in vLLM's counting).
        lora_path: directory in the PEFT format (``adapter_config.json`` +
            ``adapter_model.safetensors``).
        base_model_name: the model it adapts (``/v1/models`` lists it as the parent); None =
            the served model.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
