"""`pkgd serve --grpc` through `smg-grpc-proto`'s own client stubs: a real daemon (supervisor,
engine core, API server speaking gRPC on the supervisor's socket) serving a tiny random-weight
Llama with SmolLM2's tokenizer. Generate streaming and unary, Abort, HealthCheck, model and
server info, loads, the tokenizer archive, status codes for bad input and API keys."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import io
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "faults"))  # cases: the tiny model

grpc = pytest.importorskip("grpc")
pytest.importorskip("smg_grpc_proto")

from cases import build_fault_model  # noqa: E402
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as pb  # noqa: E402
from supervisor_helpers import Daemon, reload_and_wait  # noqa: E402

from pkgd.config.sections import DEFAULT_MODEL_SOURCE  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "sesame"


@pytest.fixture(scope="module")
def served():
    """A `pkgd serve --grpc` daemon with an API key; yields (daemon, target)."""
    work = Path(tempfile.mkdtemp(prefix="pkgd-g-", dir="/tmp"))
    build_fault_model(work / "tiny")
    (work / "d").mkdir()
    config = {
        "model": {
            "source": str(work / "tiny"),
            "tokenizer": DEFAULT_MODEL_SOURCE,
            "name": "tiny",
            "max_model_len": 4096,
        },
        "cache": {"num_blocks": 1024},
        "parallel": {"cpu_threads": 1},
        "frontend": {"api_keys": [KEY], "limits": {"max_logprobs": 5}, "server_dev_mode": True},
        "supervisor": {"engine_ready_timeout": 600, "drain_timeout": 30},
    }
    d = serve_grpc(work / "d", config)
    try:
        url = d.wait_ready(600)
        assert url.startswith("grpc://"), url
        yield d, url.removeprefix("grpc://")
    finally:
        d.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def serve_grpc(workdir: Path, config: dict) -> Daemon:
    """`Daemon` running ``pkgd serve --config-dir WORKDIR --grpc`` (vLLM's flag on the command
    line; the config file is ``WORKDIR/pkgd.yaml``)."""
    exe = str(Path(sys.executable).with_name("pkgd"))
    return Daemon(workdir, config, argv=[exe, "serve", "--config-dir", str(workdir), "--grpc"])


def call(target: str, method: str, request, *, key: str | None = KEY, timeout: float = 120):
    """One call on a fresh channel: a unary method's reply or a streaming one's list."""

    async def run():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            md = [("authorization", f"Bearer {key}")] if key else None
            rpc = getattr(stub, method)(request, metadata=md, timeout=timeout)
            if hasattr(rpc, "__aiter__"):
                return [m async for m in rpc]
            return await rpc

    return asyncio.run(run())


def generate(ids, **params) -> pb.GenerateRequest:
    stream = params.pop("stream", True)
    rid = params.pop("request_id", "r")
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(**params),
        stream=stream,
    )


def code_of(target, method, request, **kw) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(target, method, request, **kw)
    return err.value.code()


def test_generate_streams_token_ids_then_completes(served):
    _, target = served
    msgs = call(target, "Generate", generate([1, 2, 3, 4, 5], max_tokens=8, temperature=0, ignore_eos=True, logprobs=2))
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    done = [m.complete for m in msgs if m.HasField("complete")]
    assert len(done) == 1 and msgs[-1].HasField("complete")
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 8 and done[0].finish_reason == "length"
    assert chunks[0].prompt_tokens == 5
    lp = [t for c in chunks for t in c.output_logprobs.token_ids]
    assert lp == ids  # a logprob per generated token
    assert all(len(c.output_logprobs.top_logprobs[0].token_ids) >= 2 for c in chunks)
    unary = call(
        target, "Generate", generate([1, 2, 3, 4, 5], max_tokens=8, temperature=0, ignore_eos=True, stream=False)
    )
    assert len(unary) == 1 and list(unary[0].complete.output_ids) == ids  # greedy: same tokens


def test_a_text_prompt_is_tokenized_with_the_served_tokenizer(served, smollm2_tokenizer):
    _, target = served
    text = "31415926535"  # digits are single tokens, all inside the tiny model's 160 ids
    expect = smollm2_tokenizer.encode(text)
    assert expect and max(expect) < 160
    by_text = pb.GenerateRequest(
        request_id="txt", text=text, sampling_params=pb.SamplingParams(max_tokens=4, temperature=0), stream=False
    )
    by_ids = generate(expect, max_tokens=4, temperature=0, stream=False)
    a, b = call(target, "Generate", by_text)[0].complete, call(target, "Generate", by_ids)[0].complete
    assert a.prompt_tokens == len(expect) and list(a.output_ids) == list(b.output_ids)


def test_stop_token_and_choice_constraint(served):
    _, target = served
    first = call(target, "Generate", generate([7, 8, 9], max_tokens=4, temperature=0, ignore_eos=True, stream=False))
    stop_id = first[0].complete.output_ids[1]
    stopped = call(target, "Generate", generate([7, 8, 9], max_tokens=4, temperature=0, stop_token_ids=[stop_id]))
    end = stopped[-1].complete
    assert end.finish_reason == "stop" and end.matched_token_id == stop_id
    choice = pb.ChoiceConstraint(choices=["yes", "no"])
    out = call(target, "Generate", generate([1, 2], max_tokens=8, temperature=0, choice=choice, stream=False))
    assert out[0].complete.finish_reason == "stop" and out[0].complete.output_ids


def test_abort_ends_the_stream_with_abort(served):
    _, target = served

    async def run():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            md = [("authorization", f"Bearer {KEY}")]
            req = generate([1, 2, 3], max_tokens=200, ignore_eos=True, request_id="long-1")
            stream = stub.Generate(req, metadata=md)
            got = []
            async for m in stream:
                got.append(m)
                if len(got) == 2:
                    await stub.Abort(pb.AbortRequest(request_ids=["long-1", "unknown"]), metadata=md)
            return got

    got = asyncio.run(run())
    assert got[-1].HasField("complete") and got[-1].complete.finish_reason == "abort"
    assert sum(len(m.chunk.token_ids) for m in got if m.HasField("chunk")) < 200


def test_health_info_loads_tokenizer(served):
    _, target = served
    health = call(target, "HealthCheck", pb.HealthCheckRequest(), key=None)  # open, as /health
    assert health.healthy and health.message == "ok"
    info = call(target, "GetModelInfo", pb.GetModelInfoRequest())
    assert info.served_model_name == "tiny" and info.is_generation and info.max_context_length == 4096
    assert info.vocab_size > 0 and list(info.eos_token_ids)
    server = call(target, "GetServerInfo", pb.GetServerInfoRequest())
    assert server.server_type == "vllm-grpc" and server.data_parallel_size == 1 and server.block_size > 0
    loads = call(target, "GetLoads", pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens > 0
    chunks = call(target, "GetTokenizer", common_pb2.GetTokenizerRequest())
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "chat_template.jinja" in names
    from transformers import PreTrainedTokenizerFast

    tok_json = zipfile.ZipFile(io.BytesIO(data)).read("tokenizer.json").decode()
    tok = PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(tok_json))
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (generate([1, 2], temperature=5.0), "INVALID_ARGUMENT"),
        (generate([1, 2], logprobs=6), "INVALID_ARGUMENT"),  # over frontend.limits.max_logprobs
        (generate([], max_tokens=4), "INVALID_ARGUMENT"),
        (generate([10**7], max_tokens=4), "INVALID_ARGUMENT"),  # outside the vocabulary
        (generate([1] * 4000, max_tokens=200), "INVALID_ARGUMENT"),  # beyond max_model_len
        (generate([1, 2], json_schema="{not json"), "INVALID_ARGUMENT"),
        (generate([1, 2], structural_tag="{}"), "INVALID_ARGUMENT"),
        (pb.GenerateRequest(request_id="t", text=""), "INVALID_ARGUMENT"),
    ],
)
def test_bad_input_is_invalid_argument(served, request_, code):
    _, target = served
    assert code_of(target, "Generate", request_).name == code


def test_api_key(served):
    _, target = served
    assert code_of(target, "GetModelInfo", pb.GetModelInfoRequest(), key=None).name == "UNAUTHENTICATED"
    assert code_of(target, "Generate", generate([1, 2], max_tokens=2), key="wrong").name == "UNAUTHENTICATED"
    assert code_of(target, "GetTokenizer", common_pb2.GetTokenizerRequest(), key=None).name == "UNAUTHENTICATED"


def test_embed_on_a_generation_model_is_unimplemented(served):
    _, target = served
    req = pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]))
    assert code_of(target, "Embed", req).name == "UNIMPLEMENTED"


def test_flush_cache_empties_the_prefix_cache(served):
    _, target = served
    prompt = list(range(1, 80))  # five full 16-token blocks
    call(target, "Generate", generate(prompt, max_tokens=1, stream=False))
    cached = call(target, "Generate", generate(prompt, max_tokens=1, stream=False))[0].complete.cached_tokens
    assert cached >= 64
    reply = call(target, "FlushCache", common_pb2.FlushCacheRequest(timeout_s=10))
    assert reply.success, reply.message
    assert call(target, "Generate", generate(prompt, max_tokens=1, stream=False))[0].complete.cached_tokens == 0


def test_default_sampling_params_are_json(served):
    _, target = served
    info = call(target, "GetModelInfo", pb.GetModelInfoRequest())
    assert isinstance(json.loads(info.default_sampling_params_json), dict)


def test_supervisor_probes_the_grpc_endpoint(served):
    d, target = served
    deadline = time.monotonic() + 60
    while not (health := d.status()["health"]) or not health[0]["healthy"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.5)
    assert health[0]["url"] == f"grpc://{target}" and health[0]["status"] == 200


def _long_stream(
    target: str, rid: str, opened: threading.Event, out: list, max_tokens: int, pause: float = 0.0
) -> None:
    """Stream ``max_tokens`` into ``out`` (or the error), reading one message per ``pause`` s:
    a slow reader keeps the call in flight however fast the engine is."""

    async def run():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            md = [("authorization", f"Bearer {KEY}")]
            req = generate([1, 2, 3], max_tokens=max_tokens, ignore_eos=True, request_id=rid)
            async for m in stub.Generate(req, metadata=md, timeout=600):
                out.append(m)
                opened.set()
                await asyncio.sleep(pause)

    try:
        asyncio.run(run())
    except grpc.aio.AioRpcError as exc:
        out.append(exc)
    opened.set()


def test_an_api_reload_finishes_the_streams_in_flight(served):
    d, target = served
    opened, out = threading.Event(), []
    t = threading.Thread(target=_long_stream, args=(target, "during-reload", opened, out, 4000, 0.005))
    t.start()
    assert opened.wait(120)
    event = reload_and_wait(d, {"frontend": {"limits": {"max_logprobs": 4}}}, timeout=300)
    assert event["event"] == "reload_applied" and event["reload_class"] == "api", event
    t.join(600)
    ended = time.time()
    deadline = time.monotonic() + 120
    while d.status()["retiring"]:  # the old API server drained and exited
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert isinstance(out[-1], pb.GenerateResponse), out[-1]
    assert out[-1].complete.finish_reason == "length"
    assert sum(len(m.chunk.token_ids) for m in out if m.HasField("chunk")) == 4000
    drained = datetime.datetime.fromisoformat(d.find("draining")[-1]["timestamp"]).timestamp()
    assert drained < ended  # the old API server began its drain while the stream ran
    # the new API server took over the port and the new limit (frontend.limits is live there)
    assert code_of(target, "Generate", generate([1, 2], logprobs=5)).name == "INVALID_ARGUMENT"
    assert call(target, "Generate", generate([1, 2], max_tokens=2, logprobs=4, ignore_eos=True))[-1].HasField(
        "complete"
    )


def test_sigterm_drains_the_stream_in_flight_then_exits(served):
    d, target = served  # the module's last test: the daemon stops
    opened, out = threading.Event(), []
    t = threading.Thread(target=_long_stream, args=(target, "during-stop", opened, out, 500))
    t.start()
    assert opened.wait(120)
    d.signal(signal.SIGTERM)
    t.join(300)
    assert isinstance(out[-1], pb.GenerateResponse) and out[-1].complete.finish_reason == "length", out[-1]
    assert d.wait_exit(120) == 0


def test_embed_on_a_pooling_model():
    work = Path(tempfile.mkdtemp(prefix="pkgd-ge-", dir="/tmp"))
    try:
        build_fault_model(work / "tiny")
        config = {
            "model": {
                "source": str(work / "tiny"),
                "tokenizer": DEFAULT_MODEL_SOURCE,
                "name": "tiny-embed",
                "max_model_len": 256,
                "runner": "pooling",
            },
            "cache": {"num_blocks": 64},
            "parallel": {"cpu_threads": 1},
            "supervisor": {"engine_ready_timeout": 600},
        }
        d = serve_grpc(work / "d", config)
        try:
            target = d.wait_ready(600).removeprefix("grpc://")
            req = pb.EmbedRequest(request_id="e1", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3, 4]))
            reply = call(target, "Embed", req, key=None)
            assert reply.embedding_dim == len(reply.embedding) == 64 and reply.prompt_tokens == 4
            assert abs(sum(x * x for x in reply.embedding) - 1.0) < 1e-3  # normalized, as the pooler says
            again = call(target, "Embed", pb.EmbedRequest(request_id="e2", tokenized=req.tokenized), key=None)
            assert list(again.embedding) == list(reply.embedding)
            assert code_of(target, "Generate", generate([1, 2], max_tokens=2), key=None).name == "UNIMPLEMENTED"
            assert not call(target, "GetModelInfo", pb.GetModelInfoRequest(), key=None).is_generation
        finally:
            d.cleanup()
    finally:
        shutil.rmtree(work, ignore_errors=True)
