"""The schema is the flag surface: checked-in copy, descriptions, reload classes, aliases."""

import json
from pathlib import Path

import pytest

from pkgd.config import schema
from pkgd.config.fields import ReloadClass

REPO = Path(__file__).resolve().parents[2]

# The vLLM flags the issue names; each must be an alias of some leaf.
VLLM_FLAGS = [
    "--tensor-parallel-size",
    "--data-parallel-size",
    "--max-model-len",
    "--port",
    "--host",
    "--api-server-count",
    "--headless",
    "--dtype",
    "--max-num-seqs",
    "--block-size",
    "--served-model-name",
    "--api-key",
    "--enable-prefix-caching",
    "--data-parallel-external-lb",
    "--data-parallel-hybrid-lb",
    "--model",
    "--trust-remote-code",
    "--tool-call-parser",
    "--reasoning-parser",
    "--enable-elastic-ep",
    "--allow-runtime-lora-updating",
]


def test_checked_in_schema_matches_the_models():
    checked_in = json.loads((REPO / "schemas" / "vllm_config.schema.json").read_text())
    assert checked_in == json.loads(schema.schema_text()), (
        "schemas/vllm_config.schema.json is stale: run `pkgd config schema > schemas/vllm_config.schema.json`"
    )


def test_every_leaf_has_a_description_and_a_reload_class():
    raw = json.dumps(schema.json_schema())
    for leaf in schema.leaves().values():
        assert len(leaf.description.split()) >= 3, leaf.key
        assert isinstance(leaf.reload, ReloadClass)
    assert raw.count('"x-reload"') == len(schema.leaves())  # sections carry none of their own


def test_leaf_keys_from_the_models_match_the_schema():
    assert schema.leaf_keys() == tuple(schema.leaves())


def test_leaves_cover_the_design_sections():
    keys = set(schema.leaves())
    assert {
        "model.source",
        "parallel.tp",
        "lb.mode",
        "frontend.port",
        "scheduler.max_num_seqs",
        "cache.block_size",
        "supervisor.drain_timeout",
        "logging.level",
        "model.generation.temperature",
        "frontend.cors.allowed_origins",
    } <= keys
    assert schema.children("") == (
        "model",
        "parallel",
        "lb",
        "frontend",
        "scheduler",
        "cache",
        "supervisor",
        "logging",
        "speculative",
    )


@pytest.mark.parametrize("flag", VLLM_FLAGS)
def test_vllm_flag_is_an_alias(flag):
    assert flag in schema.alias_index()


def test_alias_kinds():
    index = schema.alias_index()
    tp, const = index["--tensor-parallel-size"]
    assert (tp.key, const) == ("parallel.tp", None)
    assert index["-tp"][0] is tp
    assert [(index[f][0].key, index[f][1]) for f in ("--headless", "--no-headless")] == [
        ("frontend.headless", "true"),
        ("frontend.headless", "false"),
    ]
    assert index["--data-parallel-hybrid-lb"][0].key == "lb.mode"
    assert index["--data-parallel-hybrid-lb"][1] == "hybrid"


def test_leaf_types_and_secrets():
    leaves = schema.leaves()
    assert leaves["parallel.tp"].type_label == "int"
    assert leaves["model.max_model_len"].type_label == "int | null"
    assert leaves["model.dtype"].enum == ("auto", "float32", "bfloat16", "float16")
    assert leaves["frontend.api_keys"].secret and leaves["frontend.api_keys"].is_list
    assert leaves["frontend.cors.allowed_methods"].default == ["*"]
    assert not leaves["frontend.served_model_names"].secret
