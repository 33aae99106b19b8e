"""The progress bar of `LLM.generate` (tqdm), with vLLM's throughput estimate."""

from __future__ import annotations

import time

from pkgd.outputs import PoolingRequestOutput, RequestOutput


class ProgressBar:
    """Counts finished prompts and shows input/output tokens per second so far.

    A no-op when ``enabled`` is False; usable as a context manager.
    """

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar = None
        self._start = time.perf_counter()
        self._in = 0
        self._out = 0
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                             postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")

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
