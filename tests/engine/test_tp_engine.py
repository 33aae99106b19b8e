"""EngineCore over tensor parallelism: tp=2 (a real worker process, gloo) = tp=1, token for token."""

import gc

import pytest

pytest.importorskip("pkgd.runner.tp_executor")
torch = pytest.importorskip("torch")

from pkgd import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random-weight Llama with 4 heads / 2 KV heads (SmolLM2's 9 heads do not split in 2)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    return str(out)


def test_tp2_engine_matches_tp1(tiny_llama):
    prompts = [[5, 6, 7, 8, 9], [100, 3, 42], list(range(10, 40))]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    want = []
    with LLM(tiny_llama, num_blocks=64, block_size=4) as one:
        assert one.get_tokenizer() is None  # no tokenizer files: token ids only
        want = [[o.outputs[0].token_ids for o in one.generate(prompts, sp, use_tqdm=False)] for sp in (greedy, seeded)]
    tp2 = LLM(tiny_llama, tensor_parallel_size=2, num_blocks=64, block_size=4)
    try:
        assert tp2.config.parallel.cpu_threads >= 1 and len(tp2.engine.model_runner.workers) == 1
        got = [[o.outputs[0].token_ids for o in tp2.generate(prompts, sp, use_tqdm=False)] for sp in (greedy, seeded)]
        assert got == want
    finally:
        tp2.shutdown()
        gc.collect()
    assert all(w.wait(timeout=60) is not None for w in tp2.engine.model_runner.workers)
