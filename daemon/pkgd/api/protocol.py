"""OpenAI request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests validate ranges here, so a bad value is a 400 naming the field before anything
reaches the engine (limits that depend on the config, such as ``frontend.limits.max_logprobs`` and
``model.max_model_len``, are checked when the request is converted). An unknown top-level
field of a completion, chat, embeddings or responses request is a 400 naming it (OpenAI's "Unrecognized request
argument"), so nothing a client asks for is silently ignored; unknown fields inside nested
objects (messages, tools) are ignored. Responses mirror the shapes the official ``openai`` client
parses (``openai.types.completion``, ``openai.types.chat``).

Every integer a request carries is bounded to int64 (``INT64``), the range of the engine's
wire format: a larger JSON integer is a 400 naming the field, never an encoding failure (500)
on the way to the engine. Token ids are checked against the vocabulary by the input processor.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]

# ---- shared ---------------------------------------------------------------------------


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (vLLM)


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's ``structured_outputs`` object: exactly one constraint (see
    `pkgd.sampling_params.StructuredOutputsParams`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class KnownFieldsModel(OpenAIModel):
    """A request body whose unknown top-level fields are a 400 naming them."""

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = [k for k in data if k not in known]
            if unknown:
                more = f" (also: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
                raise ValueError(f"{unknown[0]}: unrecognized request argument, pkgd does not implement it{more}")
        return data


class SamplingFields(KnownFieldsModel):
    """Fields both completion endpoints share (OpenAI's, then vLLM's extras)."""

    @model_validator(mode="after")
    def _stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        if self.use_beam_search:
            raise ValueError("use_beam_search: beam search is not served over HTTP; use LLM.beam_search offline")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream: true (as in vLLM)")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ValueError(f"modalities: pkgd generates text only, got {self.modalities}")
        return self

    model: str | None = None
    n: int = Field(1, ge=1, le=INT64_MAX)  # frontend.limits.max_n is the real bound
    prediction: Prediction | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    # OpenAI fields that do not change the output: accepted, logged once as ignored
    # (`pkgd.api.request_fields`); ``user`` is also put on the request's log lines.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=INT64_MAX)
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)  # -1: the last max_model_len
    # visible ASCII: it also goes out as the X-Request-Id header
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool = False

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionTokensDetails(BaseModel):
    """OpenAI's ``usage.completion_tokens_details`` for Predicted Outputs: proposed prediction
    tokens that speculative verification accepted / rejected (`pkgd.engine.spec_decode`)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _drop_empty_details(self, handler: Any) -> Any:
        """``completion_tokens_details`` only when a prediction was given (as OpenAI's
        fields appear only for the features a request used)."""
        data = handler(self)
        if isinstance(data, dict) and data.get("completion_tokens_details") is None:
            data.pop("completion_tokens_details", None)
        return data


class PredictionContentPart(OpenAIModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Prediction(OpenAIModel):
    """OpenAI Predicted Outputs: text the output is expected to mostly repeat; pkgd proposes
    it as the request's speculative draft (the output is what it would be without it)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | list[PredictionContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---- /v1/completions --------------------------------------------------------------------

# Token ids first, tried left to right: pydantic's default "smart" union validates a long
# token-id list against every member (60x the time of list[int] alone, in one call that holds
# the GIL). Token ids are range-checked by the input processor.
Prompt = Annotated[list[int] | str | list[str] | list[list[int]], Field(union_mode="left_to_right")]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)  # 0 only with echo: score the prompt
    logprobs: int | None = Field(None, ge=0, le=INT64_MAX)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=INT64_MAX)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, int) for x in p)):
            pass
        elif not p or any(not x for x in p):
            raise ValueError("prompt must not be empty")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo: true (scoring the prompt)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: text, or token ids, one per completion batch entry."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):  # validated: a list of one kind (a whole pass would be slow)
            return [list(p)]
        return list(p)  # type: ignore[arg-type]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One candidate at a prompt position (vLLM's ``Logprob``): natural log, rank 1 = most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first is null: nothing predicts it): token id (as a JSON key) ->
# `PromptLogprob`, the prompt's own token first, then the top ``prompt_logprobs``.
PromptLogprobsList = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"message content part of type {part.type!r} is not supported (text only)")
                parts.append(part.text)
            content = "".join(parts)
        msg: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
                for tc in self.tool_calls
            ]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(OpenAIModel):
    """``response_format.json_schema``: OpenAI's ``{name, description, schema, strict}``."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # false: properties the schema does not list are allowed


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT64_MAX)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # a template kwarg
    # vLLM extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the chat template writes
    documents: list[dict[str, str]] | None = None  # a template kwarg (retrieval-augmented templates)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobsContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any) -> dict[str, Any]:
        # A call's later deltas are {"index", "function": {"arguments"}} as OpenAI sends them:
        # an explicit "type": null would overwrite the call's type in clients that merge
        # deltas key by key (the openai SDK's stream helpers fail on it).
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- tokenize / detokenize / models ------------------------------------------------------


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pkgd"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
