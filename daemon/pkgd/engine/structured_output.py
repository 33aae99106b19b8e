"""Structured outputs in the engine core: compiled grammars, per-request matchers, bitmasks.

vLLM v1's shape (``vllm/v1/structured_output/``): this `StructuredOutputManager` sits beside
the `Scheduler` in the engine-core process, the runner only applies the bitmask it is handed.
Why there:

* the matcher must advance with every *accepted* token, and only the scheduler knows which
  sampled tokens are kept (stop rules, aborts, preemption); the runner may run on other TP
  ranks or another device and never holds `Request` objects;
* compiled grammars are shared by every request with the same constraint (``n > 1``
  children, repeated schemas), so they are cached once per engine, not per runner rank;
* the bitmask is filled on the host, which is where xgrammar fills it; the runner copies it
  to the logits' device and applies it before sampling (CPU and CUDA alike).

Compilation runs on a background thread, never on the step path: a request whose grammar is
not compiled yet waits outside the scheduler (`EngineCore` keeps it) while every other
request keeps stepping. Compiled grammars live in a bounded LRU cache keyed by the
constraint (`StructuredOutputsParams.key`). The tokenizer information xgrammar needs is
built from the model's tokenizer files on the compile thread, on first use, so an engine
that never sees a constraint never pays for it.

Preemption needs no rollback: a preempted request keeps its output tokens (recompute), and
its matcher has accepted exactly those tokens, so it resumes where it was.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pkgd import log
from pkgd.sampling_params import StructuredOutputsParams, build_grammar, constraint_error

if TYPE_CHECKING:
    from pkgd.engine.request import Request
    from pkgd.scheduler_output import SchedulerOutput

logger = log.get_logger(__name__)

# Distinct constraints kept compiled. A compiled JSON-schema grammar for a 49k vocabulary
# takes tens to hundreds of KiB, so 256 stay well under 100 MiB.
MAX_CACHED_GRAMMARS = 256


class StructuredOutputRequest:
    """One request's constraint: the compiled grammar (a future) and, once it is ready, the
    matcher that has accepted every output token so far."""

    def __init__(self, params: StructuredOutputsParams, future: concurrent.futures.Future) -> None:
        self.params = params
        self.future = future
        self.matcher: Any = None

    def ready(self) -> bool:
        return self.future.done()

    def error(self) -> str | None:
        """Why the constraint could not be compiled, None when it compiled (or is compiling)."""
        if not self.future.done() or self.future.exception() is None:
            return None
        return constraint_error(self.future.exception())  # type: ignore[arg-type]

    def start(self, xgr: Any, output_token_ids: list[int]) -> None:
        """Create the matcher and accept tokens generated before it existed (none, except
        after an engine-side restart of the request)."""
        self.matcher = xgr.GrammarMatcher(self.future.result())
        for tok in output_token_ids:
            self.matcher.accept_token(tok)

    def accept(self, token_id: int) -> bool:
        """Advance the matcher by one accepted token; False when the grammar rejects it."""
        return bool(self.matcher.accept_token(token_id))

    def num_acceptable(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts in a row (a speculative proposal is
        cut there); the matcher is rolled back, so its state does not change."""
        n = 0
        for tok in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output is done."""
        return bool(self.matcher.is_terminated())


class StructuredOutputManager:
    """Compiles constraints off the step path and fills each step's token bitmask.

    Args:
        tokenizer_dir: directory with the model's ``tokenizer.json``, or a ``.gguf`` file
            (``model.tokenizer``); None: constraints are refused, the engine has no tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's size).
        stop_token_ids: the model's EOS ids; a complete grammar allows only these.
        max_cached: compiled grammars kept (LRU).
    """

    def __init__(
        self,
        tokenizer_dir: str | os.PathLike[str] | None,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        *,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_cached = max_cached
        self.bitmask_width = -(-vocab_size // 32)  # int32 words per row
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._xgr: Any = None
        self._bitmask: np.ndarray | None = None
        self.num_queries = 0  # constraints looked up
        self.num_hits = 0  # ... found compiled or compiling

    # ---- compiling ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Attach the request's compiled grammar (a cache hit) or start compiling it.

        Raises:
            ValueError: the engine has no tokenizer, or the constraint's shape is invalid.
        """
        assert request.sampling_params is not None  # only sampling requests carry a constraint
        so = request.sampling_params.structured_outputs
        if so is None:
            return
        if self.tokenizer_dir is None:
            raise ValueError("structured outputs need the model's tokenizer, and this engine has none")
        so.verify()
        key = so.key()
        self.num_queries += 1
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self.num_hits += 1
            self._cache.move_to_end(key)
        else:
            future = self._submit(so)
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        request.structured_output = StructuredOutputRequest(so, future)

    def _submit(self, so: StructuredOutputsParams) -> concurrent.futures.Future:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pkgd-grammar")
        return self._executor.submit(self._compile, so)

    def _compile(self, so: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        return compiler.compile_grammar(build_grammar(self._xgr, so))

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                path = Path(self.tokenizer_dir)  # type: ignore[arg-type]
                if path.is_file() and path.suffix == ".gguf":  # model.tokenizer may name one
                    tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
                else:
                    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
                info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids) or None
                )
                threads = max(1, (os.cpu_count() or 2) // 2)
                # Our LRU is the cache (bounded by count, keyed by the constraint).
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
                self._xgr = xgr
                logger.info(
                    "grammar_compiler_ready", vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids)
                )
            return self._compiler

    def start_matcher(self, request: Request) -> None:
        """Create the matcher of a request whose grammar compiled (before it is scheduled)."""
        so = request.structured_output
        if so is not None and so.matcher is None:
            so.start(self._xgr, request.output_token_ids)

    @staticmethod
    def wait_any(requests: list[Request], timeout: float) -> None:
        """Block up to ``timeout`` seconds until one of these requests' grammars is ready."""
        futures = [r.structured_output.future for r in requests if r.structured_output is not None]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- each step ------------------------------------------------------------------------

    def fill_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Set ``scheduler_output.grammar_bitmask`` for the constrained requests that sample
        this step (those whose known tokens are all computed once this step runs).

        The bitmask is int32 ``[rows, ceil(vocab_size / 32)]`` (bit ``t % 32`` of word
        ``t // 32`` set = token ``t`` allowed), sent as bytes; ``structured_output_request_ids``
        maps each request id to its row. Rows where every token is allowed are left out,
        except for a speculating request: it gets one row per verified position (the matcher
        advanced over its proposed tokens one by one, then rolled back), consecutive from its
        row.
        """
        sampling = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.structured_output is None:
                continue
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that does not reach the end: nothing is sampled
            sampling.append(request)
        if not sampling:
            return
        drafts = scheduler_output.scheduled_spec_decode_tokens
        bitmask = self._rows(len(sampling) + sum(len(drafts.get(r.request_id, ())) for r in sampling))
        rows: dict[str, int] = {}
        used = 0
        for request in sampling:
            matcher = request.structured_output.matcher
            draft = drafts.get(request.request_id)
            if not draft:
                if matcher.fill_next_token_bitmask(bitmask, used):
                    rows[request.request_id] = used
                    used += 1
                continue
            rows[request.request_id] = used
            for j, tok in enumerate(draft):
                matcher.fill_next_token_bitmask(bitmask, used + j)
                matcher.accept_token(tok)  # accepted: the scheduler cut the proposal to what the grammar takes
            matcher.fill_next_token_bitmask(bitmask, used + len(draft))
            matcher.rollback(len(draft))
            used += 1 + len(draft)
        if rows:
            scheduler_output.structured_output_request_ids = rows
            scheduler_output.grammar_bitmask = bitmask[:used].tobytes()

    def _rows(self, n: int) -> np.ndarray:
        if self._bitmask is None or self._bitmask.shape[0] < n:
            size = max(n, 2 * (self._bitmask.shape[0] if self._bitmask is not None else 8))
            self._bitmask = np.full((size, self.bitmask_width), -1, dtype=np.int32)
        return self._bitmask

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
