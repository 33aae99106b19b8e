"""The progress bar of `LLM.generate` (tqdm), with vLLM's throughput estimate.

``use_tqdm`` as in vLLM: False never shows a bar; a callable is called like ``tqdm(total=…,
desc=…, dynamic_ncols=True, postfix=…)`` and its bar shown from the start (the caller chose
it); True, the default, shows tqdm's bar only where one helps: for a batch of more than one
prompt that is still running after `DELAY_S` seconds (tqdm's ``delay``). A quick call, or a
call with one prompt (whose bar could only jump from 0 to 1), prints nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pkgd.outputs import PoolingRequestOutput, RequestOutput

DELAY_S = 2.0  # a default bar appears once its batch has run this long

UseTqdm = bool | Callable[..., Any]


class ProgressBar:
    """Counts finished prompts and shows input/output tokens per second so far.

    A no-op when no bar is wanted (see the module docstring); usable as a context manager.
    """

    def __init__(self, total: int, *, use_tqdm: UseTqdm) -> None:
        self._bar = None
        self._start = time.perf_counter()
        self._in = 0
        self._out = 0
        kwargs: dict[str, Any] = dict(
            total=total,
            desc="Processed prompts",
            dynamic_ncols=True,
            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s",
        )
        if callable(use_tqdm):
            self._bar = use_tqdm(**kwargs)
        elif use_tqdm and total > 1:
            from tqdm.auto import tqdm

            self._bar = tqdm(delay=DELAY_S, **kwargs)

    def update(self, ro: RequestOutput | PoolingRequestOutput) -> None:
        if self._bar is None:
            return
        self._in += len(ro.prompt_token_ids)
        if isinstance(ro, RequestOutput):
            self._out += sum(len(c.token_ids) for c in ro.outputs)
        dt = max(time.perf_counter() - self._start, 1e-9)
        self._bar.postfix = f"est. speed input: {self._in / dt:.2f} toks/s, output: {self._out / dt:.2f} toks/s"
        self._bar.update(1)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
