"""vLLM's command line as pkgd's: every flag of ``vllm serve`` (schemas/vllm_serve_flags.json)
is mapped to a config key, accepted because it is satisfied, or refused with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkgd.cli.flags import split_argv
from pkgd.cli.main import main
from pkgd.config import schema, vllm_flags
from pkgd.config.compose import ComposeRequest, compose
from pkgd.config.errors import ConfigError
from pkgd.config.overrides import flag_arity, parse_flags

REPO = Path(__file__).resolve().parents[2]


def test_every_vllm_flag_has_an_answer_and_every_answer_a_vllm_flag():
    ref = vllm_flags.reference_nargs()
    assert len(ref) > 300 and vllm_flags.reference()["vllm_version"].startswith("0.")
    mapped = {*schema.alias_index(), *schema.section_aliases(), "--config"}
    unanswered = [f for f in ref if f not in mapped and vllm_flags.answer(f) is None]
    assert not unanswered, f"vLLM flags without an answer in pkgd.config.vllm_flags: {unanswered}"
    assert not [f for f in vllm_flags.answers() if f not in ref], "answers for flags vLLM does not have"
    both = [f for f in vllm_flags.answers() if f in mapped]
    assert not both, f"mapped by a config key now: remove their entries from pkgd.config.vllm_flags: {both}"


def test_mapped_flags_take_as_many_values_as_in_vllm():
    for flag, nargs in vllm_flags.reference_nargs().items():
        if flag not in schema.alias_index():
            continue
        arity = flag_arity(flag)
        if nargs == 0:
            assert arity == 0, flag
        elif nargs == "+":
            assert arity == "+", flag
        else:  # one value; a list key's flag also takes several (a superset of vLLM's)
            assert arity in (1, "+"), flag


def test_docs_list_is_generated_from_the_tables():
    text = (REPO / "docs" / "vllm-flags.md").read_text(encoding="utf-8")
    assert text == vllm_flags.markdown(), "regenerate: python -m pkgd.config.vllm_flags > docs/vllm-flags.md"


def _problems(*tokens: str) -> list[str]:
    return parse_flags(split_argv(tokens).flags)[1]


def test_refused_flag_is_one_line_naming_it_and_why(capsys):
    assert main(["config", "show", "--kv-transfer-config", "{}", "--enable-tower-connector-lora"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[1:] == [
        "  --kv-transfer-config: a vLLM flag pkgd does not support: pkgd has no disaggregated prefill / KV-cache "
        "transfer",
        "  --enable-tower-connector-lora: a vLLM flag pkgd does not support: pkgd's LoRA adapters are text-only "
        "(no multimodal tower or per-modality adapters)",
    ]
    # values of a refused flag never reach argparse as stray words, even nargs="+" ones
    assert _problems("--default-mm-loras", '{"image": "/x"}') == [
        "--default-mm-loras: a vLLM flag pkgd does not support: pkgd's LoRA adapters are text-only "
        "(no multimodal tower or per-modality adapters)"
    ]
    assert _problems("--compilation-config.level", "3")[0].startswith("--compilation-config: a vLLM flag")


def test_satisfied_flags_change_nothing_and_restricted_values_are_refused():
    plain = compose(ComposeRequest(env={})).config
    same = compose(
        ComposeRequest(
            env={}, flags=("--enforce-eager", "--disable-lora", "--tokenizer-mode", "hf", "-O0", "--max-log-len", "100")
        )
    ).config
    assert same == plain
    assert _problems("--tokenizer-mode", "mistral") == [
        "--tokenizer-mode mistral: a value of this vLLM flag pkgd does not support (accepted: auto, hf); "
        "pkgd tokenizes with the model's Hugging Face fast tokenizer"
    ]
    assert "(accepted: 0)" in _problems("-O3")[0]


def _config(*flags: str, **request):
    return compose(ComposeRequest(env={}, flags=flags, **request)).config


def test_vllm_spellings_of_values_and_flags():
    cfg = _config(
        "--served-model-name",
        "smol",
        "gpt-4o",
        "--api-key",
        "k1",
        "k2",
        "--max_model_len=2K",
        "--dtype",
        "half",
        "--kv-cache-memory-bytes",
        "1G",
        "--disable-prefix-caching",
        "-dpe",
    )
    assert cfg.frontend.served_model_names == ["smol", "gpt-4o"]
    assert [k.get_secret_value() for k in cfg.frontend.api_keys] == ["k1", "k2"]
    assert cfg.model.max_model_len == 2048 and cfg.model.dtype == "float16"
    assert cfg.cache.kv_cache_memory_bytes == 1 << 30 and cfg.cache.enable_prefix_caching is False
    assert cfg.lb.mode == "external"
    assert _config("--max-model-len", "-1").model.max_model_len is None
    assert _config("--max-model-len", "25.6k").model.max_model_len == 25600
    cfg = _config(
        "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level", "debug", "--shutdown-timeout", "0"
    )
    assert (cfg.logging.log_requests, cfg.logging.log_stats, cfg.logging.http_server_level) == (False, False, "debug")
    assert cfg.supervisor.drain_timeout == 0


def test_a_list_flag_stops_at_the_next_option_override_or_command():
    s = split_argv(["--served-model-name", "a", "b", "parallel.tp=2", "serve", "m"], commands=["serve"])
    assert (
        s.flags == ["--served-model-name", "a", "b"] and s.overrides == ["parallel.tp=2"] and s.rest == ["serve", "m"]
    )
    s = split_argv(["--api-key", "k", "config", "show"], commands=["config"])
    assert s.flags == ["--api-key", "k"] and s.rest == ["config", "show"]
    with pytest.raises(ConfigError, match="--served-model-name: expects a value"):
        split_argv(["--served-model-name", "--port", "1"])


def test_override_generation_config_sets_the_generation_section():
    cfg = _config("--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64}')
    assert cfg.model.generation.temperature == 0.5 and cfg.model.generation.max_tokens == 64
    with pytest.raises(ConfigError, match=r"model\.generation\.tempreature: unknown key.*did you mean"):
        _config("--override-generation-config", '{"tempreature": 0.5}')


def test_vllm_config_yaml_is_a_layer_below_the_other_arguments(tmp_path):
    path = tmp_path / "vllm.yaml"
    path.write_text(
        "port: 9123\nmax_num_seqs: 7\nserved-model-name: [a, b]\nenable-prefix-caching: false\n"
        "enforce-eager: true\nuvicorn-log-level: error\n"
    )
    cfg = _config("--port", "9200", vllm_config=str(path))
    assert cfg.frontend.port == 9200  # the explicit flag beats the file
    assert cfg.scheduler.max_num_seqs == 7 and cfg.frontend.served_model_names == ["a", "b"]
    assert cfg.cache.enable_prefix_caching is False and cfg.logging.http_server_level == "error"
    path.write_text("enable-lora: true\nlora-modules: [a=/x]\n")
    cfg = _config(vllm_config=str(path))
    assert cfg.lora.enable_lora and cfg.lora.lora_modules[0].path == "/x"
    path.write_text("fully-sharded-loras: true\n")
    with pytest.raises(ConfigError) as err:
        _config(vllm_config=str(path))
    assert err.value.problems[0].startswith(
        f"--config {path}: --fully-sharded-loras: a vLLM flag pkgd does not support"
    )
    path.write_text("max_num_seqs: many\n")
    with pytest.raises(
        ConfigError, match=r"scheduler.max_num_seqs: bad value 'many' \(set by --config .*max-num-seqs\)"
    ):
        _config(vllm_config=str(path))


def test_config_flag_is_read_anywhere_on_the_command_line(tmp_path):
    path = tmp_path / "vllm.yaml"
    path.write_text("max-num-seqs: 3\n")
    s = split_argv(["serve", "--config", str(path)])
    assert s.vllm_config == str(path) and s.rest == ["serve"]


def test_lora_flags_map_to_the_lora_section():
    cfg = _config(
        "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}',
        "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5", "--lora-dtype", "half",
    )  # fmt: skip
    lora = cfg.lora
    assert lora.enable_lora and (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (3, 32, 5)
    assert lora.lora_dtype == "float16"
    assert [(m.name, m.path, m.base_model_name) for m in lora.lora_modules] == [("a", "/x", None), ("b", "/y", "m")]
    assert _problems("--lora-modules", "nopath") == []  # the flag takes it; validation names it
    with pytest.raises(ConfigError, match="name=path or a JSON object"):
        _config("--enable-lora", "--lora-modules", "nopath")
    with pytest.raises(ConfigError, match="lora.max_cpu_loras: 1 must be at least lora.max_loras: 2"):
        _config("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1")


def test_vllm_runtime_lora_variable_sets_the_key():
    cfg = compose(ComposeRequest(env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})).config
    assert cfg.frontend.allow_runtime_lora_updating is True
    assert compose(ComposeRequest(env={})).config.frontend.allow_runtime_lora_updating is False
