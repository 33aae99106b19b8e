"""Structured outputs in the engine core (fake runner that honours the bitmask, the real
SmolLM2 tokenizer): compiles happen off the step path, the cache is keyed by constraint,
outputs match their constraint through continuous batching, ``n``-style siblings and
preemption, and a constraint that fails to compile is reported, not crashed on."""

from __future__ import annotations

import json
import re
import threading

import pytest
from tests.smollm2 import smollm2_gguf

from pkgd.config import VllmConfig
from pkgd.engine.core import EngineCore
from pkgd.ipc.messages import EngineCoreRequest, FinishReason
from pkgd.sampling_params import SamplingParams, StructuredOutputsParams

from .fake_runner import fake_factory

VOCAB = 49152
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    from pkgd.frontend.tokenizer import load_tokenizer

    return load_tokenizer(None, tokenizer=str(smollm2_gguf()))


def engine(num_blocks=64):
    cfg = VllmConfig.model_validate(
        {
            "model": {"tokenizer": str(smollm2_gguf()), "max_model_len": 256},
            "cache": {"num_blocks": num_blocks, "block_size": 16},
        }
    )
    return EngineCore(cfg, runner_factory=fake_factory(vocab_size=VOCAB, eos_token_id=EOS))


def request(rid, so=None, prompt=(5, 6, 7), **sp):
    sp.setdefault("max_tokens", 40)
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=list(prompt),
        eos_token_id=EOS,
        sampling_params=SamplingParams(temperature=0, structured_outputs=so, **sp),
    )


def run(core, max_steps=500):
    tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    return tokens, finish


def text(tokenizer, ids):
    return tokenizer.decode([t for t in ids if t != EOS])


def test_a_compiling_grammar_never_holds_back_unconstrained_requests(tokenizer):
    core = engine()
    gate = threading.Event()
    compile_ = core.structured_output._compile
    core.structured_output._compile = lambda so: (gate.wait(30), compile_(so))[1]
    core.add_request(request("free", max_tokens=5))
    core.add_request(request("json", StructuredOutputsParams(choice=["alpha", "beta"])))
    free_tokens = []
    for _ in range(5):
        free_tokens += [t for o in core.step() if o.request_id == "free" for t in o.new_token_ids]
    assert len(free_tokens) == 5 and "json" in core.awaiting_grammar and "json" not in core.scheduler.requests
    gate.set()
    tokens, finish = run(core)
    assert text(tokenizer, tokens["json"]) in ("alpha", "beta") and finish["json"] == FinishReason.STOP


def test_constraints_hold_through_batching_siblings_and_preemption(tokenizer):
    core = engine(num_blocks=18)  # 8 prompts of 2 full blocks, 2 blocks left to grow into: preemption
    core.scheduler.admission_lookahead = 0  # admit all at once (vLLM's rule), so they preempt
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 9999}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
    }
    cases = {
        **{f"json{i}": StructuredOutputsParams(json=schema, disable_any_whitespace=True) for i in range(3)},
        **{f"re{i}": StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}") for i in range(3)},
        "grammar": StructuredOutputsParams(grammar='root ::= "x" ("y" | "z")'),
        "free": None,
    }
    for i, (rid, so) in enumerate(cases.items()):
        core.add_request(request(rid, so, prompt=list(range(10 + i, 42 + i))))
    tokens, finish = run(core)
    assert core.scheduler.num_preemptions > 0
    assert (
        core.structured_output.num_hits == 4 and core.structured_output.num_queries == 7
    )  # one compile per constraint
    for i in range(3):
        assert finish[f"json{i}"] == FinishReason.STOP
        assert set(json.loads(text(tokenizer, tokens[f"json{i}"]))) == {"n", "ok"}
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", text(tokenizer, tokens[f"re{i}"]))
    assert text(tokenizer, tokens["grammar"]) in ("xy", "xz") and finish["free"] == FinishReason.LENGTH


def test_a_constraint_that_fails_to_compile_is_reported_and_the_engine_goes_on():
    core = engine()
    core.add_request(request("bad", StructuredOutputsParams(regex="[a-")))
    core.add_request(request("ok", max_tokens=3))
    tokens, _ = run(core)
    failed = core.pop_failed_requests()
    assert [rid for rid, _ in failed] == ["bad"] and "Unclosed" in failed[0][1] and len(tokens["ok"]) == 3
    assert not core.has_unfinished_requests()
    core.add_request(request("bad2", StructuredOutputsParams(regex="[a-")))  # a failed compile is not cached
    run(core)
    assert [rid for rid, _ in core.pop_failed_requests()] == ["bad2"]


def test_abort_while_compiling_forgets_the_request():
    core = engine()
    gate = threading.Event()
    compile_ = core.structured_output._compile
    core.structured_output._compile = lambda so: (gate.wait(30), compile_(so))[1]
    core.add_request(request("a", StructuredOutputsParams(regex="[0-9]+")))
    core.abort_requests(["a"])
    gate.set()
    assert not core.has_unfinished_requests() and core.step() == []
