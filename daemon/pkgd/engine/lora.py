"""`LoRARegistry`: the adapters an engine serves, by name (the engine core owns them, so every
API server and every API generation that talks to it sees the same set).

Adapters come from ``lora.lora_modules`` at start-up and, when runtime updating is on, from
``POST /v1/load_lora_adapter`` (`EngineCore.add_lora` through a utility call). Each gets the
next integer id (ids are never reused, so a reloaded adapter never meets the KV blocks or the
slot of one unloaded before it). Loading is the runner's: it reads and checks the files
before the name is registered, so a bad adapter changes nothing. Torch-free.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from pkgd.engine.errors import LoRANotFoundError
from pkgd.lora_request import LoRARequest


class LoRARegistry:
    """Names -> `LoRARequest`.

    Args:
        load: checks and loads an adapter (the runner's ``add_lora``); raises ``ValueError``
            naming the problem.
        unload: drops an adapter's host copy and slot by id (the runner's ``remove_lora``).
    """

    def __init__(self, load: Callable[[LoRARequest], object], unload: Callable[[int], object]) -> None:
        self._load, self._unload = load, unload
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load and register an adapter; raises ``ValueError`` (changing nothing) for a name
        already served or an adapter that does not load."""
        if not lora_name or not lora_path:
            raise ValueError("both lora_name and lora_path are required")
        if lora_name in self.adapters:
            raise ValueError(f"The lora adapter '{lora_name}' has already been loaded.")
        used = {r.lora_int_id for r in self.adapters.values()}
        int_id = next(self._ids)
        while int_id in used:  # ids an offline caller chose itself
            int_id = next(self._ids)
        request = LoRARequest(lora_name, int_id, lora_path, base_model_name)
        self._load(request)
        self.adapters[lora_name] = request
        return request

    def remove(self, lora_name: str) -> LoRARequest:
        """Unregister and unload; raises `LoRANotFoundError` for an unknown name. Requests
        already running with it finish (the runner reads it again from its path)."""
        request = self.adapters.pop(lora_name, None)
        if request is None:
            raise LoRANotFoundError(f"The lora adapter '{lora_name}' cannot be found.")
        self._unload(request.lora_int_id)
        return request

    def ensure(self, request: LoRARequest) -> None:
        """An adapter given whole with a request (the offline `LLM`): load it if no adapter of
        that id is registered yet; raises ``ValueError`` when it does not load, or when its
        id is registered under another name or path."""
        for known in self.adapters.values():
            if known.lora_int_id == request.lora_int_id:
                if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                    raise ValueError(
                        f"lora_int_id {request.lora_int_id} is already used by adapter {known.lora_name!r} "
                        f"({known.lora_path}); give each adapter its own id"
                    )
                return
        self._load(request)
        self.adapters[request.lora_name] = request

    def list(self) -> list[dict]:
        return [
            {"lora_name": r.lora_name, "lora_int_id": r.lora_int_id, "lora_path": r.lora_path,
             "base_model_name": r.base_model_name}
            for r in self.adapters.values()
        ]  # fmt: skip
