import pytest

from pkgd import log


@pytest.fixture(autouse=True, scope="session")
def _json_logs():
    """Plain JSON log lines (the default console renderer pretty-prints tracebacks slowly)."""
    log.configure(role="test")
