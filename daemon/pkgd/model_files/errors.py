"""The one error of model-source resolution, apart so the converter and the resolver share it."""


class ModelSourceError(Exception):
    """``model.source`` (or ``model.tokenizer``) cannot be used; the message names the path."""
