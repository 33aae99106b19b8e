"""A route that takes a JSON body answers 415 unless the body is sent as JSON: a browser posts
``text/plain`` (or no type) to any origin without a CORS preflight."""

import json

import pytest

from pkgd.api.errors import is_json_media_type

from .conftest import served

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "Hi"}]
JSON_ROUTES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/invocations": {"prompt": "Hi", "max_tokens": 2},
}
NOT_JSON = [None, "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded", "multipart/form-data"]


@pytest.mark.parametrize("content_type", NOT_JSON)
async def test_a_json_route_refuses_a_body_not_sent_as_json(tokenizer, content_type):
    headers = {"content-type": content_type} if content_type else {}
    async with served(tokenizer) as (http, _state, fake):
        for path, body in JSON_ROUTES.items():
            r = await http.post(path, content=json.dumps(body).encode(), headers=headers)
            assert r.status_code == 415, (path, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["type"], err["code"]) == ("invalid_request_error", "unsupported_media_type")
            assert "Content-Type: application/json" in err["message"]
            assert (repr(content_type) if content_type else "none was sent") in err["message"]
        assert fake.added == []


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"],
)
async def test_a_json_content_type_is_served(tokenizer, content_type):
    async with served(tokenizer) as (http, _state, _fake):
        for path, body in JSON_ROUTES.items():
            r = await http.post(path, content=json.dumps(body).encode(), headers={"content-type": content_type})
            assert r.status_code == 200, (path, r.text)


async def test_embeddings_refuse_text_plain_and_authentication_comes_first(tokenizer):
    from pkgd.config.vllm_config import VllmConfig

    async with served(tokenizer, runner="pooling") as (http, _state, _fake):
        r = await http.post("/v1/embeddings", content=b'{"input": "x"}', headers={"content-type": "text/plain"})
        assert r.status_code == 415
        assert (await http.post("/v1/embeddings", json={"input": "x"})).status_code == 200
    config = VllmConfig.model_validate({"frontend": {"api_keys": ["sk-1"]}})
    async with served(tokenizer, config=config) as (http, _state, _fake):
        r = await http.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"})
        assert r.status_code == 401  # the key is checked before anything about the body


def test_every_post_route_with_a_body_requires_json():
    """A new POST route that takes a body must declare `require_json`; the others take none."""
    from pkgd.api.errors import require_json
    from pkgd.api.routes import router
    from pkgd.api.routes_admin import router as admin_router

    guarded, unguarded = set(), set()
    for route in [*router.routes, *admin_router.routes]:
        if "POST" in getattr(route, "methods", ()):
            deps = {d.call for d in route.dependant.dependencies}
            (guarded if require_json in deps else unguarded).add(route.path)
    pooling = {"/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/pooling"}
    assert guarded == set(JSON_ROUTES) | {"/v1/embeddings"} | pooling
    assert unguarded == {"/ping", "/reset_prefix_cache", "/sleep", "/wake_up"}


def test_json_media_types():
    assert is_json_media_type("application/json") and is_json_media_type("application/problem+json; charset=x")
    assert not any(map(is_json_media_type, [None, "", "text/json", "application/jsonx", "application/x-json"]))
