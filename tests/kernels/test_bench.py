"""The GPU benchmark script runs on CPU: argument parsing, a dry run (under the interpreter,
every op's Triton output against its reference) and CPU timing of the references."""

from __future__ import annotations

import pytest

from pkgd_kernels import bench

TINY = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--num-seqs",
    "2",
    "--context-len",
    "40",
    "--num-prompts",
    "2",
    "--prompt-len",
    "20",
    "--num-tokens",
    "8",
    "--num-heads",
    "4",
    "--num-kv-heads",
    "2",
    "--head-dim",
    "16",
    "--hidden",
    "64",
    "--intermediate",
    "96",
    "--vocab",
    "300",
    "--threads",
    "1",
]


def _rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in text.splitlines()[2:] if line.strip()}


def test_dry_run_checks_every_kernel_against_its_reference(triton_interpreter, capsys):
    assert bench.main(["--dry-run", *TINY]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == set(bench.OPS)
    for op, cells in rows.items():
        assert float(cells[-1]) < 1e-5, f"{op}: Triton and reference differ by {cells[-1]}"


def test_cpu_run_times_the_references(capsys):
    assert bench.main(["--ops", "rms_norm,decode", "--iters", "2", *TINY]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"rms_norm", "paged_attention_decode", "CPU:"}
    for op in ("rms_norm", "paged_attention_decode"):
        ref_ms, gbps = float(rows[op][-5]), float(rows[op][-3])
        assert ref_ms > 0 and gbps > 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ops", "decode,nope"], "unknown op(s) nope"),
        (["--num-heads", "5", "--num-kv-heads", "2"], "multiple of --num-kv-heads"),
        (["--dtype", "int8"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda"])
    assert "no CUDA device here" in capsys.readouterr().err
