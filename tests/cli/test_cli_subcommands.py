"""The subcommand table: lazily listed modules, and no option that shadows a config flag."""

import argparse
import importlib

import pytest

from pkgd.cli.main import SUBCOMMANDS, available_subcommands, build_parser, main
from pkgd.config.schema import alias_index
from pkgd.config.vllm_flags import reference_nargs

AVAILABLE = available_subcommands()


def test_only_existing_modules_are_listed(monkeypatch, capsys):
    monkeypatch.setitem(SUBCOMMANDS, "frobnicate", ("pkgd.cli.no_such_module", "not written yet"))
    assert "frobnicate" not in available_subcommands()
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "frobnicate" not in capsys.readouterr().out
    assert {"serve", "config"} <= set(AVAILABLE)


@pytest.mark.parametrize("name", sorted(AVAILABLE))
def test_module_declares_its_commands(name):
    module = importlib.import_module(AVAILABLE[name][0])
    names = [cmd.name for cmd in module.cmd_init()]
    assert name in names
    assert {n for n, (m, _) in SUBCOMMANDS.items() if m == module.__name__} == set(names)


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:  # argparse exposes no public walk over its options
        yield from action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)


@pytest.mark.parametrize("name", sorted(AVAILABLE))
def test_no_subcommand_option_shadows_a_config_flag(name):
    parser, commands = build_parser(name, with_help_text=False)
    assert name in commands
    clashes = set(_options(parser)) & {*alias_index(), *reference_nargs()}
    assert not clashes, f"options of `pkgd {name}` are config flags, taken out before argparse: {clashes}"


def test_config_show_in_process(capsys, tmp_path):
    assert main(["config", "show", "--config-dir", str(tmp_path), "cache.block_size=32"]) == 0
    assert "  block_size: 32\n" in capsys.readouterr().out


def test_misspelt_command_is_not_served_as_a_model(capsys):
    assert main(["confg", "show"]) == 2
    assert "pkgd: error: unknown command 'confg'; did you mean config?" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("pkgd ")


def test_validate_without_path_checks_the_default_tree(capsys, tmp_path):
    (tmp_path / "pkgd.yaml").write_text("frontend: {port: 70000}\n")
    assert main(["config", "validate", "--config-dir", str(tmp_path)]) == 2
    assert f"{tmp_path}: frontend.port: bad value 70000 (set by system:pkgd.yaml)" in capsys.readouterr().err
    (tmp_path / "pkgd.yaml").write_text("frontend: {port: 7000}\n")
    assert main(["config", "validate", "--config-dir", str(tmp_path)]) == 0


def test_validate_catches_a_misspelt_env_variable(capsys, tmp_path, monkeypatch):
    (tmp_path / "pkgd.yaml").write_text("frontend: {port: 7000}\n")
    monkeypatch.setenv("PKGD_FRONTED__API_KEYS", "sk-1")
    assert main(["config", "validate", "--config-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        "PKGD_FRONTED__API_KEYS: 'fronted' is not a config section (env); did you mean PKGD_FRONTEND__API_KEYS?" in err
    )
    assert "sk-1" not in err


def test_config_show_sources_names_vllm_api_key_without_its_value(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-from-vllm-env")
    assert main(["config", "show", "--sources", "--config-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  api_keys: ['**********']  # env:VLLM_API_KEY\n" in out and "sk-from-vllm-env" not in out
    assert main(["config", "show", "--sources", "--format", "json", "--config-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert '"frontend.api_keys": "env:VLLM_API_KEY"' in out and "sk-from-vllm-env" not in out


def test_validate_checks_the_host_only_when_asked(capsys, tmp_path, monkeypatch):
    """A CI runner validates a tree for a bigger server (exit 0); on the serving host
    --check-host refuses what `pkgd serve` would, a KV budget beyond its memory among them."""
    monkeypatch.setattr("pkgd.host.mem_total_bytes", lambda: 8 << 30)
    (tmp_path / "pkgd.yaml").write_text("cache: {kv_cache_memory_bytes: 64G}\nparallel: {device: cpu}\n")
    assert main(["config", "validate", str(tmp_path)]) == 0
    assert f"{tmp_path}: ok" in capsys.readouterr().out
    assert main(["config", "validate", "--check-host", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert f"{tmp_path}: cache.kv_cache_memory_bytes: 64.0 GiB of KV cache is more than this host's 8.0 GiB" in err
    assert "ok" not in out
    (tmp_path / "pkgd.yaml").write_text("cache: {kv_cache_memory_bytes: 4G}\nmodel: {source: /nowhere/m.gguf}\n")
    assert main(["config", "validate", "--check-host", str(tmp_path)]) == 2
    assert f"{tmp_path}: model.source: model source '/nowhere/m.gguf'" in capsys.readouterr().err
