"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``
and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``.

They exist only with ``frontend.allow_runtime_lora_updating`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; read per request, else 404 as an unknown route) and need
the API key like every route but the open ones (`pkgd.api.app`). The engine core owns the
adapters (`pkgd.engine.lora`): it reads and checks the files and answers 400 naming the
problem (missing files, rank above ``lora.max_lora_rank``, a target or shape the model does
not have), nothing loaded; an unknown name to unload is 404. This server's copy of the
registry (`ServerState.loras`) follows each success, so the adapter is listed in
``/v1/models`` and selectable by ``model`` at once; answers are vLLM's plain-text lines.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import PlainTextResponse

from pkgd.api.errors import APIError, require_json
from pkgd.api.preprocess import decode_body
from pkgd.api.routes_admin import _ERRORS, _not_found, _state, _utility
from pkgd.api.state import ServerState
from pkgd.lora_request import LoRARequest

router = APIRouter()


def _runtime(request: Request) -> ServerState:
    state = _state(request)
    if not state.config.frontend.allow_runtime_lora_updating:
        raise _not_found(request)
    return state


async def _body(request: Request, state: ServerState, *keys: str) -> dict[str, Any]:
    data = decode_body(await request.body(), state.config.frontend.limits)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key in keys:
        value = data.get(key)
        if not isinstance(value, str) or not value:
            raise APIError(
                400, f"{' and '.join(repr(k) for k in keys)} must be provided ({key!r} is missing)", param=key
            )
    return data


@router.post("/v1/load_lora_adapter", tags=["lora"], responses=_ERRORS, dependencies=[Depends(require_json)])
async def load_lora_adapter(request: Request) -> Any:
    """Load a LoRA adapter (PEFT format) and serve it under ``lora_name``."""
    state = _runtime(request)
    if not state.config.lora.enable_lora:
        raise APIError(400, "LoRA adapters are not enabled: start the engine with lora.enable_lora (--enable-lora)")
    data = await _body(request, state, "lora_name", "lora_path")
    name = data["lora_name"]
    if name in state.served_model_names():
        raise APIError(400, f"the name {name!r} is the base model's", param="lora_name")
    (result, *_) = await _utility(state, "add_lora", {"lora_name": name, "lora_path": data["lora_path"]})
    state.loras[name] = LoRARequest(result["lora_name"], result["lora_int_id"], result["lora_path"])
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", tags=["lora"], responses=_ERRORS, dependencies=[Depends(require_json)])
async def unload_lora_adapter(request: Request) -> Any:
    """Stop serving the adapter ``lora_name`` (requests already running with it finish)."""
    state = _runtime(request)
    data = await _body(request, state, "lora_name")
    name = data["lora_name"]
    await _utility(state, "remove_lora", {"lora_name": name})
    state.loras.pop(name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
