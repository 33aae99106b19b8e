"""`ServerState`: what the routes of one API-server process share.

The config is replaced as a whole when the supervisor's SIGHUP brings new *live* fields (API
keys, CORS, served model names, log level, generation defaults); routes read
``state.config`` per request, so a reload takes effect on the next request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pkgd.api.errors import APIError
from pkgd.api.preprocess import Preprocessor
from pkgd.api.responses_store import ResponseStore
from pkgd.frontend.structured_outputs import ConstraintValidator
from pkgd.lora_request import LoRARequest
from pkgd.parsers import load_parser

if TYPE_CHECKING:
    from pkgd.config.vllm_config import VllmConfig
    from pkgd.frontend.async_llm import AsyncLLM
    from pkgd.frontend.metrics import Metrics


class ServerState:
    def __init__(self, config: VllmConfig, llm: AsyncLLM, metrics: Metrics | None, *, server_index: int = 0) -> None:
        self.config = config
        self.llm = llm
        self.metrics = metrics
        self.engine_collector: Any = None  # the engine cores' /metrics series (frontend.metrics)
        self.server_index = server_index
        self.draining = False
        f = config.frontend
        self.preprocess = Preprocessor(
            f.preprocess_threads, process_min_bytes=f.preprocess_process_min_bytes, tokenizer=self._tokenizer
        )
        # parser classes; they share no base class (their extract()s differ in what they return)
        self.tool_parser: type[Any] | None = load_parser("tool", f.tool_call_parser) if f.tool_call_parser else None
        self.reasoning_parser: type[Any] | None = (
            load_parser("reasoning", f.reasoning_parser) if f.reasoning_parser else None
        )
        self.responses = ResponseStore(f.responses_store_size)  # /v1/responses with store: true
        self.constraints = ConstraintValidator()  # structured-output checks, off the event loop
        # LoRA adapters served, by name: a copy of the engine core's registry (which owns it),
        # taken at start-up (`sync_loras`) and kept by this server's load/unload calls.
        self.loras: dict[str, LoRARequest] = {}

    def _tokenizer(self) -> Any:
        ip = self.llm.input_processor
        return ip.tokenizer if ip is not None else None

    # ---- models ----------------------------------------------------------------------------

    def served_model_names(self) -> list[str]:
        """Names clients may use: ``frontend.served_model_names``, else the model's name."""
        names = list(self.config.frontend.served_model_names)
        if names:
            return names
        if self.config.model.name:
            return [self.config.model.name]
        hs = self.llm.handshake
        return [hs.model_name] if hs is not None else [self.config.model.source]

    def resolve_model(self, name: str | None) -> str:
        """The served name a request asked for (the first one when it gave none). With no
        name set (``frontend.served_model_names``, ``model.name``), ``model.source`` as given
        is accepted too and answered under that name: vLLM serves the ``--model`` value itself
        by default, so a vLLM client sends the path it launched with.

        Raises:
            APIError: 404 for a name that is not served.
        """
        names = self.served_model_names()
        if name is None or name in names:
            return name or names[0]
        if name in self.loras:
            return name
        if (
            name == self.config.model.source
            and not self.config.frontend.served_model_names
            and not self.config.model.name
        ):
            return name
        served = [*names, *self.loras]
        raise APIError(
            404,
            f"the model {name!r} does not exist; served: {', '.join(served)}",
            param="model",
            code="model_not_found",
        )

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a resolved model name selects, None for the base model."""
        return self.loras.get(model) if model is not None else None

    async def sync_loras(self) -> None:
        """Take the engine core's adapters (it owns the registry, so a new API generation
        after a reload knows the adapters loaded at run time). Nothing when LoRA is off."""
        if not self.config.lora.enable_lora:
            return
        results = await self.llm.client.call_utility("list_loras")
        found: list[dict] = next((r.result for r in results if r.error is None and r.result is not None), [])
        self.loras = {d["lora_name"]: LoRARequest(**d) for d in found}

    # ---- readiness -------------------------------------------------------------------------

    def check_ready(self) -> None:
        """Raise a 503 while no engine core is available.

        Draining does not refuse work: a request that still reaches a draining server (on a
        keep-alive connection opened before) is served, with ``Connection: close`` so the
        client's next request goes to another API server; only ``/health`` says 503.
        """
        if not self.llm.is_ready():
            raise APIError(503, "no engine core is available (starting or restarting); retry shortly")

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.draining:
            return 503, {"status": "draining"}
        if not self.llm.is_ready():
            return 503, {"status": "no engine core available"}
        return 200, {"status": "ok"}
