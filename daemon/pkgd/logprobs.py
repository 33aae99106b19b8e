"""`TokenLogprobs`: the logprobs the runner computes at one position.

A seam type: the runner produces it, the scheduler forwards it, it crosses the wire inside
`EngineCoreOutput`, and the frontend turns it into the user-facing `pkgd.outputs.Logprob`
dicts. Imports nothing of pkgd.
"""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: ``token_ids[0]`` is the sampled/prompt token, then top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int
