"""pkgd bench serve's client: a pooled connection the server closed before answering is
retried once on a new one (llama-server ends kept-alive connections); any other failure is
counted, never retried."""

import asyncio

import httpx

from pkgd.cli import bench_serve

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}
SSE = (
    b'data: {"choices": [{"text": "a"}]}\n\n'
    b'data: {"choices": [{"text": "b"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
    b"data: [DONE]\n\n"
)


def drive(failures: list[Exception]) -> tuple[bench_serve.RequestResult, int]:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if failures:
            raise failures.pop(0)
        return httpx.Response(200, content=SSE, headers={"content-type": "text/event-stream"})

    async def go() -> bench_serve.RequestResult:
        async with httpx.AsyncClient(base_url="http://t", transport=httpx.MockTransport(handler)) as http:
            return await bench_serve._one(http, dict(BODY))

    return asyncio.run(go()), calls


def test_a_connection_closed_before_the_answer_is_sent_again_once():
    res, calls = drive([httpx.RemoteProtocolError("Server disconnected without sending a response.")])
    assert (res.ok, res.retried, res.output_tokens, calls) == (True, True, 2, 2)


def test_a_second_close_is_a_failed_request():
    closed = "Server disconnected without sending a response."
    res, calls = drive([httpx.RemoteProtocolError(closed), httpx.RemoteProtocolError(closed)])
    assert (res.ok, res.retried, calls) == (False, True, 2)
    assert res.error == f"RemoteProtocolError: {closed}"


def test_a_timeout_is_not_sent_again():
    res, calls = drive([httpx.ReadTimeout("slow")])
    assert (res.ok, res.retried, calls) == (False, False, 1)
    assert res.error == "ReadTimeout: slow"


def test_an_answer_is_counted_as_one_request():
    res, calls = drive([])
    assert (res.ok, res.retried, res.prompt_tokens, calls) == (True, False, 3, 1)
