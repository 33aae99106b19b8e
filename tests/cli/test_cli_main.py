"""`pkgd` in real processes: help from the schema, the done-when commands, no torch imported."""

import json
from pathlib import Path

import yaml

from pkgd.config import schema

REPO = Path(__file__).resolve().parents[2]


def test_config_keys_lists_every_leaf_and_alias_without_heavy_imports(pkgd):
    r = pkgd("config", "keys")
    assert r.rc == 0, r.err
    assert r.heavy == []  # not even Hydra
    for leaf in schema.leaves().values():
        assert f"  {leaf.key}: {leaf.type_label}" in r.out
        for alias in leaf.aliases:
            assert alias.split("=")[0] in r.out
    assert "model: gemma2, gemma3, llama, mistral, mixtral, phi3, qwen, qwen3-moe, smollm2*" in r.out
    assert r.out.count("\nfrontend: ") == 1  # one heading, though frontend.cors sits among its fields


def test_config_keys_of_one_section(pkgd):
    r = pkgd("config", "keys", "frontend.cors")
    assert r.rc == 0 and "  frontend.cors.allowed_origins: list[str] = []   --allowed-origins" in r.out
    assert "frontend.port" not in r.out and "config groups" not in r.out
    r = pkgd("config", "keys", "frontnd")
    assert r.rc == 2 and "frontnd: no such section or key; did you mean frontend?" in r.err


def test_help_shows_commands_and_common_flags_on_a_screen(pkgd):
    for args in (("--help",), ("serve", "--help")):
        r = pkgd(*args, env={"COLUMNS": "80"})
        assert r.rc == 0 and r.heavy == []
        assert len(r.out.splitlines()) <= 60, r.out
        assert "  --port PORT" in r.out and "frontend.port = 8000" in r.out
        assert "pkgd config keys" in r.out and "examples:" in r.out
    r = pkgd("--help")
    assert all(name in r.out for name in ("serve", "config", "bench", "run-batch", "status", "reload"))


def test_overrides_before_the_subcommand_show_sources(pkgd, config_tree):
    empty = config_tree("etc", {})
    r = pkgd("+model=qwen", "parallel.tp=2", "config", "show", "--sources", "--config-dir", str(empty))
    assert r.rc == 0, r.err
    assert "torch" not in r.heavy
    assert "  source: /var/lib/pkgd/models/Qwen3-0.6B  # packaged\n" in r.out
    assert "  tp: 2  # cli\n" in r.out
    assert "  port: 8000  # default\n" in r.out
    assert yaml.safe_load(r.out)["parallel"]["tp"] == 2  # the output is YAML


def test_env_port_and_cli_override_beats_it(pkgd):
    env = {"PKGD_FRONTEND__PORT": "9000"}
    assert yaml.safe_load(pkgd("config", "show", env=env).out)["frontend"]["port"] == 9000
    r = pkgd("config", "show", "frontend.port=9100", "--sources", env=env)
    assert "  port: 9100  # cli\n" in r.out
    r = pkgd("--port", "9200", "config", "show", "--format", "json", "--sources", env=env)
    data = json.loads(r.out)
    assert data["config"]["frontend"]["port"] == 9200 and data["sources"]["frontend.port"] == "cli"


def test_secrets_are_redacted(pkgd):
    r = pkgd("config", "show", "--format", "json", env={"PKGD_FRONTEND__API_KEYS": "sk-very-secret"})
    assert r.rc == 0 and "sk-very-secret" not in r.out + r.err
    assert json.loads(r.out)["frontend"]["api_keys"] == ["**********"]


def test_schema_command_matches_checked_in_file(pkgd):
    r = pkgd("config", "schema")
    assert r.rc == 0 and r.heavy == []
    assert json.loads(r.out) == json.loads((REPO / "schemas" / "vllm_config.schema.json").read_text())


def test_validate_for_gitops(pkgd, config_tree):
    good = config_tree(
        "good",
        {
            "pkgd.yaml": "defaults:\n  - model: qwen\nfrontend: {port: 9000}\n",
            "conf.d/10-tp.yaml": "parallel: {tp: 2}\n",
        },
    )
    bad = config_tree("bad", {"pkgd.yaml": "frontend:\n  port: 1\n   x: 2\n"})
    typo = config_tree("typo", {"prod.yaml": "parallel: {tpp: 2}\n"})
    r = pkgd("config", "validate", str(good))
    assert r.rc == 0 and f"{good}: ok (serve mode single" in r.out
    assert "torch" not in r.heavy
    r = pkgd("config", "validate", str(good), str(bad), str(typo / "prod.yaml"))
    assert r.rc == 2
    assert f"{bad}: {bad}/pkgd.yaml:3:" in r.err and "YAML syntax error" in r.err
    assert (
        f"{typo / 'prod.yaml'}: parallel.tpp: unknown key (set by system:prod.yaml); did you mean parallel.tp?" in r.err
    )
    assert "Traceback" not in r.err
    assert pkgd("config", "validate", str(typo / "missing.yaml")).rc == 2


def test_diff_says_what_a_reload_restarts(pkgd, config_tree):
    a = config_tree("a", {"pkgd.yaml": "frontend: {port: 8000}\n"})
    b = config_tree("b", {"pkgd.yaml": "frontend: {port: 9000}\nlogging: {level: debug}\n"})
    c = config_tree("c", {"pkgd.yaml": "parallel: {tp: 2}\n"})
    r = pkgd("config", "diff", str(a), str(b))
    assert r.rc == 1 and "torch" not in r.heavy
    assert "frontend.port: 8000 -> 9000  [api]" in r.out and "logging.level: info -> debug  [live]" in r.out
    assert "reload: api: rolling restart of the API servers" in r.out
    assert "reload: engine:" in pkgd("config", "diff", str(a), str(c)).out
    r = pkgd("config", "diff", str(a), str(a))
    assert r.rc == 0 and "a reload would do nothing" in r.out


def test_bad_config_exits_2_before_anything_heavy(pkgd):
    r = pkgd("parallel.tpp=2", "--tensor-parallel-size", "2")
    assert r.rc == 2
    assert r.err == (
        "pkgd: invalid configuration (1 problem):\n"
        "  parallel.tpp: unknown key (set by cli parallel.tpp=…); did you mean parallel.tp?\n"
    )
    assert "torch" not in r.heavy


def test_usage_errors_exit_2(pkgd):
    r = pkgd("config", "show", "--format", "xml")
    assert r.rc == 2 and "invalid choice" in r.err
    r = pkgd("config", "show", "--port")
    assert r.rc == 2 and "--port: expects a value" in r.err


def test_python_dash_m_exits_2_on_a_usage_error_as_the_console_script():
    """Run as ``python -m pkgd.cli.main`` the module is __main__ and also imported as
    pkgd.cli.main; a subcommand's UsageError must still be the one caught (exit 2)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pkgd.cli.main", "bench", "serve", "--max-num-seqs", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("pkgd: error: bench serve") and "Traceback" not in done.stderr
