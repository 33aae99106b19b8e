"""A ConfigMap volume as the kubelet writes it (its AtomicWriter), for tests on this machine.

Layout of a ConfigMap mounted at ``DIR``: the data in ``DIR/..<timestamp>/<key>``, a symlink
``DIR/..data -> ..<timestamp>``, and per key a symlink ``DIR/<key> -> ..data/<key>``. An update
writes a new timestamped directory, points a ``..data_tmp`` symlink at it and renames that over
``..data`` (one atomic step for every key), adds links for new keys, removes links of
deleted keys, then the old directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_configmap(mount: Path, data: dict[str, str], stamp: str) -> None:
    """Project ``data`` (key → text) into ``mount`` as the kubelet does; ``stamp`` names the
    new ``..<stamp>`` directory (unique per update)."""
    mount.mkdir(parents=True, exist_ok=True)
    new = mount / f"..{stamp}"
    new.mkdir()
    for key, text in data.items():
        (new / key).write_text(text)
    current = mount / "..data"
    old = os.readlink(current) if current.is_symlink() else None
    tmp = mount / "..data_tmp"
    os.symlink(new.name, tmp)
    os.rename(tmp, current)
    for key in data:
        if not (mount / key).is_symlink():
            os.symlink(f"..data/{key}", mount / key)
    for entry in mount.iterdir():
        if entry.is_symlink() and os.readlink(entry).startswith("..data/") and entry.name not in data:
            entry.unlink()  # a key deleted from the ConfigMap
    if old is not None:
        shutil.rmtree(mount / old)
