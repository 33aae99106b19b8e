"""`pkgd.model_files.gguf_index.scan_gguf` against the gguf package's own reader."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGUFReader
from tests.runner.test_quantized import MODELS, tiny_quantized  # noqa: F401  (fixture)
from tests.smollm2 import smollm2_gguf

from pkgd.model_files.errors import ModelSourceError
from pkgd.model_files.gguf_convert import read_gguf_tensors
from pkgd.model_files.gguf_index import scan_gguf


def _same_as_the_reader(path):
    ours, theirs = scan_gguf(path), GGUFReader(path)
    assert ours.architecture == theirs.fields["general.architecture"].contents()
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
    return ours


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_files_of_every_quantized_type_read_as_the_gguf_reader_reads_them(tiny_quantized, name):  # noqa: F811
    index = _same_as_the_reader(tiny_quantized[name])
    assert len({t.tensor_type for t in index.tensors}) >= 3  # floats and several block types


def test_the_embedded_model_reads_as_the_gguf_reader_reads_it():
    index = _same_as_the_reader(smollm2_gguf())
    assert index.architecture == "llama" and len(index.tensors) == 272


def test_broken_files_are_clear_errors_not_crashes(tmp_path, tiny_quantized):  # noqa: F811
    good = tiny_quantized["legacy"].read_bytes()
    cases = {
        "magic": b"GGUX" + good[4:],
        "version": good[:4] + struct.pack("<I", 9) + good[8:],
        "header": good[:40],  # cut inside the metadata
        "data": good[: len(good) - 64],  # the last tensor's data cut short
        "kv count": good[:16] + struct.pack("<Q", 1 << 40) + good[24:],
    }
    for what, blob in cases.items():
        path = tmp_path / f"{what}.gguf"
        path.write_bytes(blob)
        with pytest.raises(ValueError):
            scan_gguf(path)
        with pytest.raises(ModelSourceError, match="is not a valid GGUF file"):
            read_gguf_tensors(path)
