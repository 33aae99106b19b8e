"""LLM keyword arguments → VllmConfig."""

import pytest

from pkgd.config import VllmConfig
from pkgd.host import available_cores
from pkgd.offline.llm_config import build_llm_config


def test_kwargs_by_field_name_vllm_alias_dotted_path_and_section():
    cfg = build_llm_config(
        "/models/x",
        max_model_len=512,
        tensor_parallel_size=1,
        num_gpu_blocks_override=40,
        enable_prefix_caching=False,
        scheduler={"max_num_seqs": 8},
        **{"cache.block_size": 32},
    )
    assert cfg.model.source == "/models/x" and cfg.model.max_model_len == 512
    assert cfg.cache.num_blocks == 40 and cfg.cache.block_size == 32 and not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_num_seqs == 8


def test_no_arguments_is_the_default_model_on_every_core():
    cfg = build_llm_config()
    assert cfg.model.source == VllmConfig().model.source
    assert cfg.parallel.cpu_threads == available_cores()
    assert build_llm_config(cpu_threads=1).parallel.cpu_threads == 1


def test_switch_alias():
    assert build_llm_config(data_parallel_external_lb=True).lb.mode == "external"


def test_unknown_keyword_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match="unknown option 'max_modle_len'; did you mean 'max_model_len'"):
        build_llm_config(max_modle_len=100)


def test_invalid_value_names_the_dotted_path():
    with pytest.raises(ValueError, match=r"cache\.block_size: .*power of two"):
        build_llm_config(block_size=24)
    with pytest.raises(ValueError, match=r"model\.max_model_len: .*(got 3)"):
        build_llm_config(max_model_len=3)


def test_config_plus_overrides():
    base = VllmConfig.model_validate({"cache": {"num_blocks": 99}})
    cfg = build_llm_config(config=base, max_num_seqs=4)
    assert cfg.cache.num_blocks == 99 and cfg.scheduler.max_num_seqs == 4


def test_nested_section_alias_works_as_a_keyword():
    cfg = build_llm_config(allowed_origins=["https://a.example"])
    assert cfg.frontend.cors.allowed_origins == ["https://a.example"]


def test_boolean_switch_keyword_takes_its_value():
    assert build_llm_config(enable_prefix_caching=False).cache.enable_prefix_caching is False
    assert build_llm_config(no_enable_prefix_caching=True).cache.enable_prefix_caching is False
