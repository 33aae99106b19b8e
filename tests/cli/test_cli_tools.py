"""pkgd collect-env, pkgd launch render, and bench latency's statistics."""

from __future__ import annotations

import json

import pytest

from pkgd.benchmarks.latency import summarize
from pkgd.cli.main import main
from pkgd.config.compose import ComposeRequest, compose


def test_collect_env_reports_versions_cpu_kernels_and_the_config_digest(capsys):
    assert main(["collect-env", "--json", "--max-num-seqs", "7"]) == 0
    report = json.loads(capsys.readouterr().out)
    host, engine, config = report["host"], report["engine"], report["config"]
    assert host["versions"]["python"] and host["versions"]["torch"] == engine["torch"]
    assert "triton" in host["versions"] and "pkgd" in host["versions"]
    assert host["memory"]["total_bytes"] > 0 and host["cpu"]["cores_available"] >= 1
    if "flags" in host["cpu"] and "avx2" in host["cpu"]["flags"]:
        assert {"avx512f", "amx_tile", "avx512_bf16"} <= set(host["cpu"]["flags"])
    assert engine["engine_device"] in ("cpu", "cuda") and engine["kernels"]
    # the choice the engine would make for the embedded model: auto, a dtype and its reason
    assert engine["dtype"]["requested"] == "auto" and engine["dtype"]["dtype"] in ("float32", "bfloat16")
    assert engine["dtype"]["reason"]
    expected = compose(ComposeRequest(flags=("--max-num-seqs", "7"))).config.digest()
    assert config["digest"] == expected and "scheduler.max_num_seqs" in config["keys_set_by_layer"]["cli"]


def test_collect_env_never_prints_config_values(capsys):
    assert main(["collect-env", "--api-key", "sk-secret-123"]) == 0
    out = capsys.readouterr().out
    assert "sk-secret-123" not in out and "frontend.api_keys" in out


def test_launch_render_prints_the_templated_prompt(capsys, tmp_path):
    assert main(["launch", "render", "--message", "user:What is the capital of France?"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("<|im_start|>system\n") and text.rstrip().endswith("<|im_start|>assistant")
    body = tmp_path / "req.json"
    body.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False}))
    assert main(["launch", "render", "--request", str(body), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["prompt"].rstrip().endswith("assistant") and out["num_tokens"] == len(out["prompt_token_ids"]) > 5
    body.write_text(json.dumps({"messages": []}))
    assert main(["launch", "render", "--request", str(body)]) == 2
    assert "not a chat completions request: messages" in capsys.readouterr().err


def test_launch_render_input_mistakes_exit_2_naming_them(capsys, tmp_path):
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("garbage")
    for argv, words in (
        (["--request", str(garbage)], "not JSON"),
        (["--request", str(tmp_path / "missing.json")], "cannot read the request"),
        (["--message", "nocolon"], "expected ROLE:TEXT"),
    ):
        assert main(["launch", "render", *argv]) == 2, argv
        assert words in capsys.readouterr().err, argv


def test_new_commands_are_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "collect-env" in out and "launch" in out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "latency" in capsys.readouterr().out


def test_latency_summary_matches_numpy_percentiles():
    res = summarize([4.0, 1.0, 3.0, 2.0])
    assert res.avg_latency == 2.5
    assert (
        res.percentiles["50"] == 2.5
        and res.percentiles["10"] == pytest.approx(1.3)
        and res.percentiles["99"] == pytest.approx(3.97)
    )
