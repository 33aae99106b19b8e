"""What a SIGHUP reload has to do: compare two validated trees leaf by leaf.

Each leaf's ``x-reload`` (see `ReloadClass`) says what a change of it costs; the plan's class
is the most disruptive among the changed leaves: ``live`` (applied in place), ``api``
(rolling restart of the API servers on the held socket), ``engine`` (new engine cores, switch,
drain the old ones), ``restart`` (cannot be reloaded; restart the daemon). Used by the
supervisor on SIGHUP and by ``pkgd config diff``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pkgd.config import schema
from pkgd.config.errors import REDACTED
from pkgd.config.fields import RELOAD_ORDER, ReloadClass
from pkgd.config.vllm_config import VllmConfig

_EFFECT = {
    ReloadClass.LIVE: "applied in place; no process restarts",
    ReloadClass.API: "rolling restart of the API servers (the socket stays open)",
    ReloadClass.ENGINE: "new engine cores start, then the old ones drain (API servers reconnect)",
    ReloadClass.RESTART: "cannot be applied by a reload: restart the daemon",
}
# Listening-address keys: the rolling restart binds the new address and closes the old one.
_ADDRESS_KEYS = frozenset({"frontend.host", "frontend.port", "frontend.uds"})
_REBIND_EFFECT = "rolling restart of the API servers on the new address (bound first; the old one closes)"


@dataclasses.dataclass(frozen=True)
class LeafChange:
    """One changed leaf; ``old``/``new`` are JSON values, secrets shown as ``**********``."""

    key: str
    old: Any
    new: Any
    reload: ReloadClass


@dataclasses.dataclass(frozen=True)
class ReloadPlan:
    """The changed leaves (schema order) and the most disruptive reload class among them.

    ``reload_class`` is ``LIVE`` when nothing changed (``is_noop``).
    """

    changes: tuple[LeafChange, ...]
    reload_class: ReloadClass

    @property
    def is_noop(self) -> bool:
        return not self.changes

    @property
    def changed(self) -> tuple[str, ...]:
        """Dotted keys of the changed leaves."""
        return tuple(c.key for c in self.changes)

    @property
    def sections(self) -> tuple[str, ...]:
        """Top-level sections with at least one changed leaf, in schema order."""
        return tuple(dict.fromkeys(c.key.split(".")[0] for c in self.changes))

    @property
    def restarts_api_servers(self) -> bool:
        return _rank(self.reload_class) >= _rank(ReloadClass.API)

    @property
    def restarts_engine_cores(self) -> bool:
        return _rank(self.reload_class) >= _rank(ReloadClass.ENGINE)

    @property
    def effect(self) -> str:
        """One line on what applying the plan does."""
        if self.is_noop:
            return "nothing to do"
        if self.reload_class is ReloadClass.API and _ADDRESS_KEYS.intersection(self.changed):
            return _REBIND_EFFECT
        return _EFFECT[self.reload_class]


def _rank(cls: ReloadClass) -> int:
    return RELOAD_ORDER.index(cls)


def _get(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def plan_reload(old: VllmConfig, new: VllmConfig) -> ReloadPlan:
    """Compare ``old`` and ``new`` leaf by leaf (secrets compared, never shown)."""
    a = old.to_json_dict(reveal_secrets=True)
    b = new.to_json_dict(reveal_secrets=True)
    changes = []
    for key, leaf in schema.leaves().items():
        before, after = _get(a, key), _get(b, key)
        if before != after:
            if leaf.secret:
                before, after = [REDACTED] * len(before), [REDACTED] * len(after)
            changes.append(LeafChange(key, before, after, leaf.reload))
    worst = max((c.reload for c in changes), key=_rank, default=ReloadClass.LIVE)
    return ReloadPlan(tuple(changes), worst)
