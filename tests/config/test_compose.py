"""Composition of the five layers through the real packaged `configs/` tree."""

import os
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from pkgd.config import VllmConfig
from pkgd.config.compose import ComposeRequest, compose, packaged_dir
from pkgd.config.errors import ConfigError
from pkgd.config.sections import DEFAULT_MODEL_SOURCE


def run(*overrides, flags=(), env=None, config_dir=None, config_name=None):
    return compose(
        ComposeRequest(
            config_dir=config_dir,
            config_name=config_name,
            overrides=tuple(overrides),
            flags=tuple(flags),
            env=env or {},
        )
    )


def test_defaults_serve_the_packaged_smollm2():
    c = run()
    assert c.config == VllmConfig()
    assert c.config.model.source == DEFAULT_MODEL_SOURCE
    assert c.choices == {"model": "smollm2"}
    assert c.sources["model.source"] == "packaged"
    assert {v for k, v in c.sources.items() if k != "model.source"} == {"default"}
    assert c.warnings == () and c.system_dir is None


def test_qwen_with_tensor_parallel_composes_without_weights():
    c = run("+model=qwen", "parallel.tp=2")
    assert c.config.model.source == "/var/lib/pkgd/models/Qwen3-0.6B"
    assert not Path(c.config.model.source).exists()  # config time never touches weights
    assert c.config.parallel.tp == 2
    assert c.choices["model"] == "qwen"
    assert c.sources["model.source"] == "packaged" and c.sources["parallel.tp"] == "cli"
    assert run("model=qwen", "parallel.tp=2").config == c.config  # `+` or not: the same choice


def _packaged_options():
    root = packaged_dir()
    return [(d.name, f.stem) for d in sorted(root.iterdir()) if d.is_dir() for f in sorted(d.glob("*.yaml"))]


@pytest.mark.parametrize(("group", "option"), _packaged_options())
def test_every_packaged_option_composes_and_sets_its_section(group, option):
    c = run(f"{group}={option}")
    assert c.choices[group] == option
    # A group option sets keys of its section; a profile (`# @package _global_`) of any section.
    prefix = "" if group == "profile" else group + "."
    set_keys = [k for k, layer in c.sources.items() if layer == "packaged" and k.startswith(prefix)]
    if group == "profile":
        set_keys.remove("model.source")  # the packaged default model, set by model/smollm2.yaml
    assert set_keys, f"{group}/{option}.yaml sets nothing under {group}"


def test_packaged_group_options_are_listed():
    options = {(g, o) for g, o in _packaged_options()}
    assert {
        ("model", "smollm2"),
        ("model", "qwen"),
        ("model", "llama"),
        ("parallel", "tp2"),
        ("parallel", "dp2"),
        ("lb", "internal"),
        ("lb", "external"),
        ("lb", "hybrid"),
    } <= options
    assert {g for g, _ in options} >= {"model", "parallel", "frontend", "lb"}


def test_layer_precedence_lowest_first(tree):
    root = tree(
        {
            "pkgd.yaml": "frontend: {port: 1001, host: 0.0.0.0}\nscheduler: {max_num_seqs: 8}\n",
            "conf.d/10-port.yaml": "frontend: {port: 1002}\n",
            "conf.d/20-port.yaml": "frontend: {port: 1003}\ncache: {block_size: 32}\n",
        }
    )
    c = run(config_dir=str(root))
    assert c.config.frontend.port == 1003
    assert c.sources["frontend.port"] == "system:conf.d/20-port.yaml"
    assert c.sources["frontend.host"] == "system:pkgd.yaml"
    c = run(config_dir=str(root), env={"PKGD_FRONTEND__PORT": "1004", "PKGD_SCHEDULER__MAX_NUM_SEQS": "4"})
    assert (c.config.frontend.port, c.sources["frontend.port"]) == (1004, "env")
    assert c.config.scheduler.max_num_seqs == 4
    c = run("frontend.port=1005", config_dir=str(root), env={"PKGD_FRONTEND__PORT": "1004"})
    assert (c.config.frontend.port, c.sources["frontend.port"]) == (1005, "cli")
    assert c.config.cache.block_size == 32 and c.config.frontend.host == "0.0.0.0"


def test_cli_override_and_flag_beat_env():
    env = {"PKGD_FRONTEND__PORT": "9000"}
    assert run(env=env).config.frontend.port == 9000
    assert run("frontend.port=9100", env=env).config.frontend.port == 9100
    assert run(flags=["--port", "9200"], env=env).config.frontend.port == 9200
    # flags are applied after the overrides
    assert run("frontend.port=9100", flags=["--port=9300"], env=env).config.frontend.port == 9300


def test_system_defaults_list_chooses_options_and_cli_rechooses(tree):
    root = tree(
        {
            "pkgd.yaml": "defaults:\n  - _self_\n  - model: qwen\n  - override lb: external\n"
            "model: {max_model_len: 4096}\n"
        }
    )
    c = run(config_dir=str(root))
    assert c.choices == {"model": "qwen", "lb": "external"}
    assert c.config.model.source.endswith("Qwen3-0.6B") and c.config.model.max_model_len == 4096
    assert c.plan.mode == "external_lb"
    c = run("model=llama", config_dir=str(root))
    assert c.config.model.source.endswith("Llama-3.2-1B-Instruct")
    # a value set in the system tree beats any preset, wherever the preset was chosen
    assert (c.config.model.max_model_len, c.sources["model.max_model_len"]) == (4096, "system:pkgd.yaml")


def test_system_tree_adds_group_options(tree):
    root = tree(
        {"model/mine.yaml": "source: /srv/models/mine\ndtype: float32\n", "model/qwen.yaml": "source: /shadowed\n"}
    )
    c = run("model=mine", config_dir=str(root))
    assert c.config.model.source == "/srv/models/mine"
    assert c.sources["model.dtype"] == "system:model/mine.yaml"
    assert any("model/qwen.yaml is ignored" in w for w in c.warnings)
    assert run("model=qwen", config_dir=str(root)).config.model.source.endswith("Qwen3-0.6B")


def test_config_dir_with_odd_characters(tmp_path):
    root = tmp_path / "it's a, dir"
    (root / "model").mkdir(parents=True)
    (root / "model" / "mine.yaml").write_text("source: /m\n")
    assert run("model=mine", config_dir=str(root)).config.model.source == "/m"


def test_config_name_and_conf_d_rules(tree):
    root = tree(
        {
            "pkgd.yaml": "frontend: {port: 1}\n",
            "prod.yaml": "frontend: {port: 2}\n",
            "conf.d/.hidden.yaml": "frontend: {port: 3}\n",
            "conf.d/notes.txt": "x",
            "conf.d/05-a.yaml": "logging: {level: debug}\n",
        }
    )
    c = run(config_dir=str(root), config_name="prod")
    assert c.config.frontend.port == 2 and c.config.logging.level == "debug"
    assert run(config_dir=str(root)).config.frontend.port == 1


def test_delete_resets_to_default(tree):
    root = tree({"pkgd.yaml": "frontend: {cors: {allowed_origins: ['*'], allow_credentials: true}}\n"})
    assert run(config_dir=str(root)).config.frontend.cors.allowed_origins == ["*"]
    c = run("~frontend.cors", config_dir=str(root))
    assert c.config.frontend.cors == VllmConfig().frontend.cors
    assert c.sources["frontend.cors.allowed_origins"] == "default"


def test_interpolation_between_keys():
    c = run("parallel.dp=2", "frontend.api_server_count=${parallel.dp}")
    assert c.config.frontend.api_server_count == 2


def test_vllm_flags_translate_to_keys():
    c = run(
        flags=[
            "--tensor-parallel-size",
            "2",
            "--no-enable-prefix-caching",
            "--api-key",
            "a",
            "--api-key=b",
            "-dp",
            "2",
            "--served-model-name",
            "smol",
            "--headless",
            "--data-parallel-external-lb",
            "--allowed-origins",
            '["http://x", "http://y"]',
            "--long-prefill-token-threshold",
            "256",
        ]
    )
    cfg = c.config
    assert cfg.scheduler.long_prefill_token_threshold == 256
    assert (cfg.parallel.tp, cfg.parallel.dp, cfg.cache.enable_prefix_caching) == (2, 2, False)
    assert [k.get_secret_value() for k in cfg.frontend.api_keys] == ["a", "b"]
    assert cfg.frontend.served_model_names == ["smol"] and cfg.frontend.headless
    assert cfg.lb.mode == "external" and cfg.frontend.cors.allowed_origins == ["http://x", "http://y"]
    assert c.sources["parallel.tp"] == "cli"


def test_positional_model_flag_comes_last():
    c = run("model.source=/from/override", flags=["--model", "/from/positional"])
    assert c.config.model.source == "/from/positional"


def test_env_values_lists_and_null():
    env = {
        "PKGD_FRONTEND__API_KEYS": "sk-1",
        "PKGD_FRONTEND__SERVED_MODEL_NAMES": '["a", "b"]',
        "PKGD_MODEL__MAX_MODEL_LEN": "null",
        "pkgd_logging__level": "debug",
        "PKGD_MODEL__GENERATION__TEMPERATURE": "0.5",
    }
    c = run("model.max_model_len=64", env=env)
    cfg = c.config
    assert [k.get_secret_value() for k in cfg.frontend.api_keys] == ["sk-1"]
    assert cfg.frontend.served_model_names == ["a", "b"] and cfg.logging.level == "debug"
    assert cfg.model.max_model_len == 64  # cli beats env's null
    assert cfg.model.generation.temperature == 0.5
    assert c.sources["model.generation.temperature"] == "env"


def test_env_none_reads_os_environ(monkeypatch):
    monkeypatch.setenv("PKGD_FRONTEND__PORT", "9000")
    assert compose(ComposeRequest()).config.frontend.port == 9000


def test_misspelt_env_variable_is_a_config_error():
    """A typo that would drop a setting (here: the API keys, so authentication) stops the
    start instead of warning; every misspelling is named with the variable it meant."""
    with pytest.raises(ConfigError) as err:
        run(env={"PKGD_FRONTED__API_KEYS": "sk-1", "PKGD_FRONTEND_API_KEYS": "sk-2", "PKGD_FRONTEND__API_KEY": "sk-3"})
    lines = err.value.problems
    assert (
        "PKGD_FRONTED__API_KEYS: 'fronted' is not a config section (env); did you mean PKGD_FRONTEND__API_KEYS?"
        in lines
    )
    assert any(
        line.startswith("PKGD_FRONTEND_API_KEYS: not a config variable")
        and line.endswith("did you mean PKGD_FRONTEND__API_KEYS?")
        for line in lines
    )
    assert not any("sk-" in line for line in lines)


def test_unknown_field_in_env_is_a_config_error_without_its_value():
    with pytest.raises(ConfigError) as err:
        run(env={"PKGD_FRONTEND__API_KEY": "sk-secret"})
    assert err.value.problems == [
        "frontend.api_key: unknown key (set by env PKGD_FRONTEND__API_KEY); did you mean frontend.api_keys?"
    ]


def test_pkgd_variables_that_are_not_config_pass():
    c = run(env={"PKGD_HUGEPAGES": "0", "PKGD_CPU_KERNELS": "0", "PKGD_KERNEL_CACHE": "/tmp/k", "PKGD_UNRELATED": "x"})
    assert c.warnings == ("PKGD_UNRELATED: ignored, not a pkgd setting (config variables are PKGD_<SECTION>__<FIELD>)",)


def test_non_config_env_list_matches_the_sources():
    """Every PKGD_ variable the sources read that is not a config key is in NON_CONFIG_ENV."""
    import re

    from pkgd.config.layers import NON_CONFIG_ENV

    root = Path(__file__).resolve().parents[2]
    found = set()
    for base in ("daemon/pkgd", "kernels/pkgd_kernels"):
        for path in (root / base).rglob("*.py"):
            if "/config/" in str(path):
                continue
            found |= {m for m in re.findall(r"\bPKGD_[A-Z0-9_]+\b", path.read_text()) if "__" not in m}
    assert found <= NON_CONFIG_ENV, found - NON_CONFIG_ENV


def test_cli_typo_does_not_echo_the_value():
    with pytest.raises(ConfigError) as err:
        run("frontend.api_key=sk-secret")
    assert err.value.problems == [
        "frontend.api_key: unknown key (set by cli frontend.api_key=…); did you mean frontend.api_keys?"
    ]
    with pytest.raises(ConfigError) as err:
        run("frontend.api_keys=[' ']")
    assert not any("' '" in line for line in err.value.problems)


def test_non_utf8_system_file_names_the_file(tree):
    root = tree({"pkgd.yaml": "frontend: {port: 1}\n"})
    (root / "conf.d").mkdir()
    (root / "conf.d" / "20-bad.yaml").write_bytes(b"model:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError) as err:
        run(config_dir=str(root))
    assert err.value.problems == [
        f"{root.resolve()}/conf.d/20-bad.yaml: not UTF-8 text (byte 0xe9 at offset 18); save the file as UTF-8"
    ]


def test_public_host_without_api_keys_warns():
    assert any("anyone who reaches port 8000" in w for w in run("frontend.host=0.0.0.0").warnings)
    assert not run("frontend.host=0.0.0.0", "frontend.api_keys=[sk-1]").warnings
    assert not run("frontend.host=::1").warnings


def test_serve_plan_warning_is_reported():
    c = run("parallel.dp=4", "parallel.enable_elastic_ep=true")
    assert c.plan.api_server_count == 1
    assert any("capped to 1" in w for w in c.warnings)


def test_compose_leaves_no_state_behind(tmp_path, monkeypatch, tree):
    monkeypatch.chdir(tmp_path)
    root = tree({"pkgd.yaml": "frontend: {port: 1}\n", "model/mine.yaml": "source: /m\n"})
    before = sorted(os.listdir(tmp_path))
    first = run("model=mine", config_dir=str(root))
    assert not GlobalHydra.instance().is_initialized()
    assert os.getcwd() == str(tmp_path) and sorted(os.listdir(tmp_path)) == before  # no outputs/
    (root / "pkgd.yaml").write_text("frontend: {port: 2}\n")  # an edit before SIGHUP
    second = run("model=mine", config_dir=str(root))
    assert (first.config.frontend.port, second.config.frontend.port) == (1, 2)


def test_profiles_overlay_any_section_and_stay_below_the_system_tree(tree):
    dev = run("profile=dev")
    assert (dev.config.logging.format, dev.config.logging.log_requests) == ("console", True)
    assert dev.sources["logging.format"] == "packaged" and dev.choices["profile"] == "dev"
    root = tree({"pkgd.yaml": "defaults:\n  - profile: prod\nlogging:\n  level: warning\n"})
    prod = run(config_dir=str(root))
    assert (prod.config.logging.format, prod.config.logging.level) == ("json", "warning")
    assert prod.config.supervisor.drain_timeout == 30.0
    assert prod.sources["logging.level"] == "system:pkgd.yaml"


def test_cpu_knobs_are_config_keys_with_an_environment_form():
    c = run(
        env={
            "PKGD_PARALLEL__CPU_KERNELS": "false",
            "PKGD_PARALLEL__CPU_HUGE_PAGES": "0",
            "PKGD_PARALLEL__CPU_KERNEL_CACHE": "/srv/kernels",
        }
    )
    p = c.config.parallel
    assert (p.cpu_kernels, p.cpu_huge_pages, p.cpu_kernel_cache) == (False, False, "/srv/kernels")
    assert c.sources["parallel.cpu_kernels"] == "env"


def test_vllm_api_key_sets_the_api_keys_below_pkgd_variable_and_command_line(tree):
    """vLLM's VLLM_API_KEY means --api-key (vLLM: the flag, else the variable); pkgd's own
    PKGD_FRONTEND__API_KEYS beats it, and it beats the system tree like any variable."""

    def keys(c):
        return [k.get_secret_value() for k in c.config.frontend.api_keys], c.sources["frontend.api_keys"]

    root = tree({"pkgd.yaml": "frontend: {api_keys: [sk-file]}\n"})
    assert keys(run(env={"VLLM_API_KEY": "sk-v"})) == (["sk-v"], "env:VLLM_API_KEY")
    assert keys(run(config_dir=str(root), env={"VLLM_API_KEY": "sk-v"})) == (["sk-v"], "env:VLLM_API_KEY")
    both = {"VLLM_API_KEY": "sk-v", "PKGD_FRONTEND__API_KEYS": '["sk-p1", "sk-p2"]'}
    assert keys(run(env=both)) == (["sk-p1", "sk-p2"], "env")
    assert keys(run(flags=["--api-key", "sk-c"], env=both)) == (["sk-c"], "cli")
    assert keys(run(env={"VLLM_API_KEY": ""})) == ([], "default")  # empty = unset, as in vLLM


def test_a_bad_vllm_api_key_is_named_without_its_value():
    with pytest.raises(ConfigError) as err:
        run(env={"VLLM_API_KEY": " "})
    [line] = err.value.problems
    assert line.startswith("frontend.api_keys: bad value ********** (set by env VLLM_API_KEY); ")


READ_BY_CONFIG = {"PKGD_HOST": "127.0.0.2", "PKGD_MODEL_DIR": "/models/m"}  # a warning, a misspelling if unread
LAYERS_READING_ENV = {
    "system file": (
        {"pkgd.yaml": "frontend: {host: '${oc.env:PKGD_HOST}'}\nmodel: {source: '${oc.env:PKGD_MODEL_DIR}'}\n"},
        {},
    ),
    "group options": (
        {
            "frontend/mine.yaml": "host: ${oc.env:PKGD_HOST}\n",
            "model/mine.yaml": "source: ${oc.env:PKGD_MODEL_DIR,/x}\n",
        },
        {"overrides": ("frontend=mine", "model=mine")},
    ),
    "overrides": ({}, {"overrides": ("frontend.host=${oc.env:PKGD_HOST}", "model.source=${oc.env: PKGD_MODEL_DIR}")}),
    "vLLM flags": ({}, {"flags": ("--host", "${oc.env:PKGD_HOST}", "--model", "${oc.env:'PKGD_MODEL_DIR'}")}),
    "vLLM --config": (
        {"vllm.yaml": "host: ${oc.env:PKGD_HOST}\nmodel: ${oc.env:PKGD_MODEL_DIR}\n"},
        {"vllm_config": True},
    ),
    "environment": (
        {},
        {"env": {"PKGD_FRONTEND__HOST": "${oc.env:PKGD_HOST}", "PKGD_MODEL__SOURCE": "${oc.env:PKGD_MODEL_DIR}"}},
    ),
}


@pytest.mark.parametrize("layer", LAYERS_READING_ENV)
def test_variables_a_config_reads_are_not_taken_for_settings(tree, monkeypatch, layer):
    """``${oc.env:VAR}`` in any composed layer reads VAR on purpose: no 'not a pkgd setting'
    warning, no misspelt-variable error."""
    files, extra = LAYERS_READING_ENV[layer]
    root = tree({"conf.d/.keep.yaml": "", **files})
    for name, value in READ_BY_CONFIG.items():
        monkeypatch.setenv(name, value)  # what OmegaConf's oc.env reads
    if extra.pop("vllm_config", False):
        extra["vllm_config"] = str(root / "vllm.yaml")
    extra["env"] = {**READ_BY_CONFIG, **extra.get("env", {})}
    c = compose(ComposeRequest(config_dir=str(root), **extra))
    assert (c.config.frontend.host, c.config.model.source) == ("127.0.0.2", "/models/m")
    assert not any("PKGD_" in w for w in c.warnings), c.warnings


def test_variables_no_config_reads_are_still_checked():
    assert "PKGD_HOST: ignored, not a pkgd setting" in run(env={"PKGD_HOST": "x"}).warnings[0]
    with pytest.raises(ConfigError) as err:
        run("frontend.host=${oc.env:PKGD_HOST}", env={"PKGD_HOST": "x", "PKGD_MODEL_DIR": "/m"})
    assert [line.split(":")[0] for line in err.value.problems] == ["PKGD_MODEL_DIR"]
