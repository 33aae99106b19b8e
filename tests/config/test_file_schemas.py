"""The YAML files' schemas: checked in, named by every file's modeline, and applied by
``check-jsonschema`` as a user's editor or CI would apply them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pkgd.config import file_schemas

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "schemas"
YAML_FILES = sorted(
    p for d in ("configs", "systemd") for p in (REPO / d).rglob("*") if p.name.endswith((".yaml", ".yaml.example"))
)
MODELINE = re.compile(r"^# yaml-language-server: \$schema=(\S+)$", re.M)


def _check_jsonschema() -> list[str]:
    exe = Path(sys.executable).with_name("check-jsonschema")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("check-jsonschema")
    if found is None:
        pytest.skip("check-jsonschema is not installed (test extras)")
    return [found]


def _check(schema: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    # --default-filetype yaml: the .yaml.example file is YAML too.
    cmd = [*_check_jsonschema(), "--default-filetype", "yaml", "--schemafile", str(schema), *map(str, files)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _schema_of(path: Path) -> Path:
    match = MODELINE.search(path.read_text())
    assert match, f"{path.relative_to(REPO)} has no yaml-language-server modeline"
    return (path.parent / match.group(1)).resolve()


def test_checked_in_file_schemas_match_the_models():
    stale = []
    expected = {SCHEMAS / file_schemas.FILE_SCHEMA: file_schemas.file_schema()}
    for section in file_schemas.group_sections():
        expected[SCHEMAS / "groups" / f"{section}.schema.json"] = file_schemas.group_schema(section)
    for path, want in expected.items():
        if not path.is_file() or json.loads(path.read_text()) != want:
            stale.append(str(path.relative_to(REPO)))
    assert not stale, f"regenerate with `pkgd config schema --file` / `--group SECTION`: {stale}"


def test_every_yaml_file_names_an_existing_schema():
    assert len(YAML_FILES) >= 14
    for path in YAML_FILES:
        assert _schema_of(path).is_file(), path


def test_group_options_point_at_their_group_schema_and_profiles_at_the_file_schema():
    for path in YAML_FILES:
        rel = path.relative_to(REPO)
        group = rel.parts[1] if rel.parts[0] == "configs" and len(rel.parts) == 3 else None
        want = f"groups/{group}.schema.json" if group and group != "profile" else file_schemas.FILE_SCHEMA
        assert _schema_of(path).as_posix().endswith(want), rel


def test_check_jsonschema_accepts_every_yaml_file_in_the_repository():
    by_schema: dict[Path, list[Path]] = {}
    for path in YAML_FILES:
        by_schema.setdefault(_schema_of(path), []).append(path)
    for schema, files in by_schema.items():
        result = _check(schema, *files)
        assert result.returncode == 0, result.stdout + result.stderr


GROUP = SCHEMAS / "groups" / "parallel.schema.json"
FILE = SCHEMAS / file_schemas.FILE_SCHEMA


@pytest.mark.parametrize(
    "schema, text",
    [
        (FILE, "frontend:\n  prot: 9000\n"),  # a system file / conf.d fragment: a key typo
        (FILE, "fronted:\n  port: 9000\n"),  # a section typo
        (FILE, "defaults:\n  - model: 3\n"),  # a defaults list entry that is no option name
        (FILE, "logging:\n  level: loud\n"),  # a value outside an enum
        (GROUP, "tpp: 2\n"),  # a group option file
        (GROUP, "tp: two\n"),  # a wrong type that is no interpolation either
    ],
)
def test_a_typo_in_each_kind_of_file_is_rejected(tmp_path, schema, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert _check(schema, path).returncode == 1


def test_interpolations_defaults_lists_and_profiles_are_accepted(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(
        "defaults:\n  - _self_\n  - model: qwen\n  - override /profile: prod\n"
        "frontend:\n  port: ${oc.env:PORT,8000}\n  api_keys: ['${oc.env:KEY}']\n"
    )
    result = _check(FILE, path)
    assert result.returncode == 0, result.stdout
    group = tmp_path / "tp4.yaml"
    group.write_text("defaults:\n  - _self_\ntp: ${oc.env:TP}\n")
    assert _check(GROUP, group).returncode == 0
