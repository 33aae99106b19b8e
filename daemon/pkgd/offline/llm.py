"""`LLM`: offline batch inference on an in-process `EngineCore` (vLLM's ``vllm.LLM``).

    from pkgd import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM()                                  # the embedded SmolLM2-135M-Instruct
    llm = LLM("/models/Qwen3-0.6B", max_model_len=4096, num_blocks=512)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    llm.generate(["A person:"], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))

    emb = LLM(runner="pooling")                  # an embedding model (vLLM's --runner pooling)
    print(len(emb.embed(["Hello"])[0].outputs.embedding))   # 576: SmolLM2's hidden size

All requests go to the engine at once, so they are batched continuously; outputs come back
in input order. The frontend half is the same `InputProcessor` / `OutputProcessor` the API
servers use. Offline there is no API process to leave a core for, so the engine uses every
core unless ``parallel.cpu_threads`` says otherwise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import msgspec

from pkgd import host, log
from pkgd.config.vllm_config import VllmConfig
from pkgd.engine.core import EngineCore, RunnerFactory
from pkgd.frontend.input_processor import ChatMessage, InputProcessor, ProcessedRequest
from pkgd.frontend.output_processor import OutputProcessor
from pkgd.frontend.pooling import activate, cosine, pair_index, pooling_request_output
from pkgd.frontend.structured_outputs import check as check_constraint
from pkgd.frontend.tokenizer import load_tokenizer
from pkgd.ipc.messages import EngineCoreRequest
from pkgd.lora_request import LoRARequest
from pkgd.offline.beam_search import BeamSearchOutput, beam_search
from pkgd.offline.llm_config import build_llm_config
from pkgd.offline.progress import ProgressBar, UseTqdm
from pkgd.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pkgd.pooling_params import PoolingParams
from pkgd.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = str | Sequence[int] | dict[str, Any]


class LLM:
    """An offline engine.

    Args:
        model: ``model.source`` (HF directory, ``.gguf`` file or ``pkg:`` reference); None =
            the config's (by default the embedded SmolLM2-135M-Instruct).
        config: a whole `VllmConfig` to start from.
        runner_factory: how the model is loaded (tests pass a fake); default the real runner.
        **kwargs: config overrides by field name, vLLM keyword or dotted path
            (``max_model_len=2048``, ``tensor_parallel_size=1``, ``**{"cache.num_blocks": 64}``).

    Raises:
        TypeError: an unknown keyword (with a did-you-mean).
        ValueError: an invalid value (dotted path and reason), or a KV cache too small.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: VllmConfig | None = None,
        runner_factory: RunnerFactory | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = build_llm_config(model, config=config, **kwargs)
        host.set_torch_huge_pages(self.config.parallel.cpu_huge_pages)  # if torch has not allocated yet
        log.ensure_configured(role="offline")  # start-up lines (model_phase …) on stderr
        self.engine = EngineCore(self.config, runner_factory=runner_factory)
        self.tokenizer = _load_tokenizer(self.config, self.engine.model_files)
        self.input_processor = InputProcessor(
            self.tokenizer,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,
            eos_token_id=self.engine.eos_token_id,
            max_logprobs=self.config.frontend.limits.max_logprobs,
            hidden_size=self.engine.hidden_size or None,
            matryoshka=self.engine.matryoshka,
            matryoshka_dimensions=self.engine.matryoshka_dimensions,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The model's tokenizer (transformers ``PreTrainedTokenizerFast``), or None."""
        return self.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """`SamplingParams` with ``model.generation`` defaults applied, over those of
        ``model.generation_config`` (the model's generation_config.json by default)."""
        from pkgd.model_files.generation import generation_defaults

        model_dir = getattr(self.engine.model_files, "model_dir", None)
        fields = generation_defaults(self.config.model.generation_config, model_dir) if model_dir else {}
        fields.update((k, v) for k, v in self.config.model.generation.model_dump().items() if v is not None)
        return SamplingParams(**fields)

    # ---- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt; returns one finished `RequestOutput` per prompt, in order.

        A prompt is a string, a list of token ids, or a dict with ``prompt`` or
        ``prompt_token_ids`` (vLLM's TextPrompt / TokensPrompt). ``sampling_params`` is one
        for all or one per prompt. ``use_tqdm``: True shows a progress bar for a batch of
        several prompts still running after 2 s, False none, a callable makes the bar (as
        ``tqdm``; see `pkgd.offline.progress`). Raises `ValueError` for bad input before
        anything runs; with several prompts the message starts with the index of the bad one
        (``prompt 3: ...``). ``lora_request``: the LoRA adapter of every prompt, or a list with
        one per prompt (None = the base model); needs ``enable_lora=True``. The engine loads
        an adapter on first use (a bad one is a `ValueError` naming the problem).
        """
        prompt_list = _as_prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompt_list))
        loras = _loras_per_prompt(lora_request, len(prompt_list))
        prios = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(prios) != len(prompt_list):
            raise ValueError(f"{len(prios)} priorities for {len(prompt_list)} prompts")
        processed = []
        for i, (p, sp, pr) in enumerate(zip(prompt_list, params, prios, strict=True)):
            try:
                processed.append(self.input_processor.process(self.next_request_id(), _prompt_of(p), sp, priority=pr))
                if loras[i] is not None:
                    last = processed[-1]
                    last.engine_requests = [
                        msgspec.structs.replace(r, lora_request=loras[i]) for r in last.engine_requests
                    ]
            except ValueError as exc:
                if len(prompt_list) == 1:
                    raise
                raise ValueError(f"prompt {i}: {exc}") from None
        return self.run_processed(processed, use_tqdm)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: UseTqdm = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of
        them, through the model's chat template; one `RequestOutput` per conversation."""
        # one conversation when its first item is a message, else a list of conversations
        conversations = cast(
            "list[Sequence[dict[str, Any]]]",
            [messages] if messages and isinstance(messages[0], dict) else list(messages),
        )
        params = self._params_per_prompt(sampling_params, len(conversations))
        kw: dict[str, Any] = dict(
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        processed = []
        for i, (conv, sp) in enumerate(zip(conversations, params, strict=True)):
            try:
                processed.append(self.input_processor.process_chat(self.next_request_id(), conv, sp, **kw))
            except ValueError as exc:
                if len(conversations) == 1:
                    raise
                raise ValueError(f"conversation {i}: {exc}") from None
        return self.run_processed(processed, use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt (see `pkgd.offline.beam_search`); sequences best first,
        with ``text`` decoded from prompt and generated tokens, as vLLM returns them."""
        token_prompts = []
        for p in _as_prompt_list(prompts):
            prompt = _prompt_of(p)
            probe = SamplingParams(max_tokens=params.max_tokens)  # checks prompt + max_tokens fit
            token_prompts.append(self.input_processor.process("beam", prompt, probe).prompt_token_ids)

        def next_token_logprobs(seqs: list[list[int]], k: int) -> list[dict[int, Logprob]]:
            sp = SamplingParams(
                max_tokens=1,
                logprobs=k,
                temperature=params.temperature,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            proc = InputProcessor(
                self.tokenizer,
                max_model_len=self.engine.max_model_len,
                vocab_size=self.engine.vocab_size,
                eos_token_id=self.engine.eos_token_id,
                max_logprobs=max(k, 1),
            )
            outs = self.run_processed([proc.process(self.next_request_id(), s, sp) for s in seqs], use_tqdm=False)
            firsts = []
            for o in outs:
                lps = o.outputs[0].logprobs
                assert lps is not None  # asked for: logprobs=k
                firsts.append(lps[0])
            return firsts

        tok = self.tokenizer
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
        return beam_search(
            token_prompts,
            params,
            next_token_logprobs,
            eos_token_id=self.engine.eos_token_id,
            max_model_len=self.engine.max_model_len,
            decode=decode,
        )

    # ---- pooling (model.runner: pooling) ----------------------------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt's hidden states (``model.pooler``); one `PoolingRequestOutput`
        per prompt, in order, whose ``outputs.data`` is a float32 ``torch.Tensor [D]``.

        Prompts are as for `generate`; ``pooling_params`` one for all or one per prompt.
        Raises `ValueError` (nothing runs) for bad input or when the model is not served
        with ``model.runner: pooling``.
        """
        if self.engine.runner_type != "pooling":
            raise ValueError(
                "LLM.encode/embed need a pooling model: LLM(..., runner='pooling') (vLLM's --runner pooling)"
            )
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params = list(pooling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"{len(params)} pooling params for {len(prompt_list)} prompts")
        processed = [
            self.input_processor.process_pooling(
                self.next_request_id(), _prompt_of(p), pp, truncate_prompt_tokens=truncate_prompt_tokens
            )
            for p, pp in zip(prompt_list, params, strict=True)
        ]
        return self._run_pooling(processed, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[EmbeddingRequestOutput]:
        """`encode` as lists of floats: ``outputs.embedding`` per prompt (vLLM's ``embed``)."""
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_activation: bool = True,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[ClassificationRequestOutput]:
        """Label probabilities of a sequence classifier, one per prompt (vLLM's ``classify``):
        softmax of the logits (sigmoid for one label); ``use_activation=False``: the logits.
        Raises `ValueError` when the model is not a classifier."""
        if not self.engine.labels:
            raise ValueError("LLM.classify needs a sequence classifier (a *ForSequenceClassification model)")
        outs = self.encode(prompts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        return [
            ClassificationRequestOutput(
                request_id=o.request_id,
                outputs=ClassificationOutput(_activated(o.outputs.data.numpy(), use_activation).tolist()),
                prompt_token_ids=o.prompt_token_ids,
                num_cached_tokens=o.num_cached_tokens,
            )
            for o in outs
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        use_activation: bool = True,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[ScoringRequestOutput]:
        """Relevance of text pairs (vLLM's ``score``), one output per text of ``data_2``,
        paired with the one text of ``data_1`` or pairwise: a one-label classifier's sigmoid
        (cross-encoder; ``use_activation=False``: its logit, each pair tokenized as a text
        pair), else the cosine similarity of the two embeddings (bi-encoder).

        Raises:
            ValueError: mismatched or empty sides, a classifier with more than one label, or a
                model not served for pooling.
        """
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        pairs = pair_index(len(first), len(second))
        labels = self.engine.labels
        if labels:
            if len(labels) != 1:
                raise ValueError(f"LLM.score needs a classifier with one label; this one has {len(labels)}")
            ip = self.input_processor
            join = ip.tokenize_pair if self.engine.use_sep_token else (lambda a, b: ip.tokenize(a + b))
            tokens = [join(first[j], b) for j, b in zip(pairs, second, strict=True)]
            outs = self.encode(tokens, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
            scores = [float(_activated(o.outputs.data.numpy(), use_activation)[0]) for o in outs]
            second_outs = outs
        else:
            outs = self.encode(
                [*first, *second],
                PoolingParams(normalize=True),
                truncate_prompt_tokens=truncate_prompt_tokens,
                use_tqdm=use_tqdm,
            )
            a, second_outs = outs[: len(first)], outs[len(first) :]
            scores = [cosine(a[j].outputs.data.numpy(), b.outputs.data.numpy()) for j, b in zip(pairs, second_outs)]
        return [
            ScoringRequestOutput(request_id=o.request_id, outputs=ScoringOutput(s), prompt_token_ids=o.prompt_token_ids)
            for o, s in zip(second_outs, scores, strict=True)
        ]

    def _run_pooling(self, processed: list[ProcessedRequest], use_tqdm: UseTqdm) -> list[PoolingRequestOutput]:
        import torch

        by_id = {p.request_id: (i, p) for i, p in enumerate(processed)}
        results: list[PoolingRequestOutput | None] = [None] * len(processed)
        added: list[str] = []
        try:
            for p in processed:
                self.engine.add_request(p.engine_requests[0])
                added.append(p.request_id)
            with ProgressBar(len(processed), use_tqdm=use_tqdm) as bar:
                remaining = len(processed)
                while remaining:
                    if not self.engine.has_unfinished_requests():
                        raise RuntimeError("the engine finished while requests were still open")
                    for out in self.engine.step():
                        if out.pooling_output is None or out.request_id not in by_id:
                            continue
                        i, p = by_id[out.request_id]
                        ro = pooling_request_output(p, out)
                        ro.outputs.data = torch.from_numpy(ro.outputs.data.copy())
                        results[i] = ro
                        remaining -= 1
                        bar.update(ro)
        except BaseException:
            self.engine.abort_requests(added)
            raise
        return results  # type: ignore[return-value]

    # ---- sleep mode (model.enable_sleep_mode) -----------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache and weights' memory until `wake_up` (`EngineCore.sleep`)."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` released (``tags``: ``"weights"``, ``"kv_cache"``; default both)."""
        self.engine.wake_up(tags)

    # ---- the loop ---------------------------------------------------------------------------

    def run_processed(self, processed: list[ProcessedRequest], use_tqdm: UseTqdm = True) -> list[RequestOutput]:
        """Run requests built by ``self.input_processor`` (ids unique among live requests) to
        completion; finished `RequestOutput`s in the same order. On any error or interrupt
        every request of this call is aborted before the exception propagates."""
        order = {p.request_id: i for i, p in enumerate(processed)}
        results: list[RequestOutput | None] = [None] * len(processed)
        added: list[str] = []
        try:
            for p in processed:
                assert p.sampling_params is not None  # generate requests
                p.sampling_params = msgspec.structs.replace(p.sampling_params, output_kind=RequestOutputKind.FINAL_ONLY)
                p.engine_requests = [_final_only(r) for r in p.engine_requests]
                self.output_processor.add_request(p)
                added.append(p.request_id)
                for req in p.engine_requests:
                    self.engine.add_request(req)
            with ProgressBar(len(processed), use_tqdm=use_tqdm) as bar:
                remaining = len(processed)
                while remaining:
                    if not self.engine.has_unfinished_requests():
                        raise RuntimeError("the engine finished while requests were still open")
                    result = self.output_processor.process_outputs(self.engine.step())
                    failed = self.engine.pop_failed_requests()
                    if failed:
                        raise ValueError(f"request {failed[0][0]}: {failed[0][1]}")
                    if result.reqs_to_abort:
                        self.engine.abort_requests(result.reqs_to_abort)
                    for ro in result.request_outputs:
                        if ro.finished and ro.request_id in order:
                            results[order[ro.request_id]] = ro
                            remaining -= 1
                            bar.update(ro)
        except BaseException:
            self.engine.abort_requests(self.output_processor.abort_requests(added))
            raise
        return results  # type: ignore[return-value]

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        """One `SamplingParams` per prompt; structured-output constraints are checked here,
        so a bad one is a `ValueError` ("structured_outputs: reason") before anything runs."""
        if sampling_params is None:
            return [self.default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        else:
            params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts")
        for sp in {id(p): p for p in params}.values():
            if sp.structured_outputs is not None:
                check_constraint(sp.structured_outputs, max_bytes=self.config.frontend.limits.max_constraint_bytes)
        return params

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def shutdown(self) -> None:
        """Abort whatever runs and release the engine."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _load_tokenizer(config: VllmConfig, model_files: Any):
    """The tokenizer from the resolved files (``tokenizer_dir`` honours ``model.tokenizer``);
    None when the model directory has none and ``model.tokenizer`` is unset (token-id prompts
    only, like vLLM's ``skip_tokenizer_init``)."""
    m = config.model
    tokenizer_dir = getattr(model_files, "tokenizer_dir", None)
    if tokenizer_dir is not None:
        if m.tokenizer is None and not (Path(tokenizer_dir) / "tokenizer.json").is_file():
            return None
        return load_tokenizer(tokenizer_dir, chat_template=m.chat_template)
    model_dir = getattr(model_files, "model_dir", None)
    if model_dir is None and m.tokenizer is None:
        return None
    return load_tokenizer(model_dir, tokenizer=m.tokenizer, chat_template=m.chat_template)


def _final_only(req: EngineCoreRequest) -> EngineCoreRequest:
    assert req.sampling_params is not None  # generate requests
    sp = msgspec.structs.replace(req.sampling_params, output_kind=RequestOutputKind.FINAL_ONLY)
    return msgspec.structs.replace(req, sampling_params=sp)


def _activated(logits, use_activation: bool):
    return activate(logits) if use_activation else logits


def _loras_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, as vLLM's ``generate`` takes them."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"{len(loras)} lora requests for {n} prompts")
    return loras


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and isinstance(items[0], int):
        return [items]  # one prompt of token ids
    return items


def _prompt_of(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt
    return [int(t) for t in prompt]
