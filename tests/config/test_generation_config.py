"""model.generation_config (vLLM's --generation-config): the model's sampling defaults."""

from __future__ import annotations

import json

import pytest

from pkgd.model_files.errors import ModelSourceError
from pkgd.model_files.generation import generation_defaults


def test_auto_reads_the_model_directory_and_vllm_reads_nothing(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "max_new_tokens": 512,
                "eos_token_id": 2,
                "do_sample": True,
            }
        )
    )
    assert generation_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 512}
    assert generation_defaults("vllm", tmp_path) == {}
    other = tmp_path / "other"
    other.mkdir()
    assert generation_defaults("auto", other) == {}  # no file: no defaults
    (other / "generation_config.json").write_text('{"repetition_penalty": 1.1}')
    assert generation_defaults(str(other), tmp_path) == {"repetition_penalty": 1.1}
    with pytest.raises(ModelSourceError, match="holds no generation_config.json"):
        generation_defaults(str(tmp_path / "missing"), tmp_path)


def test_a_missing_directory_is_a_config_problem(tmp_path):
    from pkgd.config.sections import ModelConfig
    from pkgd.model_files.resolve import model_source_problems

    problems = model_source_problems(ModelConfig(generation_config=str(tmp_path)))
    assert problems == [
        f"model.generation_config: {str(tmp_path)!r} is neither auto, vllm nor a directory holding a "
        "generation_config.json"
    ]
