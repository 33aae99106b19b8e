"""``model.batch_invariant`` in the runner: a seeded request's tokens and logprobs are the same
bits alone (whole prompt in one step) and among other requests with its prompt in chunks of
one and three tokens, on both CPU paths, in bf16 (where the kernels' shapes show most)."""

from __future__ import annotations

import pytest
import torch
from tests.runner.driver import Driver
from tests.runner.factory import make_runner

from pkgd.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # four runners per CPU path
SEEDED = SamplingParams(temperature=1.0, seed=5, max_tokens=8, logprobs=0, ignore_eos=True)
OTHER = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)


def _run(model_dir, prompt, companions, chunk):
    d = Driver(make_runner(model_dir, dtype="bfloat16", batch_invariant=True), num_blocks=128, block_size=4)
    d.add("t", prompt, SEEDED)
    for i, p in enumerate(companions):
        d.add(f"o{i}", p, OTHER)
    d.run(chunk)
    r = d.reqs["t"]
    return r.outputs, [e.logprobs[0] for e in r.logprobs]


@pytest.mark.usefixtures("cpu_path")
def test_a_token_is_the_same_bits_whatever_the_batch_and_the_chunking(tiny_dirs):
    model_dir, _ = tiny_dirs("llama")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 160, (21,), generator=g).tolist()
    others = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (2, 9, 30)]
    alone = _run(model_dir, prompt, [], None)
    assert len(alone[0]) == 8
    assert _run(model_dir, prompt, others, 3) == alone
    assert _run(model_dir, prompt, others[:1], 1) == alone
