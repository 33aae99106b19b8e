"""The families beyond Llama/Qwen (Mistral, Phi-3, Gemma 2, Gemma 3 text, and Mixtral with a sliding
window) against transformers,
on tiny random-weight checkpoints (`tests.runner.tiny_models`), in float32 and bfloat16.

Each case runs three prompts as one batch through the paged cache: a short one and two longer
than the family's sliding window (8 tokens, where it has one), whole or in chunks of 7
(chunked prefill, mixed with the other requests' decodes), then 8 greedy tokens. The tokens
must equal transformers' ``generate`` (greedy) on the same weights in the same dtype (up to
a near-tie: where the two differ, transformers' logits of the two tokens must lie within 2 x
`TOL`, and the comparison of that request ends there, its texts diverging), and
every sampled position's logits must lie within `TOL` of the logits ``generate`` chose from
(its own prefill, then decode steps over its KV cache: the reference for LongRoPE too, whose
rotation transformers picks by the length of each forward). A prefix-cache hit (a request whose first blocks another
request computed) must give the same last logits as transformers.

Tolerances: float32 1e-4 (summation order only; measured <= 1e-5). bfloat16 0.1 absolute on
logits of magnitude <= 3: both sides round every matmul output and norm to 8 significant bits,
in different orders (measured max 0.03 for Mistral and Phi-3, 0.05 for Gemma 2 and 3, about
what transformers' own bfloat16 differs from its float32 by). Greedy texts in bfloat16 may
part at a near-tie, which is why a flip is allowed where transformers' own two logits lie
within 2 x `TOL` (then that request's comparison ends).
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.runner.driver import Driver
from tests.runner.factory import LogitsRecorder, make_runner

from pkgd.sampling_params import SamplingParams

ARCHES = ["mistral", "phi3", "phi3-longrope", "gemma2", "gemma3", "mixtral-window"]
WINDOWED = ["mistral", "phi3", "gemma2", "gemma3", "mixtral-window"]  # families whose tiny config has a sliding window
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-4, "bfloat16": 0.1}
NEW_TOKENS = 8
PROMPT_LENS = (5, 19, 30)


def _prompt(seed: int, n: int, vocab: int = 160) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf_in_dtype():
    """(arch, dtype name) -> the transformers model in that dtype (one copy per pair)."""
    cache: dict = {}

    def get(hf, arch: str, dtype: str):
        if (arch, dtype) not in cache:
            cache[arch, dtype] = hf if dtype == "float32" else copy.deepcopy(hf).to(DTYPES[dtype])
        return cache[arch, dtype]

    return get


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _hf_generate(hf, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the logits of each step (float32)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            eos_token_id=None, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in out.logits]


def _run_batch(runner, prompts: dict[str, list[int]], chunk: int | None) -> dict[str, list[torch.Tensor]]:
    """Run every prompt together to NEW_TOKENS greedy tokens; each request's logits rows."""
    rec = LogitsRecorder(runner)
    drv = Driver(runner, num_blocks=64, block_size=4)
    for rid, p in prompts.items():
        drv.add(rid, p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    rows: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    while not all(r.done for r in drv.reqs.values()):
        n0 = len(rec.calls)
        out = drv.step(chunk=chunk)
        sampled = [rid for rid, toks in zip(out.req_ids, out.sampled_token_ids) if toks]
        if sampled:
            assert len(rec.calls) == n0 + 1
            for i, rid in enumerate(sampled):
                rows[rid].append(rec.calls[-1][i])
    return {rid: (drv.reqs[rid].outputs, rows[rid]) for rid in prompts}


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prompt", "chunked-prefill"])
def test_greedy_batch_matches_transformers_generate(tiny_dirs, hf_in_dtype, arch, dtype, chunk, cpu_path):
    """On both CPU paths: with the C kernels (C decode attention where no window cuts) and
    PyTorch's forms only."""
    model_dir, hf32 = tiny_dirs(arch)
    hf = hf_in_dtype(hf32, arch, dtype)
    runner = make_runner(model_dir, dtype=dtype)
    assert (runner.cpu_kernels is not None) == (cpu_path is not None)
    prompts = {f"p{n}": _prompt(n, n) for n in PROMPT_LENS}
    results = _run_batch(runner, prompts, chunk)
    worst = 0.0
    for rid, prompt in prompts.items():
        outputs, rows = results[rid]
        want_tokens, want_logits = _hf_generate(hf, prompt)
        assert len(rows) == NEW_TOKENS
        for j, (ours, want) in enumerate(zip(rows, want_logits)):
            worst = max(worst, (ours - want).abs().max().item())
            if outputs[j] != want_tokens[j]:  # only a near-tie may flip; the texts differ after it
                margin = (want[want_tokens[j]] - want[outputs[j]]).item()
                assert margin <= 2 * TOL[dtype], f"{rid} step {j}: {outputs} != {want_tokens}"
                break
    assert worst <= TOL[dtype]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefix_cache_hit_matches_transformers(tiny_dirs, hf_in_dtype, arch, dtype):
    """b reuses a's first 12 tokens (3 blocks) and computes its 7 new ones only; its window
    then reaches back into the shared blocks."""
    from pkgd.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    model_dir, hf32 = tiny_dirs(arch)
    hf = hf_in_dtype(hf32, arch, dtype)
    runner = make_runner(model_dir, dtype=dtype)
    rec = LogitsRecorder(runner)
    runner.initialize_kv_cache(16, 4)
    prefix = _prompt(4, 12)
    a, b = prefix + _prompt(5, 3), prefix + _prompt(6, 7)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    so = SchedulerOutput(
        [NewRequestData("a", a, [], sp, [0, 1, 2, 3], 0)], CachedRequestData(), {"a": len(a)}, len(a), set()
    )
    runner.execute_model(so)
    so = SchedulerOutput([NewRequestData("b", b, [], sp, [0, 1, 2, 5, 6], 12)], CachedRequestData(), {"b": 7}, 7, {"a"})
    out = runner.execute_model(so)
    want = _hf_logits(hf, b)[-1]
    assert (rec.calls[-1][0] - want).abs().max().item() <= TOL[dtype]
    assert out.sampled_token_ids == [[int(want.argmax())]]


@pytest.mark.parametrize("arch", WINDOWED)
def test_the_window_is_exercised(tiny_dirs, arch):
    """With every layer's window switched off the same run no longer matches transformers:
    the prompts above do cross the window, and the parity tests depend on it."""
    model_dir, hf = tiny_dirs(arch)
    runner = make_runner(model_dir)
    assert any(layer.self_attn.sliding_window == 8 for layer in runner.model.layers)
    for layer in runner.model.layers:
        layer.self_attn.sliding_window = 0
    prompt = _prompt(30, 30)
    outputs, rows = _run_batch(runner, {"a": prompt}, None)["a"]
    want = _hf_logits(hf, prompt + outputs[:-1])[len(prompt) - 1]
    assert (rows[0] - want).abs().max().item() > 100 * TOL["float32"]


def test_longrope_table_matches_transformers_rotary(tiny_dirs):
    """Phi-3's LongRoPE: the cos/sin of each position equal transformers' for a forward ending
    at that position, short factors below original_max_position_embeddings (64), long ones
    past it, both times the attention factor."""
    model_dir, hf = tiny_dirs("phi3-longrope")
    table = make_runner(model_dir).model.rotary_emb.cos_sin_cache
    half = table.shape[1] // 2
    for pos in (0, 5, 63, 64, 100, 255):
        cos, sin = hf.model.rotary_emb(torch.zeros(1, 1, 64), torch.tensor([[pos]]))
        torch.testing.assert_close(table[pos, :half], cos[0, 0, :half], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(table[pos, half:], sin[0, 0, :half], atol=1e-6, rtol=1e-6)
