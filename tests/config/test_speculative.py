"""The ``speculative`` section (vLLM's ``--speculative-config``): its flags, keyword form,
defaults and the problems it reports with dotted paths."""

from __future__ import annotations

import pytest

from pkgd.config.compose import ComposeRequest, compose
from pkgd.config.errors import ConfigError
from pkgd.offline.llm_config import build_llm_config


def flags(*argv: str):
    return compose(ComposeRequest(flags=tuple(argv))).config


def problems(*argv: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        compose(ComposeRequest(flags=tuple(argv)))
    return info.value.problems


def test_speculative_config_json_and_its_short_forms_set_the_section():
    spec = flags("--speculative-config", '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}')
    assert (spec.speculative.method, spec.speculative.num_speculative_tokens) == ("ngram", 4)
    assert spec.speculative.lookup_range() == (4, 4)  # vLLM: one bound given = both
    assert flags("-sc", '{"method":"ngram","num_speculative_tokens":2}').speculative.lookup_range() == (5, 5)
    short = flags("--spec-model", "/m", "--spec-tokens", "3").speculative
    assert (short.method, short.model, short.num_speculative_tokens) == ("draft_model", "/m", 3)
    assert flags().speculative.enabled is False
    kw = build_llm_config(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert kw.speculative.method == "ngram"


@pytest.mark.parametrize(
    "argv, lines",
    [
        (("--spec-method", "ngram"), ["speculative.num_speculative_tokens: required with speculative.method: ngram"]),
        (
            ("-sc", '{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":6,"prompt_lookup_max":3}'),
            ["speculative.prompt_lookup_min: 6 is greater than speculative.prompt_lookup_max: 3"],
        ),
        (
            ("-sc", '{"method":"draft_model","num_speculative_tokens":2,"prompt_lookup_max":3}'),
            [
                "speculative.model: required with speculative.method: draft_model",
                "speculative.prompt_lookup_max: only for method ngram, not draft_model",
            ],
        ),
        (("--spec-tokens", "3"), ["speculative.method: null, but speculative.num_speculative_tokens is set"]),
        (
            ("--spec-model", "/m", "--spec-tokens", "2", "--tensor-parallel-size", "2"),
            ["speculative.method: draft_model runs the draft in the engine-core process and needs parallel.tp: 1"],
        ),
    ],
)
def test_inconsistent_sections_name_each_problem(argv, lines):
    found = problems(*argv)
    assert len(found) == len(lines)
    for want, got in zip(lines, found):
        assert want in got


def test_out_of_range_and_unknown_keys_are_refused():
    assert any("speculative.num_speculative_tokens" in p for p in problems("--spec-tokens", "0"))
    assert any("speculative.num_tokens: unknown key" in p for p in problems("-sc", '{"num_tokens": 3}'))
