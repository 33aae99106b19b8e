"""Bad configurations: one precise line per problem, and nothing leaks into the next compose."""

import pytest

from pkgd.config.compose import ComposeRequest, compose
from pkgd.config.errors import ConfigError


def problems_of(request: ComposeRequest) -> list[str]:
    with pytest.raises(ConfigError) as info:
        compose(request)
    return info.value.problems


def cli(*overrides, flags=(), env=None):
    return ComposeRequest(overrides=overrides, flags=tuple(flags), env=env or {})


# (id, request or a function of the `tree` fixture, substrings of the one expected line)
CASES = [
    (
        "unknown key",
        cli("parallel.tpp=2"),
        ["parallel.tpp: unknown key (set by cli parallel.tpp=…); did you mean parallel.tp?"],
    ),
    ("unknown section", cli("modle.source=/m"), ["modle: unknown key", "did you mean model?"]),
    (
        "unknown key without a close match",
        cli("cache.zzz=1"),
        ["cache.zzz: unknown key", "valid keys of cache: block_size,"],
    ),
    ("wrong type", cli("frontend.port=abc"), ["frontend.port: bad value 'abc'", "expected a valid integer"]),
    (
        "out of range",
        cli("frontend.port=70000"),
        ["frontend.port: bad value 70000", "expected less than or equal to 65535"],
    ),
    (
        "section given a scalar",
        cli("scheduler=3"),
        ["scheduler: bad value 3", "expected a mapping of the keys of scheduler"],
    ),
    (
        "bad enum",
        cli("model.dtype=float33"),
        ["model.dtype: bad value 'float33'", "'auto', 'float32'", "did you mean float32?"],
    ),
    ("field validator", cli("cache.block_size=24"), ["cache.block_size: bad value 24", "expected a power of two"]),
    (
        "unknown group option",
        cli("+model=nope"),
        [
            "model=nope: unknown option of group model",
            "options: gemma2, gemma3, llama, mistral, mixtral, phi3, qwen, qwen3-moe, smollm2",
        ],
    ),
    ("misspelt group option", cli("parallel=tp3"), ["parallel=tp3: unknown option", "did you mean tp2?"]),
    ("malformed override", cli("parallel.tp=[1,2"), ["parallel.tp=[1,2: malformed override"]),
    ("sweep override", cli("parallel.tp=1,2"), ["parallel.tp=1,2: a sweep is not a config value"]),
    ("unknown delete", cli("~frontend.corz"), ["~frontend.corz: unknown key; did you mean frontend.cors?"]),
    ("bad interpolation", cli("frontend.port=${parallel.tpx}"), ["frontend.port: cannot resolve", "parallel.tpx"]),
    (
        "bad env value",
        cli(env={"PKGD_FRONTEND__PORT": "abc"}),
        ["frontend.port: bad value 'abc' (set by env PKGD_FRONTEND__PORT)"],
    ),
    (
        "bad env JSON",
        cli(env={"PKGD_FRONTEND__CORS__ALLOWED_ORIGINS": "[x"}),
        ["PKGD_FRONTEND__CORS__ALLOWED_ORIGINS: bad value '[x'"],
    ),
    (
        "conflicting LB aliases",
        cli(flags=["--data-parallel-external-lb", "--data-parallel-hybrid-lb"]),
        ["--data-parallel-external-lb and --data-parallel-hybrid-lb are mutually exclusive (both set lb.mode)"],
    ),
    (
        "unknown flag",
        cli(flags=["--tensor-paralel-size", "2"]),
        ["--tensor-paralel-size: unknown option; did you mean --tensor-parallel-size?"],
    ),
    ("flag without value", cli(flags=["--port"]), ["--port: expects a value"]),
    (
        "missing --config-dir",
        ComposeRequest(config_dir="/nonexistent/pkgd", env={}),
        ["--config-dir /nonexistent/pkgd: no such directory"],
    ),
    # seed boundaries of vllm_config.py
    (
        "headless with API servers",
        cli("frontend.headless=true", "frontend.api_server_count=2"),
        ["frontend.api_server_count: 2 conflicts with frontend.headless: true"],
    ),
    (
        "DP rank with hybrid LB",
        cli("parallel.dp=2", "parallel.dp_rank=1", "lb=hybrid"),
        ["lb.mode: hybrid conflicts with parallel.dp_rank", "mutually exclusive"],
    ),
    (
        "runtime LoRA with 2 API servers",
        cli("frontend.allow_runtime_lora_updating=true", "frontend.api_server_count=2"),
        ["frontend.allow_runtime_lora_updating: true is refused with 2 API servers"],
    ),
    (
        "runtime LoRA with derived API servers",
        cli("frontend.allow_runtime_lora_updating=true", "parallel=dp2"),
        ["refused with 2 API servers"],
    ),
    (
        "unregistered tool parser",
        cli("frontend.tool_call_parser=hermez"),
        [
            "frontend.tool_call_parser: 'hermez' is not a registered tool parser; did you mean hermes? "
            "(registered: deepseek_v3, hermes, llama3_json, mistral, pythonic, qwen3_coder)"
        ],
    ),
    ("unregistered reasoning parser", cli("frontend.reasoning_parser=nope"), ["registered: deepseek_r1, qwen3"]),
    ("trust_remote_code", cli(flags=["--trust-remote-code"]), ["model.trust_remote_code: true is refused"]),
    ("dp_local above dp", cli("parallel.dp_local=2"), ["parallel.dp_local: 2 exceeds parallel.dp: 1"]),
    ("dp_rank out of range", cli("parallel.dp_rank=1"), ["parallel.dp_rank: 1 must be below parallel.dp: 1"]),
    ("node_rank out of range", cli("parallel.node_rank=1"), ["parallel.node_rank: 1 must be below parallel.nnodes: 1"]),
    (
        "auto tool choice without parser",
        cli("frontend.enable_auto_tool_choice=true"),
        ["needs frontend.tool_call_parser"],
    ),
    (
        "token budget below max_num_seqs",
        cli("scheduler.max_num_batched_tokens=8"),
        ["scheduler.max_num_batched_tokens: 8 must be at least scheduler.max_num_seqs: 256"],
    ),
    (
        "prefill cap without chunked prefill",
        cli(flags=["--long-prefill-token-threshold", "256", "--no-enable-chunked-prefill"]),
        ["scheduler.long_prefill_token_threshold: 256 caps prefill chunks and needs scheduler.enable_chunked_prefill"],
    ),
]

TREE_CASES = [
    ("bad YAML", {"pkgd.yaml": "frontend:\n  port: 1\n   host: x\n"}, {}, ["pkgd.yaml:3:", "YAML syntax error"]),
    ("bad YAML in conf.d", {"conf.d/10-a.yaml": "a: [1\n"}, {}, ["conf.d/10-a.yaml:2:", "YAML syntax error"]),
    (
        "duplicate YAML key",
        {"pkgd.yaml": "frontend: {}\nfrontend: {}\n"},
        {},
        ["pkgd.yaml:2:1: YAML syntax error: found duplicate key"],
    ),
    ("top level not a mapping", {"pkgd.yaml": "- 1\n"}, {}, ["pkgd.yaml: expected a mapping of sections"]),
    (
        "unknown key in a system file",
        {"conf.d/10-a.yaml": "frontend: {prot: 1}\n"},
        {},
        ["frontend.prot: unknown key (set by system:conf.d/10-a.yaml); did you mean frontend.port?"],
    ),
    (
        "unknown group in a defaults list",
        {"pkgd.yaml": "defaults:\n  - modle: qwen\n"},
        {},
        ["modle: unknown config group (set by system:pkgd.yaml); did you mean model?"],
    ),
    (
        "bad defaults entry",
        {"pkgd.yaml": "defaults:\n  - [model, qwen]\n"},
        {},
        ["defaults entry", "expected 'GROUP: OPTION'"],
    ),
    ("missing --config-name", {"pkgd.yaml": ""}, {"config_name": "prod"}, ["--config-name prod: no file", "prod.yaml"]),
    (
        "bad YAML in a system option",
        {"model/mine.yaml": "source: [\n"},
        {"overrides": ("model=mine",)},
        ["model/mine.yaml:2:", "YAML syntax error"],
    ),
]


def _check(problems, expected):
    assert len(problems) == 1, problems
    for part in expected:
        assert part in problems[0], (part, problems[0])
    assert "\n" not in problems[0] and "Traceback" not in problems[0]


@pytest.mark.parametrize(("request_", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_is_one_precise_line(request_, expected):
    _check(problems_of(request_), expected)
    assert compose(cli("+model=qwen", "parallel.tp=2")).config.parallel.tp == 2  # nothing leaked


@pytest.mark.parametrize(("files", "extra", "expected"), [c[1:] for c in TREE_CASES], ids=[c[0] for c in TREE_CASES])
def test_bad_system_tree_is_one_precise_line(tree, files, extra, expected):
    root = tree(files)
    _check(problems_of(ComposeRequest(config_dir=str(root), env={}, **extra)), expected)
    good = tree({"pkgd.yaml": "frontend: {port: 9}\n", "conf.d/10-a.yaml": "{}\n", "model/mine.yaml": "source: /m\n"})
    assert compose(ComposeRequest(config_dir=str(good), env={})).config.frontend.port == 9


def test_every_problem_is_reported_at_once(tree):
    root = tree({"pkgd.yaml": "frontend: {port: 1}\n  x\n"})
    problems = problems_of(
        ComposeRequest(
            config_dir=str(root), overrides=("+model=nope", "a=[1"), flags=("--prot", "1"), env={"PKGD_MODEL": "{"}
        )
    )
    assert len(problems) == 5, problems
    problems = problems_of(cli("frontend.port=abc", "parallel.tp=0", "model.dtype=x"))
    assert [p.split(":")[0] for p in problems] == ["model.dtype", "parallel.tp", "frontend.port"]


def test_secrets_are_never_echoed():
    problems = problems_of(cli(env={"PKGD_FRONTEND__API_KEYS": '["sk-secret", 3]'}))
    assert "sk-secret" not in "\n".join(problems)
    assert "frontend.api_keys.1: bad value **********" in problems[0]


def test_an_empty_api_key_is_refused_not_accepted_as_a_key():
    problems = problems_of(cli(env={"PKGD_FRONTEND__API_KEYS": ""}))
    assert len(problems) == 1 and problems[0].startswith("frontend.api_keys: bad value ")
    assert "an API key must not be empty" in problems[0]
    problems = problems_of(cli(env={"PKGD_FRONTEND__API_KEYS": '["sk-a", " "]'}))
    assert "sk-a" not in problems[0] and "must not be empty" in problems[0]


def test_config_error_message_is_the_problem_lines():
    err = ConfigError(["a: x", "b: y"])
    assert str(err) == "a: x\nb: y" and err.problems == ["a: x", "b: y"]
