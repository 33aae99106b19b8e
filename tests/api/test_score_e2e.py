"""Score, rerank, classify and pooling through real engine-core and API-server processes, with
plain HTTP (httpx), on tiny random checkpoints that carry SmolLM2's tokenizer, against
transformers run on the same token ids (fp32 on both sides; scores and probabilities within
1e-5, the float32 rounding of a 2-layer model's logits through a sigmoid or softmax):

* a Qwen3 causal LM served by vLLM's Qwen3-Reranker recipe (``--hf-overrides`` as
  ``model.hf_overrides``): a cross-encoder whose score is P(yes) of the yes/no softmax;
* a three-label ``LlamaForSequenceClassification``: ``/classify`` probabilities and labels;
* a Llama causal LM served as an embedding model: bi-encoder scores (cosine similarity).
"""

from __future__ import annotations

import base64
import shutil
import struct

import httpx
import pytest
import torch
from tests.runner.tiny_classifiers import LABELS, build_classifier
from tests.runner.tiny_models import build_tiny

from pkgd.config.vllm_config import VllmConfig

from .test_serving_e2e import Daemon

pytestmark = pytest.mark.slow
VOCAB = 49152  # SmolLM2's tokenizer
TOL = 1e-5
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris.", "hi"]
RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from pkgd.model_files.resolve import resolve_model

    tok_dir = resolve_model(VllmConfig().model).tokenizer_dir
    return tok_dir, AutoTokenizer.from_pretrained(tok_dir)


def _with_tokenizer(model_dir, tok_dir) -> None:
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, model_dir / f.name)


def _serve(tmp, model_dir, **model) -> Daemon:
    settings = {
        "model": {"source": str(model_dir), "runner": "pooling", "dtype": "float32", "max_model_len": 256, **model},
        "cache": {"num_blocks": 128},
    }
    return Daemon(tmp, config=VllmConfig.model_validate(settings))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, smol_tokenizer):
    d = tmp_path_factory.mktemp("reranker")
    hf = build_tiny("qwen3", d, vocab_size=VOCAB)
    _with_tokenizer(d, smol_tokenizer[0])
    daemon = _serve(tmp_path_factory.mktemp("reranker-run"), d, hf_overrides=RERANKER)
    yield daemon, hf
    daemon.stop()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, smol_tokenizer):
    d = tmp_path_factory.mktemp("classifier")
    hf = build_classifier("llama", d, 3, vocab_size=VOCAB)
    _with_tokenizer(d, smol_tokenizer[0])
    daemon = _serve(tmp_path_factory.mktemp("classifier-run"), d)
    yield daemon, hf
    daemon.stop()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, smol_tokenizer):
    d = tmp_path_factory.mktemp("embedder")
    hf = build_tiny("llama", d, vocab_size=VOCAB)
    _with_tokenizer(d, smol_tokenizer[0])
    daemon = _serve(tmp_path_factory.mktemp("embedder-run"), d)
    yield daemon, hf
    daemon.stop()


def _post(daemon: Daemon, path: str, body: dict) -> httpx.Response:
    return httpx.post(daemon.url + path, json=body, timeout=120)


def _p_yes(hf, ids: list[int], yes: int, no: int) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(logits[[no, yes]], dim=0)[1].item()


def test_qwen3_reranker_scores_and_reranks_as_transformers(reranker, smol_tokenizer):
    daemon, hf = reranker
    tok = smol_tokenizer[1]
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    pairs = [tok(QUERY, d)["input_ids"] for d in DOCS]
    want = [_p_yes(hf, ids, yes, no) for ids in pairs]
    before = daemon.metric("vllm:request_success_total")
    r = _post(daemon, "/v1/score", {"queries": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert max(abs(d["score"] - w) for d, w in zip(body["data"], want)) <= TOL
    assert body["usage"]["prompt_tokens"] == sum(map(len, pairs))
    # every pair is one engine request, counted as the embeddings route's are
    assert daemon.metric("vllm:request_success_total") - before == len(DOCS)
    same = _post(daemon, "/score", {"text_1": [QUERY] * len(DOCS), "text_2": DOCS}).json()
    assert [round(d["score"], 6) for d in same["data"]] == [round(d["score"], 6) for d in body["data"]]
    raw = _post(daemon, "/v1/score", {"text_1": QUERY, "text_2": DOCS[0], "use_activation": False}).json()
    assert abs(torch.sigmoid(torch.tensor(raw["data"][0]["score"])).item() - want[0]) <= TOL
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        res = _post(daemon, path, {"query": QUERY, "documents": DOCS, "top_n": 3}).json()
        assert [x["index"] for x in res["results"]] == order[:3]
        assert all(abs(x["relevance_score"] - want[x["index"]]) <= TOL for x in res["results"])
        assert [x["document"]["text"] for x in res["results"]] == [DOCS[i] for i in order[:3]]
    # a one-output classifier through /classify and /pooling: the sigmoid of its logit
    c = _post(daemon, "/classify", {"input": [pairs[0]]}).json()["data"][0]
    assert c["num_classes"] == 1 and c["label"] == "LABEL_0" and abs(c["probs"][0] - want[0]) <= TOL
    p = _post(daemon, "/pooling", {"input": [pairs[1]]}).json()["data"][0]
    assert p["object"] == "pooling" and abs(p["data"][0] - want[1]) <= TOL


def test_classify_matches_transformers_softmax(classifier, smol_tokenizer):
    daemon, hf = classifier
    tok = smol_tokenizer[1]
    texts = ["I loved this film.", "Terrible service, never again", "ok"]
    r = _post(daemon, "/classify", {"input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    for i, (text, d) in enumerate(zip(texts, body["data"], strict=True)):
        with torch.no_grad():
            logits = hf(torch.tensor([tok(text)["input_ids"]])).logits[0]
        probs = torch.softmax(logits, dim=0)
        assert d["index"] == i and d["num_classes"] == 3
        assert max(abs(a - b) for a, b in zip(d["probs"], probs.tolist())) <= TOL
        assert d["label"] == LABELS[int(probs.argmax())]
    raw = _post(daemon, "/pooling", {"input": texts[0], "use_activation": False, "encoding_format": "base64"}).json()
    got = struct.unpack("<3f", base64.b64decode(raw["data"][0]["data"]))
    with torch.no_grad():
        logits = hf(torch.tensor([tok(texts[0])["input_ids"]])).logits[0]
    assert max(abs(a - b) for a, b in zip(got, logits.tolist())) <= 1e-4
    # three outputs: no relevance score; not an embedding model either
    for path, req in (
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/v1/embeddings", {"input": "a"}),
        ("/pooling", {"input": "a", "normalize": True}),
    ):
        bad = _post(daemon, path, req)
        assert bad.status_code == 400 and bad.json()["error"]["type"], (path, bad.text)


def test_bi_encoder_scores_are_cosines_of_transformers_hidden_states(embedder, smol_tokenizer):
    daemon, hf = embedder
    tok = smol_tokenizer[1]

    def vec(text: str) -> torch.Tensor:
        with torch.no_grad():
            return hf.model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]

    q = vec(QUERY)
    want = [torch.nn.functional.cosine_similarity(q, vec(d), dim=0).item() for d in DOCS]
    body = _post(daemon, "/v1/score", {"data_1": QUERY, "data_2": DOCS}).json()
    assert max(abs(d["score"] - w) for d, w in zip(body["data"], want)) <= TOL
    res = _post(daemon, "/v1/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False}).json()
    assert [x["index"] for x in res["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    pooled = _post(daemon, "/pooling", {"input": QUERY, "normalize": False}).json()["data"][0]["data"]
    assert max(abs(a - b) for a, b in zip(pooled, q.tolist())) <= 1e-4
    bad = _post(daemon, "/classify", {"input": "x"})
    assert bad.status_code == 400 and "not a sequence classifier" in bad.json()["error"]["message"]
