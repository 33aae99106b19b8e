"""The systemd units and the example /etc/pkgd tree."""

from __future__ import annotations

import configparser
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pkgd.config.sections import SupervisorConfig
from pkgd.config.vllm_config import VllmConfig
from pkgd.supervisor.supervisor import API_STOP_EXTRA, ENGINE_STOP_GRACE

SYSTEMD = Path(__file__).parents[2] / "systemd"
UNITS = ["pkgd.service", "pkgd@.service"]


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#",))
    parser.optionxform = str  # keys are case-sensitive
    parser.read(SYSTEMD / name)
    return parser


@pytest.mark.skipif(
    not shutil.which("systemd-analyze"), reason="systemd-analyze not installed (Debian package: systemd)"
)
def test_systemd_analyze_verify_is_clean(tmp_path):
    pkgd = Path(sys.executable).with_name("pkgd")
    for name in [*UNITS, "pkgd.socket"]:
        text = (SYSTEMD / name).read_text().replace("/usr/local/bin/pkgd", str(pkgd))  # where it is installed here
        (tmp_path / name.replace("@.", "@test.")).write_text(text)
    files = sorted(str(p) for p in tmp_path.iterdir())
    r = subprocess.run(["systemd-analyze", "verify", *files], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr  # unknown keys only warn: no output allowed


@pytest.mark.parametrize("name", UNITS)
def test_service_contract(name):
    s = unit(name)["Service"]
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["Restart"] == "on-failure" and s["KillMode"] == "mixed"
    assert s["RestartPreventExitStatus"] == "2"  # a bad config is not restarted in a loop
    assert int(s["WatchdogSec"]) > 0
    stop_needs = SupervisorConfig().drain_timeout + API_STOP_EXTRA + ENGINE_STOP_GRACE
    assert int(s["TimeoutStopSec"]) > stop_needs  # the drain finishes before systemd kills
    assert int(s["TimeoutStartSec"]) >= SupervisorConfig().engine_ready_timeout
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert s[key] == "yes"
    assert s["ProtectSystem"] == "strict" and s["User"] == "pkgd"
    for key in ("RuntimeDirectory", "StateDirectory", "CacheDirectory"):
        assert s[key].startswith("pkgd")
    assert s["RuntimeDirectoryMode"] == "0700"


def test_instances_get_their_own_config_and_runtime_dirs():
    s = unit("pkgd@.service")["Service"]
    assert s["ExecStart"].endswith("--config-dir /etc/pkgd/%i")
    assert s["RuntimeDirectory"] == "pkgd/%i" and s["StateDirectory"] == "pkgd/%i"


def test_sysusers_creates_the_unit_user():
    line = next(
        ln for ln in (SYSTEMD / "sysusers.d/pkgd.conf").read_text().splitlines() if ln and not ln.startswith("#")
    )
    assert line.split()[:2] == ["u", unit("pkgd.service")["Service"]["User"]]


def merged_example(extra: list[str] = ()) -> VllmConfig:
    """The example tree as the daemon composes it (Hydra layers), or, before the composer
    exists, merged file by file in the documented order."""
    tree = SYSTEMD / "etc-pkgd"
    if importlib.util.find_spec("pkgd.config.compose") and not extra:
        from pkgd.config.compose import ComposeRequest, compose

        return compose(ComposeRequest(config_dir=str(tree), env={})).config
    files = [tree / "pkgd.yaml", *sorted((tree / "conf.d").glob("*.yaml")), *(tree / "conf.d" / e for e in extra)]
    data: dict = {}
    for f in files:
        for section, values in (yaml.safe_load(f.read_text()) or {}).items():
            data.setdefault(section, {}).update(values)
    return VllmConfig.model_validate(data)


def test_example_etc_tree_is_a_valid_config():
    config = merged_example()
    assert config.scheduler.max_num_seqs == 64 and config.logging.format == "json"
    assert config.frontend.served_model_names == ["smollm2", "gpt-3.5-turbo"]  # conf.d applied
    assert config.supervisor.drain_timeout + API_STOP_EXTRA + ENGINE_STOP_GRACE < int(
        unit("pkgd.service")["Service"]["TimeoutStopSec"]
    )
    keyed = merged_example(["90-api-keys.yaml.example"])
    assert len(keyed.frontend.api_keys) == 1
