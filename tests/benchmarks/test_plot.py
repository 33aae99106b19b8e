"""`pkgd.benchmarks.plot`: figures of a run (or an earlier run's JSON) drawn as a PNG."""

import importlib.util
import json

import pytest

from pkgd.benchmarks import plot
from pkgd.cli.main import main

SERVE = {
    "requests_per_s": 4.0,
    "output_tokens_per_s": 512.0,
    "total_tokens_per_s": 1024.0,
    "ttft_s": {"median": 0.05, "mean": 0.06, "p99": 0.2},
    "tpot_s": {"median": 0.01, "mean": 0.01, "p99": 0.03},
    "itl_s": {"median": float("nan"), "mean": float("nan"), "p99": float("nan")},
    "model": "m",
}
PNG = b"\x89PNG\r\n\x1a\n"


def test_series_from_figures_keeps_known_finite_figures():
    s = plot.series_from_figures(SERVE, "now")
    assert s.throughput == {"requests/s": 4.0, "output tokens/s": 512.0, "total tokens/s": 1024.0}
    assert s.latency == {
        "TTFT": {"median": 0.05, "mean": 0.06, "p99": 0.2},
        "TPOT": {"median": 0.01, "mean": 0.01, "p99": 0.03},
    }
    hf = plot.series_from_figures({"hf_output_tokens_per_s": 100.0, "output_tokens_per_s": 7.0}, "HF", prefix="hf_")
    assert hf.throughput == {"output tokens/s": 100.0} and hf.latency == {}


def test_plot_runs_writes_a_png_with_a_baseline_and_an_earlier_run(tmp_path):
    earlier = tmp_path / "yesterday.json"
    earlier.write_text(json.dumps({**SERVE, "output_tokens_per_s": 256.0}))
    runs = [
        plot.series_from_figures(SERVE, "pkgd"),
        plot.Series("baseline", {"output tokens/s": 128.0}),
        plot.load_previous(earlier),
    ]
    out = plot.plot_runs(runs, tmp_path / "run.png", title="test")
    data = out.read_bytes()
    assert data[:8] == PNG and len(data) > 10_000
    assert plot.compare_lines(runs) == [
        "pkgd / baseline: output tokens/s 4.00x",
        "pkgd / yesterday: requests/s 1.00x, output tokens/s 2.00x, total tokens/s 1.00x",
    ]


def test_an_earlier_run_must_hold_figures(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="no benchmark figures"):
        plot.load_previous(bad)
    with pytest.raises(ValueError, match="cannot read"):
        plot.load_previous(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.plot_runs([plot.Series("empty")], tmp_path / "x.png", title="t")


def test_bench_refuses_bad_plot_arguments_before_running(capsys, tmp_path, monkeypatch):
    assert main(["bench", "serve", "--compare", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: cannot read a previous run" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["bench", "throughput", "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'pkgd[plot]'" in capsys.readouterr().err
