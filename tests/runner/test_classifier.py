"""Sequence classifiers (`pkgd.runner.models.classifier`): pkgd's logits match transformers'
``*ForSequenceClassification`` on tiny random Llama / Qwen3 checkpoints (fp32, <= 1e-4), and a
causal LM served by the Qwen3-Reranker convention scores ``logit(yes) - logit(no)`` at the
last position; through the offline `LLM` and its engine (chunked prefill, batching)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from tests.runner.tiny_classifiers import LABELS, build_classifier, write_word_tokenizer
from tests.runner.tiny_models import build_tiny

from pkgd import LLM

TOL = 1e-4
_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
LENGTHS = [1, 6, 19, 11]


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in LENGTHS]


def _llm(model_dir, **kw) -> LLM:
    opts = {"num_blocks": 64, "max_num_seqs": 3, "max_num_batched_tokens": 8, **kw}
    return LLM(str(model_dir), runner="pooling", dtype="float32", block_size=4, **opts)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_logits_match_transformers(tmp_path, arch, num_labels, cpu_path):
    hf = build_classifier(arch, tmp_path, num_labels)
    llm = _llm(tmp_path)
    assert llm.engine.labels == (list(LABELS.values()) if num_labels == 3 else ["LABEL_0"])
    assert llm.engine.use_sep_token
    prompts = _prompts()
    for tokens, out in zip(prompts, llm.encode(prompts, use_tqdm=False), strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([tokens])).logits[0]
        got = out.outputs.data
        assert got.shape == (num_labels,)
        assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_qwen3_reranker_convention_scores_yes_against_no(tmp_path, arch):
    """A causal LM with model.hf_overrides as vLLM's Qwen3-Reranker recipe: one output,
    ``logit(yes) - logit(no)`` of the causal LM at the last position, whose sigmoid is the
    two-way softmax's P(yes). Qwen3's tiny model ties its LM head to the embedding (the rows
    come from ``embed_tokens``), Qwen2's does not (from ``lm_head``, which is then dropped)."""
    hf = build_tiny(arch, tmp_path)
    write_word_tokenizer(tmp_path)
    overrides = {**_RERANKER, "architectures": [f"{arch.capitalize()}ForSequenceClassification"]}
    llm = _llm(tmp_path, **{f"model.hf_overrides.{k}": v for k, v in overrides.items()})
    if arch == "qwen2":
        assert llm.engine.model_runner.model.lm_head is None
    prompts = _prompts(1)
    for tokens, out in zip(prompts, llm.encode(prompts, use_tqdm=False), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1]
        assert out.outputs.data.shape == (1,)
        assert abs(out.outputs.data[0].item() - (logits[11] - logits[7]).item()) <= TOL
        p_yes = torch.softmax(logits[[7, 11]], dim=0)[1]
        assert abs(torch.sigmoid(out.outputs.data[0]).item() - p_yes.item()) <= 1e-5


def test_convert_classify_reads_the_score_head_from_a_causal_lm_dir(tmp_path):
    """``model.convert: classify`` serves the directory's ``*ForCausalLM`` as its classifier:
    the ``score`` tensor must be in the checkpoint; a missing one is a clear error."""
    hf = build_classifier("llama", tmp_path, 2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = _llm(tmp_path, convert="classify")
    tokens = _prompts()[2]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    assert (llm.encode([tokens], use_tqdm=False)[0].outputs.data - want).abs().max() <= TOL
    lm_dir = tmp_path / "lm"
    build_tiny("llama", lm_dir)
    with pytest.raises(ValueError, match=r"score\.weight"):
        _llm(lm_dir, convert="classify")


def test_bad_classifier_configs_are_refused(tmp_path):
    build_tiny("qwen3", tmp_path)
    write_word_tokenizer(tmp_path)
    base = {"model.hf_overrides.architectures": ["Qwen3ForSequenceClassification"]}
    with pytest.raises(ValueError, match="not one token"):
        _llm(tmp_path, **base, **{"model.hf_overrides.classifier_from_token": ["no", "maybe"]})
    with pytest.raises(ValueError, match=r"\[no, yes\]"):
        _llm(
            tmp_path,
            **base,
            **{
                "model.hf_overrides.classifier_from_token": ["yes"],
                "model.hf_overrides.is_original_qwen3_reranker": True,
            },
        )
    with pytest.raises(ValueError, match="model.runner: generate"):
        LLM(str(tmp_path), runner="generate", dtype="float32", num_blocks=64, **base)


def test_offline_score_and_classify(tmp_path):
    """`LLM.score` (cross-encoder: each pair tokenized as a text pair, the word tokenizer's
    being the two texts' tokens in a row) and `LLM.classify` (softmax / sigmoid of the logits)."""
    hf = build_tiny("qwen3", tmp_path)
    words = write_word_tokenizer(tmp_path)
    overrides = {f"model.hf_overrides.{k}": v for k, v in _RERANKER.items()}
    llm = _llm(tmp_path, **overrides)
    query, docs = "w3 w5 w9", ["w20 w21", "yes no w40", "w2"]
    outs = llm.score(query, docs, use_tqdm=False)
    for doc, out in zip(docs, outs, strict=True):
        ids = [words.index(w) for w in f"{query} {doc}".split()]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        assert abs(out.outputs.score - torch.softmax(logits[[7, 11]], dim=0)[1].item()) <= 1e-5
    pairwise = llm.score(docs, list(reversed(docs)), use_tqdm=False)
    assert len(pairwise) == 3
    raw = llm.classify([query], use_activation=False, use_tqdm=False)[0]
    prob = llm.classify([query], use_tqdm=False)[0]
    assert prob.outputs.num_classes == 1
    assert abs(prob.outputs.probs[0] - torch.sigmoid(torch.tensor(raw.outputs.probs[0])).item()) <= 1e-6
    with pytest.raises(ValueError, match="as many"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="must not be empty"):
        llm.score("a", [], use_tqdm=False)
    # use_sep_token false: the two texts joined, then tokenized ("w9" + "w20 ..." is one unknown word)
    joined = _llm(tmp_path, **overrides, **{"model.hf_overrides.use_sep_token": False})
    out = joined.score(query, docs[:1], use_tqdm=False)[0]
    assert out.prompt_token_ids == [words.index("w3"), words.index("w5"), 0, words.index("w21")]


def test_offline_bi_encoder_score_is_the_cosine(tmp_path):
    hf = build_tiny("llama", tmp_path)
    words = write_word_tokenizer(tmp_path)
    llm = _llm(tmp_path)
    with pytest.raises(ValueError, match="classifier"):
        llm.classify(["w1"], use_tqdm=False)

    def vec(text: str) -> torch.Tensor:
        with torch.no_grad():
            return hf.model(torch.tensor([[words.index(w) for w in text.split()]])).last_hidden_state[0, -1]

    outs = llm.score(["w1 w2", "w3"], ["w4 w5 w6", "w12 w8"], use_tqdm=False)
    want = [
        F.cosine_similarity(vec("w1 w2"), vec("w4 w5 w6"), dim=0),
        F.cosine_similarity(vec("w3"), vec("w12 w8"), dim=0),
    ]
    assert max(abs(o.outputs.score - w.item()) for o, w in zip(outs, want)) <= TOL
