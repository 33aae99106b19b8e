"""``/score``, ``/rerank``, ``/classify`` and ``/pooling`` on the app with the in-process fake
engine: request forms, response shapes and the refusals (OpenAI-shaped 400s that send nothing
to the engine). Numbers against transformers are in ``test_score_e2e``."""

from __future__ import annotations

import math

import pytest

from .conftest import served
from .fakes import fake_vector

pytestmark = pytest.mark.anyio
SCORE_ROUTES = ("/score", "/v1/score")
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def _bad(r, match: str, param: str | None = None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert match in err["message"], err
    if param is not None:
        assert err["param"] == param


async def test_every_route_refuses_a_generating_model(tokenizer):
    async with served(tokenizer) as (http, _, fake):
        for path in SCORE_ROUTES:
            _bad(await http.post(path, json={"text_1": "a", "text_2": ["b"]}), "Score API")
        for path in RERANK_ROUTES:
            _bad(await http.post(path, json={"query": "a", "documents": ["b"]}), "Score API")
        _bad(await http.post("/classify", json={"input": "a"}), "Classification API")
        _bad(await http.post("/pooling", json={"input": "a"}), "Pooling API")
        assert not fake.added


async def test_bi_encoder_score_is_the_cosine_of_the_embeddings(tokenizer):
    """Each of vLLM's four spellings of the pair; one first text against many, and pairwise."""
    q, docs = "short", ["a longer document here", "mid text", "x"]
    vec = {t: fake_vector(tokenizer.encode(t)) for t in [q, *docs]}
    async with served(tokenizer, runner="pooling") as (http, _, fake):
        for first, second in (
            ("queries", "documents"),
            ("queries", "items"),
            ("data_1", "data_2"),
            ("text_1", "text_2"),
        ):
            for path in SCORE_ROUTES:
                r = await http.post(path, json={first: q, second: docs})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["object"] == "list" and body["id"].startswith("score-")
                assert [d["index"] for d in body["data"]] == [0, 1, 2]
                assert all(d["object"] == "score" for d in body["data"])
                want = [_cos(vec[q], vec[d]) for d in docs]
                assert all(abs(d["score"] - w) < 1e-6 for d, w in zip(body["data"], want))
                n = sum(len(tokenizer.encode(t)) for t in [q, *docs])
                assert body["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}
        pairwise = (await http.post("/v1/score", json={"text_1": docs, "text_2": list(reversed(docs))})).json()
        assert [round(d["score"], 6) for d in pairwise["data"]] == [
            round(_cos(vec[a], vec[b]), 6) for a, b in zip(docs, reversed(docs))
        ]
        assert all(r.pooling_params.normalize for r in fake.added)


async def test_rerank_orders_documents_and_honours_top_n_and_return_documents(tokenizer):
    q, docs = "query text", ["one", "a much longer document than the others", "two words"]
    vec = {t: fake_vector(tokenizer.encode(t)) for t in [q, *docs]}
    scores = [_cos(vec[q], vec[d]) for d in docs]
    order = sorted(range(3), key=lambda i: -scores[i])
    async with served(tokenizer, runner="pooling") as (http, _, _):
        for path in RERANK_ROUTES:
            body = (await http.post(path, json={"query": q, "documents": docs})).json()
            assert body["id"].startswith("rerank-") and set(body["usage"]) == {"prompt_tokens", "total_tokens"}
            assert [r["index"] for r in body["results"]] == order
            assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in order]
            assert all(abs(r["relevance_score"] - scores[r["index"]]) < 1e-6 for r in body["results"])
        objs = [{"text": d} for d in docs]  # Cohere's document objects
        top = (
            await http.post("/v2/rerank", json={"query": q, "documents": objs, "top_n": 2, "return_documents": False})
        ).json()
        assert [r["index"] for r in top["results"]] == order[:2]
        assert all("document" not in r for r in top["results"])
        every = (await http.post("/v1/rerank", json={"query": q, "documents": docs, "top_n": None})).json()
        assert len(every["results"]) == 3


async def test_bad_inputs_are_400s_that_reach_no_engine(tokenizer):
    async with served(tokenizer, runner="pooling") as (http, _, fake):
        _bad(await http.post("/v1/rerank", json={"query": "q", "documents": []}), "documents must not be empty")
        _bad(
            await http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), "as many as", "text_1"
        )
        _bad(await http.post("/v1/score", json={"text_1": "a", "text_2": []}), "must not be empty", "text_2")
        _bad(await http.post("/v1/score", json={"text_1": [], "text_2": ["b"]}), "has 0 texts")
        _bad(await http.post("/v1/score", json={"text_1": "a"}), "give one pair")
        _bad(await http.post("/v1/score", json={"text_1": "a", "text_2": "b", "queries": "c"}), "give one pair")
        _bad(await http.post("/v1/score", json={"queries": "a", "text_2": "b"}), "give one pair")
        _bad(await http.post("/v1/score", json={"text_1": "a", "text_2": "b", "use_activation": False}), "cosine")
        _bad(await http.post("/v1/rerank", json={"query": "q", "documents": ["d"], "top_n": -1}), "top_n")
        _bad(await http.post("/v1/rerank", json={"query": "q", "documents": ["d"], "bogus": 1}), "bogus")
        _bad(await http.post("/classify", json={"input": "a"}), "not a sequence classifier")
        _bad(await http.post("/classify", json={"input": []}), "must not be empty")
        _bad(await http.post("/pooling", json={"input": "a", "use_activation": True}), "use_activation")
        _bad(await http.post("/v1/score", json={"text_1": "a", "text_2": ["b", ""]}), "text_2[1]")
        assert not fake.added


async def test_the_routes_refuse_a_body_not_sent_as_json(tokenizer):
    async with served(tokenizer, runner="pooling") as (http, _, fake):
        for path in (*SCORE_ROUTES, *RERANK_ROUTES, "/classify", "/pooling"):
            r = await http.post(path, content=b'{"input": "x"}', headers={"content-type": "text/plain"})
            assert r.status_code == 415, path
        assert not fake.added


async def test_pooling_answers_the_embedding_vector(tokenizer):
    async with served(tokenizer, runner="pooling") as (http, _, fake):
        body = (await http.post("/pooling", json={"input": ["hello there", "x"], "normalize": False})).json()
        assert body["id"].startswith("pool-") and body["object"] == "list"
        assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
        assert body["data"][0]["data"] == fake_vector(tokenizer.encode("hello there"))
        assert fake.added[0].pooling_params.normalize is False
        b64 = (await http.post("/pooling", json={"input": "x", "encoding_format": "base64", "dimensions": 4})).json()
        import base64
        import struct

        raw = base64.b64decode(b64["data"][0]["data"])
        assert list(struct.unpack("<4f", raw)) == fake_vector(tokenizer.encode("x"), 4)


async def test_classify_softmaxes_a_classifier_output_and_invocations_dispatch(tokenizer):
    """A classifier (the handshake names its labels): ``/classify`` is the softmax of the
    engine's logits, and ``/invocations`` sends an ``input`` body there instead of to embeddings."""
    labels = [f"L{i}" for i in range(8)]
    async with served(tokenizer, runner="pooling") as (http, _, fake):
        fake.handshake.labels = labels
        logits = fake_vector(tokenizer.encode("good movie"))
        e = [math.exp(x - max(logits)) for x in logits]
        probs = [x / sum(e) for x in e]
        for path in ("/classify", "/invocations"):
            body = (await http.post(path, json={"input": "good movie"})).json()
            d = body["data"][0]
            assert body["id"].startswith("classify-") and d["num_classes"] == 8
            assert max(abs(a - b) for a, b in zip(d["probs"], probs)) < 1e-6
            assert d["label"] == labels[probs.index(max(probs))]
        raw = (await http.post("/classify", json={"input": "good movie", "use_activation": False})).json()
        assert raw["data"][0]["probs"] == logits
        _bad(await http.post("/v1/embeddings", json={"input": "x"}), "sequence classifier")
        _bad(await http.post("/v1/score", json={"text_1": "a", "text_2": "b"}), "8 outputs")
        _bad(await http.post("/pooling", json={"input": "x", "dimensions": 2}), "classifier", "dimensions")


async def test_invocations_dispatch_score_and_rerank_bodies(tokenizer):
    async with served(tokenizer, runner="pooling") as (http, _, _):
        score = (await http.post("/invocations", json={"text_1": "a", "text_2": ["b", "c"]})).json()
        assert score["id"].startswith("score-") and len(score["data"]) == 2
        rerank = (await http.post("/invocations", json={"query": "a", "documents": ["b", "c"]})).json()
        assert rerank["id"].startswith("rerank-") and len(rerank["results"]) == 2
        embed = (await http.post("/invocations", json={"input": "a"})).json()
        assert embed["data"][0]["object"] == "embedding"


async def test_truncate_prompt_tokens_reaches_every_prompt(tokenizer):
    long = "one two three four five six seven eight"
    async with served(tokenizer, runner="pooling") as (http, _, fake):
        r = await http.post("/v1/score", json={"text_1": long, "text_2": [long, long], "truncate_prompt_tokens": 3})
        assert r.status_code == 200, r.text
        assert [len(req.prompt_token_ids) for req in fake.added] == [3, 3, 3]
        assert fake.added[0].prompt_token_ids == tokenizer.encode(long)[-3:]
        assert r.json()["usage"]["prompt_tokens"] == 9
        fake.added.clear()
        fake.handshake.labels = ["only"]  # a one-output cross-encoder: one prompt per joined pair
        r = await http.post("/v1/rerank", json={"query": long, "documents": [long], "truncate_prompt_tokens": 4})
        assert r.status_code == 200, r.text
        pair = tokenizer(long, long)["input_ids"]
        assert [req.prompt_token_ids for req in fake.added] == [pair[-4:]]


async def test_a_cross_encoder_without_sep_token_scores_the_joined_text(tokenizer):
    """``use_sep_token: false`` (vLLM's LLM-as-reranker mode): each pair is the concatenation
    of its two texts, tokenized as one text; by default the tokenizer's text-pair encoding."""
    q, d = "Which city is the capit", "al of France"  # "capital" is one token only when joined
    async with served(tokenizer, runner="pooling") as (http, _, fake):
        fake.handshake.labels = ["relevant"]
        assert (await http.post("/v1/score", json={"text_1": q, "text_2": d})).status_code == 200
        fake.handshake.use_sep_token = False
        assert (await http.post("/v1/score", json={"text_1": q, "text_2": d})).status_code == 200
        pair, joined = tokenizer(q, d)["input_ids"], tokenizer.encode(q + d)
        assert pair != joined and [r.prompt_token_ids for r in fake.added] == [pair, joined]
