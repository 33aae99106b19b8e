"""Splitting argv into configuration arguments (anywhere) and the subcommand's own."""

import pytest

from pkgd.cli.flags import is_override, split_argv
from pkgd.cli.keys import keys_text
from pkgd.config.errors import ConfigError


def test_overrides_and_flags_anywhere():
    s = split_argv(
        [
            "+model=qwen",
            "parallel.tp=2",
            "config",
            "show",
            "--sources",
            "-tp",
            "2",
            "~frontend.cors",
            "--port=9000",
            "--headless",
            "--format",
            "json",
        ]
    )
    assert s.rest == ["config", "show", "--sources", "--format", "json"]
    assert s.overrides == ["+model=qwen", "parallel.tp=2", "~frontend.cors"]
    assert s.flags == ["-tp", "2", "--port=9000", "--headless"]


def test_positionals_and_unknown_options_stay():
    s = split_argv(["serve", "/models/Qwen3-0.6B", "--verbose", "Qwen/Qwen3-0.6B"])
    assert s.rest == ["serve", "/models/Qwen3-0.6B", "--verbose", "Qwen/Qwen3-0.6B"]
    assert s.overrides == s.flags == []


def test_config_source_options():
    s = split_argv(["--config-dir", "/d", "config", "validate", "--config-name=prod"])
    assert (s.config_dir, s.config_name, s.rest) == ("/d", "prod", ["config", "validate"])


def test_double_dash_ends_the_scan():
    s = split_argv(["serve", "--port", "1", "--", "a=b", "--headless"])
    assert s.rest == ["serve", "--", "a=b", "--headless"] and s.flags == ["--port", "1"]


@pytest.mark.parametrize("argv", [["--port"], ["config", "--config-dir"]])
def test_missing_value_is_an_error(argv):
    with pytest.raises(ConfigError, match="expects a value"):
        split_argv(argv)


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("a=1", True),
        ("parallel.tp=2", True),
        ("+model=qwen", True),
        ("~frontend.cors", True),
        ("model/x=1", True),
        ("/models/x", False),
        ("Qwen/Qwen3-0.6B", False),
        ("./a=b", False),
        ("show", False),
    ],
)
def test_is_override(token, expected):
    assert is_override(token) is expected


def test_keys_help_mentions_types_defaults_aliases():
    text = keys_text(width=100)
    assert "  parallel.tp: int = 1   --tensor-parallel-size, -tp" in text
    assert "  lb.mode: internal|external|hybrid = internal   --data-parallel-external-lb (sets external)" in text
    assert "  frontend.api_keys: list[str] = []   --api-key" in text
