"""LoRA parity: a tiny random base and random adapters made with ``peft``, served in one mixed
batch (base prompts and prompts of two adapters), against transformers + peft: the greedy
tokens equal, and the log-probabilities of every prompt and output token (the logits seen
through log_softmax) within float32 tolerance, unmerged and merged (``merge_and_unload``)."""

from __future__ import annotations

import pytest
import torch
from tests.runner.lora_adapters import greedy, logprobs_of, make_adapter

from pkgd import LLM, LoRARequest, SamplingParams

N_OUT = 6
PROMPTS = [list(range(3, 14)), list(range(20, 29)), [5, 9, 2, 7, 11, 40, 41], list(range(50, 66)), [7, 8], [9, 3, 4]]
# prompt i runs with adapter ADAPTER_OF[i]: None = base model
ADAPTER_OF = [None, "a", "b", "a", None, "b"]
TOL = dict(atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.runner.tiny_models import build_tiny

    root = tmp_path_factory.mktemp("lora")
    hf = build_tiny("qwen2", root / "base")  # Q/K/V biases: the update adds to a biased output
    refs = {
        None: hf,
        "a": make_adapter(hf, root / "a", r=8, alpha=16, seed=1),
        "b": make_adapter(hf, root / "b", r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=2, rslora=True),
    }
    return root, refs


def _run(root, **kw):
    llm = LLM(
        str(root / "base"), dtype="float32", num_blocks=128, block_size=4, max_model_len=128,
        enable_lora=True, max_loras=2, max_lora_rank=8, **kw,
    )  # fmt: skip
    loras = {None: None, "a": LoRARequest("a", 1, str(root / "a")), "b": LoRARequest("b", 2, str(root / "b"))}
    params = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    return llm, llm.generate(PROMPTS, params, lora_request=[loras[a] for a in ADAPTER_OF], use_tqdm=False)


def _check(outs, refs):
    for prompt, name, out in zip(PROMPTS, ADAPTER_OF, outs, strict=True):
        ref = refs[name]
        tokens = out.outputs[0].token_ids
        assert list(tokens) == greedy(ref, prompt, N_OUT), f"adapter {name}"
        seq = prompt + list(tokens)
        want = logprobs_of(ref, seq)
        got_prompt = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        got_out = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(got_prompt + got_out), want, **TOL, msg=f"adapter {name}")


def test_mixed_batch_matches_peft_unmerged_and_merged(setup):
    root, refs = setup
    llm, outs = _run(root)
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3  # the adapters change the outputs
    _check(outs, refs)
    merged = {name: (m.merge_and_unload() if name else m) for name, m in refs.items()}
    _check(outs, merged)
    llm.shutdown()


def test_more_adapters_than_slots_wait_and_finish(setup):
    """max_loras=1: requests of the second adapter wait until the first's are done; every
    output is still the reference's (a slot reloaded in between)."""
    root, refs = setup
    llm = LLM(
        str(root / "base"), dtype="float32", num_blocks=128, block_size=4, max_model_len=128,
        enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
    )  # fmt: skip
    loras = {None: None, "a": LoRARequest("a", 1, str(root / "a")), "b": LoRARequest("b", 2, str(root / "b"))}
    params = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, lora_request=[loras[a] for a in ADAPTER_OF], use_tqdm=False)
    for prompt, name, out in zip(PROMPTS, ADAPTER_OF, outs, strict=True):
        assert list(out.outputs[0].token_ids) == greedy(refs[name], prompt, N_OUT)
    llm.shutdown()


def test_prefix_cache_never_shares_blocks_across_adapters(setup):
    """The same prompt under the base model, then adapter a, then the base again: the second
    run must not reuse the base's cached KV (its tokens would be the base's)."""
    root, refs = setup
    llm = LLM(
        str(root / "base"), dtype="float32", num_blocks=128, block_size=4, max_model_len=128,
        enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    a = LoRARequest("a", 1, str(root / "a"))
    prompt = PROMPTS[3]
    params = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)
    for lora, ref in ((None, refs[None]), (a, refs["a"]), (None, refs[None]), (a, refs["a"])):
        (out,) = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == greedy(ref, prompt, N_OUT)
    llm.shutdown()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda hf, d: make_adapter(hf, d, r=16), "rank 16 .* greater than lora.max_lora_rank 8"),
        (lambda hf, d: d.mkdir(), "adapter_config.json is missing"),
    ],
)
def test_bad_adapter_is_a_clear_error_and_the_engine_keeps_serving(setup, tmp_path, make, match):
    root, refs = setup
    make(refs[None], tmp_path / "bad")
    llm = LLM(
        str(root / "base"), dtype="float32", num_blocks=64, block_size=4, max_model_len=128,
        enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("bad", 7, str(tmp_path / "bad")), use_tqdm=False)
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == greedy(refs[None], PROMPTS[0], 2)
    llm.shutdown()


FAMILY_TARGETS = {
    "llama": None,  # all of q/k/v/o/gate/up/down
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # Phi-3's own fused modules
    "gemma2": ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],  # attention only: MoE experts take none
}


@pytest.mark.parametrize("arch", sorted(FAMILY_TARGETS))
def test_families_match_peft(arch, tiny_dirs, tmp_path):
    model_dir, hf = tiny_dirs(arch)
    ref = make_adapter(hf, tmp_path / "a", r=8, targets=FAMILY_TARGETS[arch], seed=3)
    llm = LLM(
        str(model_dir), dtype="float32", num_blocks=128, block_size=4, max_model_len=128,
        enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    params = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS[:3], params, lora_request=[lora, None, lora], use_tqdm=False)
    for prompt, out, model in zip(PROMPTS[:3], outs, (ref, hf, ref), strict=True):
        tokens = list(out.outputs[0].token_ids)
        assert tokens == greedy(model, prompt, N_OUT)
        got = torch.tensor([d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)])
        torch.testing.assert_close(got, logprobs_of(model, prompt + tokens)[len(prompt) - 1 :], **TOL)
    llm.shutdown()


@pytest.mark.slow  # builds the C kernels for the quantized path (~40 s on 2 cores)
def test_adapter_over_quantized_gguf_weights(tiny_dirs, tmp_path):
    """GGUF Q8_0 weights kept quantized: the update adds to the quantized layers' outputs;
    the log-probabilities stay within Q8_0's error of transformers + peft on the float
    weights, and the adapter's effect (its difference from the base) is the reference's."""
    from tests.runner.tiny_gguf import write_gguf

    _, hf = tiny_dirs("llama-plain")  # default RoPE: what the GGUF describes exactly
    ref = make_adapter(hf, tmp_path / "a", r=8, seed=4, scale=0.1)
    path = write_gguf(hf, tmp_path / "tiny.Q8_0.gguf", quantize=True)
    llm = LLM(
        str(path), quantization="gguf", num_blocks=128, block_size=4, max_model_len=128,
        cache_dir=str(tmp_path / "cache"),
        enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    assert llm.engine.model_runner.model_info.quantization.startswith("gguf:")
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with_a, base = llm.generate([prompt, prompt], params, lora_request=[lora, None], use_tqdm=False)

    def lps(out):
        return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])

    want_a, want_base = logprobs_of(ref, prompt), logprobs_of(hf, prompt)
    torch.testing.assert_close(lps(with_a), want_a, atol=0.05, rtol=0)  # Q8_0 here: ~0.02
    assert (want_a - want_base).abs().max() > 0.5  # the adapter matters at this scale
    torch.testing.assert_close(lps(with_a) - lps(base), want_a - want_base, atol=0.05, rtol=0)
    llm.shutdown()


def test_adapters_with_speculative_decoding_keep_peft_greedy_tokens(setup):
    """n-gram speculation over a mixed batch of base and adapter requests: a speculating
    request is 1 + k attention sequences, but its adapter covers all its tokens (the token map
    once counted sequences, and the engine core crashed on the first proposal)."""
    root, refs = setup
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 20, 21, 20, 21, 20], [9, 3, 9, 3, 9, 3, 9]]
    adapters = ["a", None, "b"]
    llm = LLM(
        str(root / "base"), dtype="float32", num_blocks=128, block_size=4, max_model_len=128,
        enable_lora=True, max_loras=2, max_lora_rank=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )  # fmt: skip
    loras = {None: None, "a": LoRARequest("a", 1, str(root / "a")), "b": LoRARequest("b", 2, str(root / "b"))}
    params = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=[loras[a] for a in adapters], use_tqdm=False)
    assert llm.engine.scheduler.speculator.stats.num_drafts > 0  # proposals were verified
    for prompt, name, out in zip(prompts, adapters, outs, strict=True):
        assert list(out.outputs[0].token_ids) == greedy(refs[name], prompt, N_OUT), f"adapter {name}"
    llm.shutdown()
