"""``/v1/embeddings`` request and response bodies (OpenAI's, with vLLM's extras).

Shapes follow ``openai.types.create_embedding_response``; ``encoding_format: base64`` is the
little-endian float32 bytes of each vector, base64-encoded (what the official client asks for
by default and decodes with numpy).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pkgd.api.protocol import INT64_MAX, INT64_MIN, KnownFieldsModel, TokenId

# Token ids first, tried left to right (as `pkgd.api.protocol.Prompt`: a smart union validates
# a long token-id list against every member). Integers are bounded to int64, the wire's range.
EmbeddingInput = Annotated[list[TokenId] | str | list[str] | list[list[TokenId]], Field(union_mode="left_to_right")]


class EmbeddingRequest(KnownFieldsModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    user: str | None = None
    # vLLM extras
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)

    @model_validator(mode="after")
    def _not_empty(self) -> EmbeddingRequest:
        check_input(self.input)
        return self

    def inputs(self) -> list[str | list[int]]:
        """One prompt per embedding: text, or token ids."""
        return input_list(self.input)


def check_input(x: str | list) -> None:
    """Raise `ValueError` for an empty input list, or an empty string or token list in it."""
    if isinstance(x, str):
        return
    if not x:
        raise ValueError("input must not be empty")
    if isinstance(x[0], list | str) and any(not item for item in x):
        raise ValueError("input must not contain an empty string or an empty token list")


def input_list(x: str | list) -> list[str | list[int]]:
    """An ``input`` (`EmbeddingInput`) as one prompt per output: text, or token ids."""
    if isinstance(x, str):
        return [x]
    if all(isinstance(t, int) for t in x):
        return [list(x)]
    return list(x)
