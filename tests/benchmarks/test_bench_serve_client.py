"""pkgd bench serve's client: a pooled connection the server closed before answering is
retried once on a new one (llama-server ends kept-alive connections); any other failure is
counted, never retried."""

import argparse
import asyncio
import socket
import subprocess
import sys
from pathlib import Path

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


# ---- the command line: vllm bench serve's target flags, no configuration, a clear failure ----


def run_pkgd(*argv: str) -> subprocess.CompletedProcess[str]:
    pkgd = Path(sys.executable).with_name("pkgd")  # the console script, as a user runs it
    return subprocess.run([str(pkgd), "bench", "serve", *argv], capture_output=True, text=True, timeout=60)


def test_host_port_and_model_name_the_target_as_vllm_bench_serve_reads_them():
    def args(**kw):
        return argparse.Namespace(**{"base_url": None, "model": None, **kw})

    a = args()
    assert bench_serve.apply_target_flags(a, ["--host", "10.0.0.2", "--port=8107", "--model", "m"]) == []
    assert (a.base_url, a.model) == ("http://10.0.0.2:8107", "m")
    a = args(base_url="http://x:1", model="given")  # --base-url and --model-name win, as in vLLM
    assert bench_serve.apply_target_flags(a, ["--port", "8107", "--model", "m", "--max-num-seqs", "4"]) == [
        "--max-num-seqs",
        "4",
    ]
    assert (a.base_url, a.model) == ("http://x:1", "given")
    for bad in (["--port", "abc"], ["--port", "0"], ["--host"]):
        try:
            bench_serve.apply_target_flags(args(), bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


def test_server_settings_are_refused_and_an_unreachable_server_is_one_line():
    refused = run_pkgd("--max-num-seqs", "0", "schedulr.x=1", "--num-prompts", "1")
    assert refused.returncode == 2
    assert "reads no configuration: --max-num-seqs 0 schedulr.x=1" in refused.stderr
    # a port nothing listens on (bound, not listening)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        gone = run_pkgd("--port", str(port), "--num-prompts", "1", "--warmup", "0")
    assert gone.returncode == 1
    assert gone.stderr.strip().splitlines() == [
        f"pkgd bench serve: error: cannot reach http://127.0.0.1:{port}: All connection attempts failed"
    ]
