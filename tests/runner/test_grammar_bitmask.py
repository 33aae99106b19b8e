"""The runner's grammar mask: only the constrained rows change, disallowed tokens get -inf."""

import numpy as np
import pytest
import torch

from pkgd.runner.grammar_bitmask import apply_grammar_bitmask
from pkgd.scheduler_output import CachedRequestData, SchedulerOutput

VOCAB = 70  # not a multiple of 32: the last word is partial


def step(rows: dict[str, list[int]]) -> SchedulerOutput:
    words = -(-VOCAB // 32)
    mask = np.zeros((len(rows), words), dtype=np.int32)
    for r, allowed in enumerate(rows.values()):
        for t in allowed:
            mask[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    so = SchedulerOutput([], CachedRequestData(), {}, 0, set())
    so.structured_output_request_ids = {rid: i for i, rid in enumerate(rows)}
    so.grammar_bitmask = mask.tobytes()
    return so


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_only_constrained_rows_are_masked(device):
    logits = torch.randn(3, VOCAB, device=device)
    before = logits.clone()
    apply_grammar_bitmask(logits, ["free", "a", "b"], step({"b": [0, 31, 69], "a": [5]}))
    assert torch.equal(logits[0], before[0])
    for row, allowed in ((1, [5]), (2, [0, 31, 69])):
        kept = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert kept == allowed and torch.equal(logits[row, allowed], before[row, allowed])


def test_no_rows_no_change():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    apply_grammar_bitmask(logits, ["x", "y"], SchedulerOutput([], CachedRequestData(), {}, 0, set()))
    assert torch.equal(logits, before)
