"""The engine core's refusals that its process loop maps to wire answers (import-light: the
engine-core process imports this before its signal handlers are installed)."""


class EngineSleepingError(RuntimeError):
    """The engine is in sleep mode (`EngineCore.sleep`): it takes no request until woken."""


class EngineBusyError(ValueError):
    """A utility call that needs an idle engine came while requests run (an HTTP 409)."""


class LoRANotFoundError(ValueError):
    """A LoRA adapter name the engine does not serve (an HTTP 404)."""
