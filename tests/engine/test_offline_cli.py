"""pkgd bench throughput and pkgd run-batch as real processes on SmolLM2 (small workloads)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("pkgd.runner.model_runner")

pytestmark = pytest.mark.slow

# model.quantization=none: the dequantized float path, whose greedy answers (Paris) the assertions
# expect; the quantized path is tested in its own tests.
SMALL = ["cache.num_blocks=64", "model.quantization=none", "--max-model-len", "512"]


def pkgd(*args, timeout=600):
    """``pkgd ARGS`` in a child process (config overrides go through the real composition)."""
    return subprocess.run(
        [sys.executable, "-m", "pkgd.cli.main", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_bench_throughput_prints_every_figure(tmp_path):
    out_json, png, earlier = tmp_path / "fig.json", tmp_path / "fig.png", tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"output_tokens_per_s": 1.0, "requests_per_s": 0.5, "ttft_s": {"median": 0.1}}))
    p = pkgd(
        "bench",
        "throughput",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--ignore-eos",
        "--single-stream-len",
        "16",
        "--baseline",
        "hf",
        "--hf-batch-size",
        "2",
        "--output-json",
        str(out_json),
        "--plot",
        str(png),
        "--compare",
        str(earlier),
        *SMALL,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for words in (
        "Throughput:",
        "requests/s",
        "output tokens/s",
        "Peak RSS",
        "GEMM",
        "Roofline:",
        "Single stream",
        "bandwidth bound",
        "read between its steps",
        "best read just before/after",
        "HF generate()",
        "pkgd / HF output tokens/s",
        "TTFT",
        "Latency",
        "pkgd / earlier: ",
        f"plot: {png}",
    ):
        assert words in p.stdout, p.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = json.loads(out_json.read_text())
    assert fig["output_tokens"] == 16 and fig["prompt_tokens"] == 64
    assert 0 < fig["ttft_s"]["median"] <= fig["latency_s"]["median"] <= fig["elapsed_s"]
    assert 0 < fig["roofline_fraction"] and fig["gemm_flops"] > 1e9 and fig["hf_output_tokens_per_s"] > 0
    assert fig["read_bandwidth_bytes_per_s"] > 1e9 and fig["best_read_bandwidth_bytes_per_s"] > 1e9
    assert 0 < fig["single_stream_fraction"] and 0 < fig["single_stream_fraction_of_best_read"]


def test_run_batch_writes_one_result_per_line(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16,
                "temperature": 0,
            },
        },
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "1, 2, 3,", "max_tokens": 4}},
        {"custom_id": "c", "method": "POST", "url": "/v1/nope", "body": {}},
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    p = pkgd("run-batch", "-i", str(src), "-o", str(dst), "--no-progress", *SMALL)
    assert p.returncode == 0, p.stderr[-3000:]
    res = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in res] == ["a", "b", "c"]
    assert "Paris" in res[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert res[1]["response"]["body"]["usage"]["completion_tokens"] == 4
    assert res[2]["response"]["status_code"] == 400


def test_bench_latency_percentiles_over_iterations(tmp_path):
    out_json = tmp_path / "lat.json"
    p = pkgd(
        "bench",
        "latency",
        "--batch-size",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--n",
        "2",
        "--num-iters",
        "3",
        "--num-iters-warmup",
        "1",
        "--output-json",
        str(out_json),
        *SMALL,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Avg latency:" in p.stdout and "99% percentile latency:" in p.stdout
    fig = json.loads(out_json.read_text())
    assert len(fig["latencies"]) == 3 and set(fig["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(fig["latencies"]) <= fig["percentiles"]["50"] <= max(fig["latencies"])
