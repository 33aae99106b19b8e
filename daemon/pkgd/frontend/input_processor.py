"""`InputProcessor`: prompts and chat messages → `EngineCoreRequest`s (frontend side, torch-free).

Used by the API servers' ``AsyncLLM`` and by the offline `LLM`. It tokenizes (plain prompts
with the tokenizer's special tokens; chat messages rendered with the chat template and then
tokenized without adding any), checks the request against the engine's limits, fills
``max_tokens`` when unset, and fans out ``n > 1`` into child requests that share the prompt
(vLLM's ``ParentRequest``: child ``i`` is ``"{i}_{request_id}"`` with ``n = 1`` and, when a seed
is given, seed ``seed + i``).

Errors are `ValueError`s with a message fit for a 400 response; nothing is sent when one is
raised.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import msgspec

from pkgd.ipc.messages import EngineCoreRequest
from pkgd.pooling_params import PoolingParams
from pkgd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ChatMessage = dict[str, Any]


@dataclasses.dataclass
class ProcessedRequest:
    """One client request, ready for the engine and the `OutputProcessor`.

    ``engine_requests`` has one entry per completion: the request itself when ``n == 1``,
    else ``n`` children. ``sampling_params`` is the client's with ``max_tokens`` filled in;
    a pooling request has ``pooling_params`` instead (and one engine request).
    ``arrival_time`` is Unix time in seconds.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    engine_requests: list[EngineCoreRequest]
    arrival_time: float
    pooling_params: PoolingParams | None = None


@dataclasses.dataclass(frozen=True)
class TokenizedPrompt:
    """A text prompt and its token ids, tokenized elsewhere (an API server's preprocessing
    process) with the same tokenizer and options (`InputProcessor.tokenize_prompt`).

    ``token_ids`` is None when the prompt's ``num_tokens`` leave no room to generate within
    ``max_model_len``: such a prompt is refused, so its ids are not sent back.
    """

    text: str
    token_ids: list[int] | None
    num_tokens: int


def child_request_id(request_id: str, index: int) -> str:
    """Engine-side id of completion ``index`` of an ``n > 1`` request (vLLM's scheme)."""
    return f"{index}_{request_id}"


class InputProcessor:
    """Turns client input into engine requests.

    Args:
        tokenizer: the model's fast tokenizer (`pkgd.frontend.tokenizer.load_tokenizer`); None
            accepts token-id prompts only.
        max_model_len: the engine's effective context length, tokens.
        vocab_size: token ids must be below it (None: the tokenizer's size).
        eos_token_id: the engine's EOS (the handshake's); None: the tokenizer's.
        max_logprobs: the largest ``logprobs`` / ``prompt_logprobs`` a request may ask for.
        hidden_size, matryoshka, matryoshka_dimensions: a pooling model's vector size and
            which ``dimensions`` it accepts (the handshake's); None skips the check.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast | None,
        *,
        max_model_len: int,
        vocab_size: int | None = None,
        eos_token_id: int | None = None,
        max_logprobs: int = 20,
        hidden_size: int | None = None,
        matryoshka: bool = False,
        matryoshka_dimensions: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size if vocab_size is not None else (len(tokenizer) if tokenizer is not None else None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
        self.eos_token_id = eos_token_id
        self.max_logprobs = max_logprobs
        self.hidden_size = hidden_size
        self.matryoshka = matryoshka
        self.matryoshka_dimensions = matryoshka_dimensions

    # ---- text → tokens ---------------------------------------------------------------------

    def _need_tokenizer(self) -> PreTrainedTokenizerFast:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: give prompt token ids instead of text")
        return self.tokenizer

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With a fast tokenizer this calls the ``tokenizers`` library's
        batch encoder without character offsets (``encode_batch_fast``, where the library has
        it), which releases the GIL while it works: its single-text ``encode`` holds it
        throughout (seconds for a long prompt, during which an API server's event loop would
        stand still), and ``encode_batch`` holds it while it builds the offsets (tens of ms
        per long prompt). The ids are the same."""
        tok = self._need_tokenizer()
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None and not getattr(tok, "split_special_tokens", False):
            encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
            return encode([text], add_special_tokens=add_special_tokens)[0].ids
        return list(tok.encode(text, add_special_tokens=add_special_tokens))

    def tokenize_pair(self, first: str, second: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text pair as the tokenizer joins one (its pair template: separator or
        BOS tokens where it has them, else the two texts' tokens one after the other): what a
        cross-encoder scores (vLLM's ``tokenizer(text=..., text_pair=...)``). As `tokenize`,
        without holding the GIL where the library allows."""
        tok = self._need_tokenizer()
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None and not getattr(tok, "split_special_tokens", False):
            encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
            return encode([(first, second)], add_special_tokens=add_special_tokens)[0].ids
        return list(tok(first, second, add_special_tokens=add_special_tokens)["input_ids"])

    def tokenize_prompt(
        self, text: str, *, add_special_tokens: bool = True, truncate_prompt_tokens: int | None = None
    ) -> TokenizedPrompt:
        """`tokenize` as a `TokenizedPrompt` for `process`, without the ids when there are
        ``max_model_len`` or more (the prompt cannot be served); ``truncate_prompt_tokens``
        as `process` takes it. Raises `ValueError` for a bad ``truncate_prompt_tokens``."""
        ids = self.tokenize(text, add_special_tokens=add_special_tokens)
        num_tokens = len(ids)
        ids = self.truncate(ids, truncate_prompt_tokens)
        return TokenizedPrompt(text, ids if len(ids) < self.max_model_len else None, num_tokens)

    def truncate(self, token_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last ``truncate_prompt_tokens`` of ``token_ids`` (vLLM's; -1 = the last
        ``max_model_len``; None = all). Raises `ValueError` for a value below -1, 0, or one
        above ``max_model_len``."""
        if truncate_prompt_tokens is None:
            return token_ids
        keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate_prompt_tokens}")
        if keep > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens: {keep} is more than max_model_len {self.max_model_len}; "
                "choose a smaller truncation size"
            )
        return token_ids[-keep:]

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """The token sequences of ``bad_words`` (vLLM's rule): each word (leading whitespace
        stripped) tokenized alone, and after a space when that makes the same number of
        tokens starting with another one (the word in the middle of a text, for tokenizers
        that fold the space into the word's first token)."""
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenize(word.lstrip(), add_special_tokens=False)
            if not plain:
                continue
            out.append(plain)
            spaced = self.tokenize(" " + word.lstrip(), add_special_tokens=False)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                out.append(spaced)
        return out

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, str]] | None = None,
    ) -> str:
        """The prompt text of a conversation under the chat template (jinja2, via
        transformers); ``documents`` for retrieval-augmented templates (ignored by a template
        that does not read them). Raises `ValueError` for an empty conversation, a tokenizer
        without template, or a template error."""
        tok = self._need_tokenizer()
        if not messages:
            raise ValueError("messages must not be empty")
        if chat_template is None and not tok.chat_template:
            raise ValueError("the tokenizer has no chat template; set model.chat_template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        try:
            text = tok.apply_chat_template(
                list(messages),
                # transformers annotates a list of dict-or-callable (invariant); these are dicts
                tools=tools,  # type: ignore[arg-type]
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                documents=documents,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 errors, bad message shapes
            raise ValueError(f"cannot apply the chat template: {exc}") from exc
        return cast(str, text)  # tokenize=False: the rendered text

    # ---- requests --------------------------------------------------------------------------

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int] | TokenizedPrompt,
        params: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        prediction: str | None = None,
    ) -> ProcessedRequest:
        """Build the engine request(s) for a text prompt, a list of prompt token ids, or a
        text prompt tokenized already (``add_special_tokens`` and ``truncate_prompt_tokens``
        then as it was tokenized with). ``truncate_prompt_tokens`` keeps the prompt's last
        tokens (`truncate`); a truncated prompt has no text (echo decodes its ids).
        ``prediction``: OpenAI Predicted Outputs' text, tokenized without special tokens and
        sent as the engine's speculative draft source (`pkgd.engine.spec_decode`).

        Raises `ValueError`: invalid sampling parameters, an empty prompt, token ids outside
        the vocabulary (prompt, ``stop_token_ids``, ``logit_bias``, ``allowed_token_ids``,
        ``bad_words``), a bad ``truncate_prompt_tokens``, or ``prompt + max_tokens`` beyond
        ``max_model_len`` (both numbers named).
        """
        params = params if params is not None else SamplingParams()
        if self.vocab_size is not None and params.top_k >= self.vocab_size:
            params = msgspec.structs.replace(params, top_k=0)  # keeps every token, as "off" does
        if params.bad_words and not params.bad_words_token_ids:
            params = msgspec.structs.replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        params.verify(max_logprobs=self.max_logprobs, vocab_size=self.vocab_size)
        if isinstance(prompt, TokenizedPrompt):
            if prompt.token_ids is None:  # too long to have been sent
                raise prompt_too_long(prompt.num_tokens, self.max_model_len)
            token_ids = prompt.token_ids
            text: str | None = prompt.text if len(token_ids) == prompt.num_tokens else None
        elif isinstance(prompt, str):
            token_ids = self.tokenize(prompt, add_special_tokens=add_special_tokens)
            text = prompt
        else:
            text = None
            token_ids = list(map(int, prompt))  # in C (see _check_tokens)
        if truncate_prompt_tokens is not None and not isinstance(prompt, TokenizedPrompt):
            full = len(token_ids)
            token_ids = self.truncate(token_ids, truncate_prompt_tokens)
            text = text if len(token_ids) == full else None
        self._check_prompt(token_ids)
        params = self._fill_max_tokens(params, len(token_ids))
        arrival = time.time() if arrival_time is None else arrival_time
        engine_requests = self._fan_out(request_id, token_ids, params, arrival, priority)
        if prediction:
            predicted = self.tokenize(prediction, add_special_tokens=False)
            for r in engine_requests:
                r.prediction_token_ids = predicted
        return ProcessedRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            sampling_params=params,
            engine_requests=engine_requests,
            arrival_time=arrival,
        )

    def process_chat(
        self,
        request_id: str,
        messages: Sequence[ChatMessage],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = False,
        truncate_prompt_tokens: int | None = None,
        prediction: str | None = None,
        **chat_kwargs: Any,
    ) -> ProcessedRequest:
        """`render_chat` then `process` (the rendered text already holds the template's special
        tokens: ``add_special_tokens`` adds the tokenizer's on top, as vLLM's field does).
        ``chat_kwargs`` go to `render_chat`."""
        text = self.render_chat(messages, **chat_kwargs)
        return self.process(
            request_id,
            text,
            params,
            add_special_tokens=add_special_tokens,
            arrival_time=arrival_time,
            priority=priority,
            truncate_prompt_tokens=truncate_prompt_tokens,
            prediction=prediction,
        )

    def process_pooling(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> ProcessedRequest:
        """Build the engine request of a pooling (embedding) prompt: text or token ids.

        ``truncate_prompt_tokens`` keeps the last k prompt tokens (vLLM's; -1 = the last
        ``max_model_len``). Raises `ValueError`: ``dimensions`` the model does not accept, an
        empty prompt, token ids outside the vocabulary, or a prompt longer than
        ``max_model_len`` (the prompt is the whole request: nothing is generated after it).
        """
        params = params if params is not None else PoolingParams()
        if self.hidden_size:
            params.verify(
                hidden_size=self.hidden_size,
                matryoshka=self.matryoshka,
                matryoshka_dimensions=self.matryoshka_dimensions,
            )
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenize(prompt, add_special_tokens=add_special_tokens)
        else:
            text, token_ids = None, list(map(int, prompt))
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            if keep < 1:
                raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate_prompt_tokens}")
            token_ids = token_ids[-keep:]
        self._check_tokens(token_ids)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the input has {len(token_ids)} tokens, more than max_model_len {self.max_model_len} "
                "(truncate_prompt_tokens shortens it)"
            )
        arrival = time.time() if arrival_time is None else arrival_time
        engine_request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            pooling_params=params,
            arrival_time=arrival,
            priority=priority,
        )
        return ProcessedRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            sampling_params=None,
            engine_requests=[engine_request],
            arrival_time=arrival,
            pooling_params=params,
        )

    def _check_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        # min/max first: passes in C, where a Python loop over a long prompt would hold an API
        # server's event loop off the GIL (see pkgd.api.preprocess)
        if self.vocab_size is not None and not (0 <= min(token_ids) and max(token_ids) < self.vocab_size):
            bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} is out of range [0, {self.vocab_size})")

    def _check_prompt(self, token_ids: list[int]) -> None:
        self._check_tokens(token_ids)
        if len(token_ids) >= self.max_model_len:
            raise prompt_too_long(len(token_ids), self.max_model_len)

    def _fill_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            if params.min_tokens > room:
                raise ValueError(
                    f"min_tokens is {params.min_tokens} but the prompt of {prompt_len} tokens leaves "
                    f"{room} within max_model_len {self.max_model_len}"
                )
            return msgspec.structs.replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise ValueError(
                f"the prompt has {prompt_len} tokens and max_tokens is {params.max_tokens}: "
                f"{prompt_len + params.max_tokens} exceeds max_model_len {self.max_model_len}"
            )
        return params

    def _fan_out(
        self, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float, priority: int
    ) -> list[EngineCoreRequest]:
        def one(rid: str, sp: SamplingParams) -> EngineCoreRequest:
            return EngineCoreRequest(
                request_id=rid,
                prompt_token_ids=token_ids,
                sampling_params=sp,
                eos_token_id=self.eos_token_id,
                arrival_time=arrival,
                priority=priority,
            )

        if params.n == 1:
            return [one(request_id, params)]
        return [
            one(
                child_request_id(request_id, i),
                msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i),
            )
            for i in range(params.n)
        ]


def prompt_too_long(num_tokens: int, max_model_len: int) -> ValueError:
    """The error for a prompt of ``num_tokens`` that leaves no room to generate."""
    return ValueError(
        f"the prompt has {num_tokens} tokens, which leaves no room to generate within max_model_len {max_model_len}"
    )
