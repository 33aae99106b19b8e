"""The frontend's constraint check: torch-free, xgrammar's reasons, bounded and cached."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from pkgd.frontend.structured_outputs import ConstraintValidator, check
from pkgd.sampling_params import StructuredOutputsParams as S


def test_the_check_loads_no_torch():
    code = (
        "import sys; from pkgd.frontend.structured_outputs import check; from pkgd.sampling_params import "
        "StructuredOutputsParams as S;"
        "check(S(json={'type': 'object'})); check(S(regex='[0-9]+')); check(S(grammar='root ::= \"a\"'));"
        "assert 'torch' not in sys.modules, 'torch loaded'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize(
    ("so", "words"),
    [
        (S(json={"type": "integer", "minimum": 3, "maximum": 1}), ["invalid JSON schema", "minimum"]),
        (S(json={"type": "array", "minItems": 3, "maxItems": 1}), ["minItems"]),
        (S(json={"type": "string", "minLength": -1}), ["minLength"]),
        (S(json={"enum": []}), ["enum"]),
        (S(json=False), ["schema"]),
        (
            S(
                json={
                    "type": "object",
                    "properties": {"a": {"type": "string"}},
                    "required": ["b"],
                    "additionalProperties": False,
                }
            ),
            ["never be satisfied", "'b'"],
        ),
        (
            S(json={"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)a"}}}),
            ["pattern", "Lookahead"],
        ),
        (S(json={"if": {"type": "string"}, "then": {"minLength": 1}}), ["'if'"]),
        (S(json={"type": "number", "multipleOf": 0.5}), ["multipleOf"]),
        (S(json={"allOf": [{"type": "string"}, {"type": "integer"}]}), ["allOf"]),
        (S(regex="(a"), ["invalid regex", "parenthesis"]),
        (S(regex="(?<=a)b"), ["Lookbehind"]),
        (S(grammar='root ::= "a" | undefined_rule'), ["invalid grammar", "undefined_rule"]),
        (S(choice=[]), ["choice"]),
        (S(), ["exactly one"]),
    ],
)
def test_bad_constraints_name_the_field_and_the_reason(so, words):
    with pytest.raises(ValueError) as e:
        check(so, "response_format")
    assert str(e.value).startswith("response_format") and all(w in str(e.value) for w in words), str(e.value)


def test_good_constraints_pass():
    for so in (
        S(json={"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}),
        S(json_object=True),
        S(regex=r"\d{3}-\d{4}"),
        S(choice=['say "hi"', "line\nbreak"]),
        S(grammar='root ::= [a-z]+ "!"'),
    ):
        check(so)


def test_validator_caches_verdicts_and_bounds_pending_checks():
    v = ConstraintValidator(max_workers=1, max_pending=1)

    async def go():
        with pytest.raises(ValueError, match="Unclosed"):
            await v.check(S(regex="[a-"), "guided_regex")
        with pytest.raises(ValueError, match="Unclosed"):
            await v.check(S(regex="[a-"), "guided_regex")  # from the cache
        results = await asyncio.gather(
            *(v.check(S(regex=f"x{i}"), "guided_regex") for i in range(3)), return_exceptions=True
        )
        return results

    results = asyncio.run(go())
    assert any(isinstance(r, ValueError) and "retry" in str(r) for r in results)  # only one admitted at once
    v.close()


def test_schema_nesting_is_bounded_and_running_out_of_stack_is_a_value_error(monkeypatch):
    from pkgd.frontend import structured_outputs

    schema: dict = {"type": "string"}
    for _ in range(structured_outputs.MAX_SCHEMA_DEPTH - 1):
        schema = {"type": "array", "items": schema}
    check(S(json=schema))  # at the bound: checked as any schema
    with pytest.raises(ValueError, match="nested 101 deep, more than 100"):
        check(S(json={"type": "array", "items": schema}))

    def deep(*args):
        raise RecursionError

    monkeypatch.setattr(structured_outputs, "_walk", deep)
    with pytest.raises(ValueError, match="response_format: invalid JSON schema: nested too deeply"):
        structured_outputs.check_json_schema({"type": "string"}, "response_format")
