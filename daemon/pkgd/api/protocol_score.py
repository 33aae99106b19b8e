"""Request bodies of vLLM's pooling routes beyond embeddings: ``/score``, ``/rerank``,
``/classify`` and ``/pooling`` (field names as vLLM's; the rerank response is the Jina /
Cohere shape vLLM answers with).

Score pairs come in any of vLLM's spellings: ``queries``/``documents``, ``queries``/``items``,
``data_1``/``data_2`` or ``text_1``/``text_2``; the first side is one text (scored against
every text of the second) or as many texts as the second (scored pairwise).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pkgd.api.protocol import INT64_MAX, INT64_MIN, KnownFieldsModel
from pkgd.api.protocol_embeddings import EmbeddingInput, check_input, input_list

ScoreInputs = str | list[str]
_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class _PoolingRequestFields(KnownFieldsModel):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    # vLLM's switch for the classifier's sigmoid / softmax; activation and softmax are its
    # deprecated spellings of the same switch
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def wants_activation(self) -> bool:
        """``use_activation`` (or its older spellings); default true."""
        for v in (self.use_activation, self.activation, self.softmax):
            if v is not None:
                return v
        return True


class ScoreRequest(_PoolingRequestFields):
    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None
    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        given = [
            k
            for k in ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2")
            if getattr(self, k) is not None
        ]
        pairs = [p for p in _PAIRS if set(p) <= set(given)]
        if len(pairs) != 1 or len(given) != 2:
            raise ValueError(
                "give one pair of score inputs: queries and documents, queries and items, data_1 and data_2, "
                f"or text_1 and text_2 (got {', '.join(given) or 'none'})"
            )
        return self

    def pair_names(self) -> tuple[str, str]:
        """The two fields the request gave (``("queries", "documents")``, ...)."""
        return next(p for p in _PAIRS if getattr(self, p[0]) is not None and getattr(self, p[1]) is not None)

    def pair(self) -> tuple[list[str], list[str]]:
        """The two sides as lists (a single text becomes a list of one)."""
        first, second = self.pair_names()
        return _as_list(getattr(self, first)), _as_list(getattr(self, second))


class RerankDocument(KnownFieldsModel):
    text: str


class RerankRequest(_PoolingRequestFields):
    query: str
    documents: list[str | RerankDocument]
    # 0 (vLLM's default) = every document; Cohere and Jina clients send null for that
    top_n: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = 0
    # Jina / Cohere v1: false answers without the document texts
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ClassificationRequest(_PoolingRequestFields):
    input: EmbeddingInput
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _not_empty(self) -> ClassificationRequest:
        check_input(self.input)
        return self

    def inputs(self) -> list[str | list[int]]:
        """One prompt per output: text, or token ids."""
        return input_list(self.input)


class PoolingRequest(ClassificationRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    normalize: bool | None = None


def _as_list(x: ScoreInputs) -> list[str]:
    return [x] if isinstance(x, str) else list(x)
