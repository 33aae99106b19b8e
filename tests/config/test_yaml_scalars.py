"""Config files: plain scalars YAML 1.1 reads otherwise than YAML 1.2 are refused, and no float
key takes infinity or NaN, from any layer."""

import math

import pytest
import yaml

from pkgd.cli.main import main
from pkgd.config import schema
from pkgd.config.compose import ComposeRequest, compose, packaged_dir
from pkgd.config.errors import ConfigError
from pkgd.config.yaml_scalars import ambiguous_scalars


def problems_of(root, **extra) -> list[str]:
    with pytest.raises(ConfigError) as info:
        compose(ComposeRequest(config_dir=str(root), env={}, **extra))
    return info.value.problems


CASES = [
    ("sexagesimal", "frontend:\n  body_timeout: 1:30\n", "frontend.body_timeout: 1:30 is the base-60 number 90", 2, 17),
    ("octal", "model: {name: 044573}\n", "model.name: 044573 is the octal number 18811", 1, 15),
    ("octal port", "frontend:\n  port: 0755\n", "frontend.port: 0755 is the octal number 493", 2, 9),
    ("no", "model:\n  name: no\n", "model.name: no is the boolean false", 2, 9),
    ("on", "cache: {enable_prefix_caching: on}\n", "cache.enable_prefix_caching: on is the boolean true", 1, 32),
    ("underscores", "scheduler: {max_num_seqs: 1_000}\n", "scheduler.max_num_seqs: 1_000 is the number 1000", 1, 27),
    ("binary", "model: {seed: 0b101}\n", "model.seed: 0b101 is the binary number 5", 1, 15),
    (
        "in a list",
        "frontend: {served_model_names: [a, 0777]}\n",
        "frontend.served_model_names.1: 0777 is the octal number 511",
        1,
        36,
    ),
]


@pytest.mark.parametrize(("text", "expected", "line", "column"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_yaml_1_1_scalar_in_a_system_file_is_refused(tree, text, expected, line, column):
    root = tree({"conf.d/10-a.yaml": text})
    [problem] = problems_of(root)
    assert problem.startswith(expected + " to YAML 1.1 "), problem
    assert f"/conf.d/10-a.yaml:{line}:{column}); quote it (" in problem


def test_quoted_and_unambiguous_scalars_compose(tree):
    root = tree(
        {
            "pkgd.yaml": """\
                model: {name: '0755', seed: 0x10, tokenizer: "no", max_model_len: null}
                frontend: {port: 8000, body_timeout: 1e2, keep_alive_timeout: .5, served_model_names: ['1:30']}
                cache: {enable_prefix_caching: false, gpu_memory_utilization: 0.5, num_blocks: ~}
                supervisor: {runtime_dir: "${oc.env:HOME}/run"}
                """
        }
    )
    c = compose(ComposeRequest(config_dir=str(root), env={})).config
    assert (c.model.name, c.model.seed, c.model.tokenizer) == ("0755", 16, "no")
    assert (c.frontend.port, c.frontend.body_timeout, c.frontend.keep_alive_timeout) == (8000, 100.0, 0.5)
    assert c.frontend.served_model_names == ["1:30"] and c.cache.enable_prefix_caching is False


def test_every_problem_of_a_file_is_reported(tree):
    root = tree({"pkgd.yaml": "frontend: {port: 0755}\nmodel: {name: yes}\n"})
    assert [p.split(":")[0] for p in problems_of(root)] == ["frontend.port", "model.name"]


def test_a_secret_is_not_echoed(tree):
    root = tree({"pkgd.yaml": "frontend:\n  api_keys: [0123456]\n"})
    [problem] = problems_of(root)
    assert "0123456" not in problem and "42798" not in problem
    assert problem.startswith("frontend.api_keys.0: the value ********** is a number to YAML 1.1 (")


def test_a_system_group_option_is_checked_under_its_section(tree):
    root = tree(
        {
            "model/mine.yaml": "source: /m\nseed: 0755\n",
            "profile/mine.yaml": "# @package _global_\nsupervisor: {drain_timeout: 1:00}\n",
        }
    )
    [problem] = problems_of(root, overrides=("model=mine",))
    assert (
        problem.startswith("model.seed: 0755 is the octal number 493 to YAML 1.1 (")
        and "/model/mine.yaml:2:7)" in problem
    )
    [problem] = problems_of(root, overrides=("profile=mine",))
    assert problem.startswith("supervisor.drain_timeout: 1:00 is the base-60 number 60 to YAML 1.1 (")


def test_packaged_files_have_no_ambiguous_scalars():
    files = sorted(packaged_dir().rglob("*.yaml"))
    assert len(files) > 5
    for path in files:
        assert ambiguous_scalars(path.read_text(), str(path)) == []


def _float_keys() -> list[str]:
    return sorted(k for k, leaf in schema.leaves().items() if "number" in leaf.types)


def test_no_float_key_takes_infinity_or_nan(tree):
    keys = _float_keys()
    assert "frontend.body_timeout" in keys and len(keys) >= 10
    data: dict = {}
    for i, key in enumerate(keys):
        *sections, name = key.split(".")
        node = data
        for s in sections:
            node = node.setdefault(s, {})
        node[name] = (math.inf, -math.inf, math.nan)[i % 3]
    root = tree({"pkgd.yaml": yaml.safe_dump(data)})
    problems = problems_of(root)
    assert sorted(p.split(":")[0] for p in problems) == keys
    assert all(p.endswith("(set by system:pkgd.yaml); expected a finite number") for p in problems), problems


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (ComposeRequest(overrides=("frontend.body_timeout=inf",), env={}), "(set by cli frontend.body_timeout=inf)"),
        (ComposeRequest(flags=("--request-timeout", "nan"), env={}), "(set by cli --request-timeout)"),
        (
            ComposeRequest(env={"PKGD_SUPERVISOR__DRAIN_TIMEOUT": "Infinity"}),
            "(set by env PKGD_SUPERVISOR__DRAIN_TIMEOUT)",
        ),
    ],
)
def test_infinity_from_the_command_line_or_the_environment_is_refused(request_, expected):
    with pytest.raises(ConfigError) as info:
        compose(request_)
    [problem] = info.value.problems
    assert expected in problem and problem.endswith("expected a finite number")


def test_config_validate_exits_2_naming_each_path(capsys, tmp_path):
    (tmp_path / "pkgd.yaml").write_text("frontend:\n  body_timeout: .inf\n  header_timeout: 1:30\n  port: 0755\n")
    assert main(["config", "validate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: frontend.header_timeout: 1:30 is the base-60 number 90 to YAML 1.1 (" in err
    assert f"{tmp_path}: frontend.port: 0755 is the octal number 493 to YAML 1.1 (" in err
    assert "quote it ('0755') to mean the text, or write 493" in err and "Traceback" not in err
    (tmp_path / "pkgd.yaml").write_text("frontend:\n  body_timeout: .inf\n  header_timeout: '90'\n")
    assert main(["config", "validate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{tmp_path}: frontend.body_timeout: bad value Infinity (set by system:pkgd.yaml); expected a finite number"
        in err
    )
