"""The files a composition reads, and what changed among them (``supervisor.watch_config``).

`ConfigSources` names, for one `ComposeRequest`, the directories to watch and the files whose
content decides the composed tree: the system tree's ``NAME.yaml``, ``conf.d/*.yaml`` (as
`pkgd.config.layers.conf_d_files` lists them), its ``GROUP/*.yaml`` options, and vLLM's
``--config`` file. The packaged tree and the environment are left out: neither changes under
a running process.

A change is decided on content, not on file events: `snapshot` hashes each file through its
symlinks and `changed_files` compares two snapshots. That is what makes a Kubernetes ConfigMap
update visible at all (the kubelet writes a new ``..<timestamp>`` directory and renames a
``..data`` symlink over the old one; the ``a.yaml -> ..data/a.yaml`` links themselves never
change) and keeps unrelated churn (an editor's swap file, a README beside conf.d, a chmod)
from reloading anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pkgd.config import layers

if TYPE_CHECKING:
    from pkgd.config.compose import ComposeRequest

#: Snapshot value of a file listed but unreadable (a dangling symlink mid-swap, no permission).
UNREADABLE = "unreadable"


@dataclasses.dataclass(frozen=True)
class ConfigSources:
    """The watched part of one `pkgd.config.compose.ComposeRequest`.

    ``root``: the system tree (None when there is none); ``config_name``: its root file's name
    (without ``.yaml``); ``vllm_config``: vLLM's ``--config`` file, if given.
    """

    root: Path | None
    config_name: str = layers.DEFAULT_CONFIG_NAME
    vllm_config: Path | None = None

    @classmethod
    def of(cls, request: ComposeRequest) -> ConfigSources:
        """The sources of a `ComposeRequest` (its system tree resolved as `compose` does).

        Raises:
            ConfigError: ``--config-dir`` names no directory (compose raised it already).
        """
        root = layers.system_root(request.config_dir)
        name = (request.config_name or layers.DEFAULT_CONFIG_NAME).removesuffix(".yaml")
        vllm = request.vllm_config
        return cls(root, name, Path(vllm).expanduser().absolute() if vllm else None)

    def watch_paths(self) -> list[Path]:
        """Existing directories to watch recursively: the system tree and the directory of
        vLLM's ``--config`` file (a file itself is not watched: an editor or a ConfigMap
        replaces it by rename, and a watch on the old inode would see nothing more)."""
        paths = [self.root] if self.root is not None else []
        if self.vllm_config is not None and not (self.root and self.vllm_config.is_relative_to(self.root)):
            paths.append(self.vllm_config.parent)
        return [p for p in dict.fromkeys(paths) if p.is_dir()]

    def files(self) -> dict[str, Path]:
        """Label (path relative to the system tree, or the ``--config`` path) → file, for
        every file whose content the composition reads or would read if it appeared."""
        out: dict[str, Path] = {}
        if self.root is not None:
            candidates = [self.root / f"{self.config_name}.yaml", *layers.conf_d_files(self.root / layers.CONF_D)]
            for group in sorted(p for p in self.root.iterdir() if p.is_dir()):
                if group.name != layers.CONF_D and not group.name.startswith((".", "_")):
                    candidates += sorted(group.glob("*.yaml"))
            out.update((str(p.relative_to(self.root)), p) for p in candidates if p.is_file())
        if self.vllm_config is not None and self.vllm_config.is_file():
            out[str(self.vllm_config)] = self.vllm_config
        return out

    def snapshot(self) -> dict[str, str]:
        """Label → SHA-256 of the file's bytes (read through symlinks), or `UNREADABLE`."""
        out = {}
        for label, path in self.files().items():
            try:
                out[label] = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError:
                out[label] = UNREADABLE
        return out


def changed_files(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """Labels added, removed or whose content differs between two snapshots, sorted."""
    return sorted(label for label in before.keys() | after.keys() if before.get(label) != after.get(label))
