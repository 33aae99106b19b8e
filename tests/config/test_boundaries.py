"""The seeds' `vllm serve` boundaries, as validators of VllmConfig and its ServePlan."""

import pytest
from pydantic import ValidationError

from pkgd.config import VllmConfig
from pkgd.parsers import registered_names


def cfg(**sections) -> VllmConfig:
    return VllmConfig.model_validate(sections)


def refused(**sections) -> str:
    with pytest.raises(ValidationError) as info:
        cfg(**sections)
    return str(info.value)


def test_headless_excludes_api_servers():
    assert "conflicts with frontend.headless" in refused(frontend={"headless": True, "api_server_count": 1})
    plan = cfg(frontend={"headless": True, "api_server_count": 0}).serve_plan()
    assert (plan.mode, plan.api_server_count) == ("headless", 0)
    assert cfg(frontend={"headless": True}).serve_plan().api_server_count == 0


def test_lb_modes_are_exclusive():
    # lb.mode holds one mode; a DP rank implies the external LB, so it excludes hybrid
    assert "mutually exclusive" in refused(parallel={"dp": 2, "dp_rank": 0}, lb={"mode": "hybrid"})
    plan = cfg(parallel={"dp": 2, "dp_rank": 1}).serve_plan()
    assert (plan.mode, plan.api_server_count, plan.dp_local, plan.dp_start_rank) == ("external_lb", 1, 1, 1)


@pytest.mark.parametrize(
    ("sections", "mode", "count"),
    [
        ({}, "single", 1),
        ({"parallel": {"dp": 4}}, "multi_api", 4),
        ({"parallel": {"dp": 4}, "lb": {"mode": "external"}}, "external_lb", 1),
        ({"parallel": {"dp": 4, "nnodes": 2, "dp_local": 2}, "lb": {"mode": "hybrid"}}, "hybrid_lb", 2),
        ({"parallel": {"dp": 4}, "lb": {"mode": "hybrid"}}, "hybrid_lb", 1),
        ({"parallel": {"dp": 4}, "frontend": {"api_server_count": 2}}, "multi_api", 2),
        ({"parallel": {"dp": 2}, "frontend": {"api_server_count": 0}}, "headless", 0),
    ],
    ids=["default", "internal=dp", "external=1", "hybrid=dp_local", "hybrid-no-local=1", "explicit", "zero"],
)
def test_api_server_count_derivation(sections, mode, count):
    plan = cfg(**sections).serve_plan()
    assert (plan.mode, plan.api_server_count) == (mode, count)


def test_elastic_ep_caps_api_servers_with_a_warning():
    plan = cfg(parallel={"dp": 4, "enable_elastic_ep": True}).serve_plan()
    assert plan.api_server_count == 1
    assert plan.warnings == (
        "frontend.api_server_count: 4 capped to 1 because parallel.enable_elastic_ep supports a single API server",
    )
    assert cfg(parallel={"enable_elastic_ep": True}).serve_plan().warnings == ()


def test_expert_parallel_over_data_parallel_only_warns_that_every_engine_holds_every_expert():
    plan = cfg(parallel={"dp": 2, "enable_expert_parallel": True}).serve_plan()
    assert plan.warnings == (
        "parallel.enable_expert_parallel splits MoE experts across the tensor-parallel group only "
        "(parallel.tp is 1): each of the 2 data-parallel engines holds every expert",
    )
    assert cfg(parallel={"dp": 2, "tp": 2, "enable_expert_parallel": True}).serve_plan().warnings == ()


def test_runtime_lora_needs_one_api_server():
    assert "refused with 3 API servers" in refused(
        frontend={"allow_runtime_lora_updating": True, "api_server_count": 3}
    )
    assert "refused with 2 API servers" in refused(frontend={"allow_runtime_lora_updating": True}, parallel={"dp": 2})
    assert cfg(frontend={"allow_runtime_lora_updating": True}, parallel={"dp": 2}, lb={"mode": "external"})


@pytest.mark.parametrize(("field", "kind"), [("tool_call_parser", "tool"), ("reasoning_parser", "reasoning")])
def test_parsers_must_be_registered(field, kind):
    names = registered_names(kind)
    message = refused(frontend={field: "nope"})
    assert f"'nope' is not a registered {kind} parser (registered: {', '.join(names)})" in message
    assert getattr(cfg(frontend={field: names[0]}).frontend, field) == names[0]


def test_trust_remote_code_is_refused():
    assert "model.trust_remote_code: true is refused" in refused(model={"trust_remote_code": True})


def test_all_broken_rules_are_reported_together():
    message = refused(model={"trust_remote_code": True}, frontend={"headless": True, "api_server_count": 2})
    assert "trust_remote_code" in message and "headless" in message


def test_runner_and_convert_flags_choose_the_pooling_runner():
    from pkgd.config.overrides import parse_flags

    def runner(*flags: str) -> str:
        ops, problems = parse_flags(list(flags))
        assert not problems
        model = {op.key.split(".", 1)[1]: op.value for op in ops}
        return cfg(model=model).model.runner_type

    assert runner() == "generate"
    assert runner("--runner", "pooling") == "pooling"
    assert runner("--convert", "embed") == "pooling"  # vLLM's --convert embed
    assert runner("--runner", "generate", "--convert", "none") == "generate"
    assert "conflicts with model.runner: generate" in refused(model={"runner": "generate", "convert": "embed"})
