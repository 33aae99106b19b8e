"""plan_reload: which leaves changed and what a SIGHUP must restart."""

import pytest

from pkgd.config import ReloadClass, VllmConfig
from pkgd.config.reload import plan_reload

BASE = VllmConfig()


def changed(**sections) -> VllmConfig:
    return VllmConfig.model_validate(sections)


def test_no_change_is_a_noop():
    plan = plan_reload(BASE, VllmConfig())
    assert plan.is_noop and plan.reload_class is ReloadClass.LIVE and plan.effect == "nothing to do"
    assert not plan.restarts_api_servers and not plan.restarts_engine_cores


@pytest.mark.parametrize(
    ("sections", "expected", "api", "engine"),
    [
        ({"logging": {"level": "debug"}}, ReloadClass.LIVE, False, False),
        ({"model": {"generation": {"temperature": 0.2}}}, ReloadClass.LIVE, False, False),
        ({"frontend": {"port": 9000}}, ReloadClass.API, True, False),
        ({"parallel": {"tp": 2}}, ReloadClass.ENGINE, True, True),
        ({"model": {"source": "/m"}}, ReloadClass.ENGINE, True, True),
        ({"frontend": {"headless": True}}, ReloadClass.RESTART, True, True),
    ],
)
def test_reload_class_of_one_change(sections, expected, api, engine):
    plan = plan_reload(BASE, changed(**sections))
    assert plan.reload_class is expected
    assert (plan.restarts_api_servers, plan.restarts_engine_cores) == (api, engine)


def test_an_address_change_is_described_as_a_rebind():
    assert "new address" in plan_reload(BASE, changed(frontend={"port": 9000})).effect
    assert "socket stays open" in plan_reload(BASE, changed(frontend={"limits": {"max_logprobs": 5}})).effect
    assert "engine cores" in plan_reload(BASE, changed(frontend={"port": 9000}, parallel={"tp": 2})).effect


def test_most_disruptive_change_wins_and_sections_are_listed():
    new = changed(logging={"level": "debug"}, frontend={"port": 9000}, cache={"block_size": 32})
    plan = plan_reload(BASE, new)
    assert plan.reload_class is ReloadClass.ENGINE
    assert plan.changed == ("frontend.port", "cache.block_size", "logging.level")
    assert plan.sections == ("frontend", "cache", "logging")
    assert [(c.old, c.new) for c in plan.changes] == [(8000, 9000), (16, 32), ("info", "debug")]


def test_rotated_api_key_is_seen_but_never_shown():
    old = changed(frontend={"api_keys": ["sk-old"]})
    new = changed(frontend={"api_keys": ["sk-new"]})
    plan = plan_reload(old, new)
    assert plan.changed == ("frontend.api_keys",) and plan.reload_class is ReloadClass.LIVE
    assert "sk-" not in repr(plan)
