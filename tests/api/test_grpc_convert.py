"""`pkgd.api.grpc_convert`: proto messages → pkgd's request types and back, and the status code
each failure gets (`pkgd.api.grpc_servicer.status_of`)."""

from __future__ import annotations

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("smg_grpc_proto")

from smg_grpc_proto.generated import vllm_engine_pb2 as pb  # noqa: E402

from pkgd.api import grpc_convert as convert  # noqa: E402
from pkgd.api.errors import APIError  # noqa: E402
from pkgd.api.grpc_servicer import status_of  # noqa: E402
from pkgd.config.sections import FrontendLimits, GenerationDefaults  # noqa: E402
from pkgd.frontend.async_llm import RequestIdInUse  # noqa: E402
from pkgd.ipc.client import EngineRequestError, EngineUnavailableError  # noqa: E402
from pkgd.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pkgd.sampling_params import RequestOutputKind  # noqa: E402


def params(proto: pb.SamplingParams, *, stream: bool = True, gen: GenerationDefaults | None = None, file=None):
    return convert.sampling_params(
        proto,
        stream=stream,
        limits=FrontendLimits(),
        generation=gen or GenerationDefaults(),
        file_defaults=file or {},
    )


def test_unset_fields_take_the_defaults_in_the_http_order():
    sp = params(pb.SamplingParams())
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens, sp.n) == (
        1.0,
        1.0,
        0,
        1.0,
        None,
        1,
    )
    assert sp.output_kind == RequestOutputKind.DELTA and not sp.detokenize
    gen = GenerationDefaults(temperature=0.3, max_tokens=7)
    sp = params(pb.SamplingParams(), gen=gen, file={"top_p": 0.9, "temperature": 0.8}, stream=False)
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.3, 0.9, 7)
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY
    # an explicit value wins, temperature 0 included (proto3 optional)
    sp = params(pb.SamplingParams(temperature=0.0, top_p=0.5, max_tokens=3, seed=0), gen=gen)
    assert (sp.temperature, sp.top_p, sp.max_tokens, sp.seed) == (0.0, 0.5, 3, 0)


def test_fields_map_one_to_one():
    proto = pb.SamplingParams(
        stop=["\n\n"],
        stop_token_ids=[5],
        min_tokens=2,
        ignore_eos=True,
        n=2,
        logprobs=3,
        prompt_logprobs=1,
        logit_bias={7: -5.0},
        include_stop_str_in_output=True,
        skip_special_tokens=True,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
    )
    sp = params(proto)
    assert sp.stop == ["\n\n"] and sp.stop_token_ids == [5] and sp.min_tokens == 2 and sp.ignore_eos
    assert sp.n == 2 and sp.logprobs == 3 and sp.prompt_logprobs == 1 and sp.logit_bias == {7: -5.0}
    assert sp.include_stop_str_in_output and sp.detokenize  # stop strings need the text
    assert (sp.min_p, sp.presence_penalty, sp.frequency_penalty) == (0.1, 0.5, -0.5)
    assert params(pb.SamplingParams(logprobs=-1)).logprobs == FrontendLimits().max_logprobs


@pytest.mark.parametrize(
    ("proto", "field"),
    [
        (pb.SamplingParams(temperature=3.0), "temperature"),
        (pb.SamplingParams(logprobs=10**6), "logprobs"),
        (pb.SamplingParams(n=10**6), "n"),
        (pb.SamplingParams(stop=["x" * 10**5]), "stop"),
        (pb.SamplingParams(structural_tag="{}"), "structural_tag"),
        (pb.SamplingParams(json_schema="[1]"), "json_schema"),
        (pb.SamplingParams(choice=pb.ChoiceConstraint()), "choice"),
    ],
)
def test_bad_fields_name_themselves(proto, field):
    with pytest.raises(convert.RequestFieldError, match=field):
        params(proto)


def test_constraints():
    assert params(pb.SamplingParams(regex="a+")).structured_outputs.regex == "a+"
    assert params(pb.SamplingParams(json_schema='{"type": "object"}')).structured_outputs.json == {"type": "object"}
    assert params(pb.SamplingParams(json_object=True)).structured_outputs.json_object
    assert params(pb.SamplingParams(grammar='root ::= "a"')).structured_outputs.grammar == 'root ::= "a"'
    assert params(pb.SamplingParams(choice=pb.ChoiceConstraint(choices=["a", "b"]))).structured_outputs.choice == [
        "a",
        "b",
    ]


def test_prompt_input_and_truncation():
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2, 3, 4]))
    assert convert.prompt_input(req, 100) == [1, 2, 3, 4]
    assert convert.prompt_input(pb.GenerateRequest(text="hi"), 100) == "hi"
    params = pb.SamplingParams(truncate_prompt_tokens=2)
    assert convert.truncate([1, 2, 3, 4], params, 100) == [3, 4]
    params.truncate_prompt_tokens = -1
    assert convert.truncate([1, 2, 3, 4], params, 3) == [2, 3, 4]
    assert convert.truncate([1, 2], pb.SamplingParams(), 1) == [1, 2]
    with pytest.raises(convert.RequestFieldError, match="truncate_prompt_tokens"):
        convert.truncate([1], pb.SamplingParams(truncate_prompt_tokens=0), 10)
    for bad in (
        pb.GenerateRequest(text="x" * 101),
        pb.GenerateRequest(tokenized=pb.TokenizedInput()),
        pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1]), kv_transfer_params_json="{}"),
        pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1]), mm_inputs=pb.MultimodalInputs()),
    ):
        with pytest.raises(convert.RequestFieldError):
            convert.prompt_input(bad, 100)


def test_outputs_carry_tokens_logprobs_and_the_matched_stop():
    top = {9: Logprob(-0.5, rank=2), 4: Logprob(-0.1, rank=1)}  # pkgd: sampled first, then by rank
    comp = CompletionOutput(index=1, text="", token_ids=[9], logprobs=[top], finish_reason="stop", stop_reason=9)
    out = RequestOutput("r", None, [1, 2], [comp], True, prompt_logprobs=[None, {2: Logprob(-1.0, rank=1)}])
    chunk = convert.chunk(out, comp, first=True).chunk
    assert list(chunk.token_ids) == [9] and chunk.index == 1 and chunk.prompt_tokens == 2
    assert list(chunk.output_logprobs.token_logprobs) == [-0.5]
    assert list(chunk.output_logprobs.top_logprobs[0].token_ids) == [4, 9]  # most likely first
    assert not chunk.input_logprobs.token_logprobs[0].HasField("value")
    assert chunk.input_logprobs.token_logprobs[1].value == -1.0
    done = convert.complete(out, comp).complete
    assert done.finish_reason == "stop" and done.matched_token_id == 9
    comp.stop_reason = "END"
    assert convert.complete(out, comp).complete.matched_stop_str == "END"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ValueError("x"), "INVALID_ARGUMENT"),
        (RequestIdInUse("r"), "ALREADY_EXISTS"),
        (APIError(404, "no model"), "NOT_FOUND"),
        (APIError(503, "busy"), "UNAVAILABLE"),
        (EngineUnavailableError("down"), "UNAVAILABLE"),
        (EngineRequestError("bad", rejected=True), "INVALID_ARGUMENT"),
        (EngineRequestError("cut", cut_reason="drain_timeout"), "UNAVAILABLE"),
        (TimeoutError(), "DEADLINE_EXCEEDED"),
        (RuntimeError("bug"), "INTERNAL"),
    ],
)
def test_status_codes(exc, code):
    assert status_of(exc)[0].name == code
