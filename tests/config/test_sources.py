"""The files supervisor.watch_config watches, and what counts as a change among them."""

from __future__ import annotations

import os
from pathlib import Path

from tests.configmap import write_configmap

from pkgd.config.compose import ComposeRequest, compose
from pkgd.config.layers import conf_d_files
from pkgd.config.sources import UNREADABLE, ConfigSources, changed_files


def tree(tmp_path: Path) -> tuple[Path, ConfigSources]:
    root = tmp_path / "etc"
    root.mkdir()
    (root / "pkgd.yaml").write_text("model: {name: base}\n")
    write_configmap(root / "conf.d", {"10-a.yaml": "logging: {level: info}\n"}, "2026_12_06_01")
    return root, ConfigSources.of(ComposeRequest(config_dir=str(root)))


def test_configmap_layout_reads_the_keys_not_the_kubelets_entries(tmp_path):
    root, sources = tree(tmp_path)
    assert [p.name for p in conf_d_files(root / "conf.d")] == ["10-a.yaml"]  # ..data, ..<stamp> left out
    assert sorted(sources.files()) == ["conf.d/10-a.yaml", "pkgd.yaml"]
    assert compose(ComposeRequest(config_dir=str(root), env={})).sources["logging.level"] == "system:conf.d/10-a.yaml"


def test_a_kubelet_swap_changes_exactly_the_keys_whose_content_changed(tmp_path):
    root, sources = tree(tmp_path)
    write_configmap(root / "conf.d", {"10-a.yaml": "logging: {level: info}\n", "20-b.yaml": "x: 1\n"}, "s2")
    first = sources.snapshot()
    assert (root / "conf.d" / "10-a.yaml").is_symlink()  # the link itself never changes, only ..data
    write_configmap(root / "conf.d", {"10-a.yaml": "logging: {level: debug}\n", "20-b.yaml": "x: 1\n"}, "s3")
    assert changed_files(first, sources.snapshot()) == ["conf.d/10-a.yaml"]
    write_configmap(root / "conf.d", {"20-b.yaml": "x: 1\n"}, "s4")  # a key removed from the ConfigMap
    assert changed_files(first, sources.snapshot()) == ["conf.d/10-a.yaml"]
    assert "conf.d/10-a.yaml" not in sources.snapshot()


def test_churn_beside_the_config_is_no_change(tmp_path):
    root, sources = tree(tmp_path)
    before = sources.snapshot()
    (root / "conf.d" / ".10-a.yaml.swp").write_text("editor state")
    (root / "conf.d" / "README.txt").write_text("notes")
    (root / "conf.d" / "notes").mkdir()
    (root / "conf.d" / "notes" / "x.yaml").write_text("model: {name: nested}\n")  # conf.d is not recursive
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    os.utime(root / "pkgd.yaml")  # touched, same content
    write_configmap(root / "conf.d", {"10-a.yaml": "logging: {level: info}\n"}, "same-content")
    assert changed_files(before, sources.snapshot()) == []


def test_new_files_group_options_and_the_vllm_config_file_count(tmp_path):
    root, _ = tree(tmp_path)
    flags = tmp_path / "flags" / "vllm.yaml"
    flags.parent.mkdir()
    flags.write_text("max-model-len: 512\n")
    sources = ConfigSources.of(ComposeRequest(config_dir=str(root), vllm_config=str(flags)))
    assert sources.watch_paths() == [root, flags.parent]
    before = sources.snapshot()
    (root / "model").mkdir()
    (root / "model" / "mine.yaml").write_text("name: mine\n")
    (root / "conf.d" / "05-local.yaml").write_text("model: {name: local}\n")  # a plain file beside the links
    flags.write_text("max-model-len: 1024\n")
    assert changed_files(before, sources.snapshot()) == sorted(["conf.d/05-local.yaml", str(flags), "model/mine.yaml"])


def test_a_dangling_link_is_unreadable_not_an_error(tmp_path):
    root, sources = tree(tmp_path)
    before = sources.snapshot()
    os.symlink("..data/gone.yaml", root / "conf.d" / "30-gone.yaml")
    assert "conf.d/30-gone.yaml" not in sources.snapshot()  # is_file() is False: compose skips it too
    (root / "pkgd.yaml").chmod(0)
    if os.geteuid() != 0:  # root reads anything
        assert sources.snapshot()["pkgd.yaml"] == UNREADABLE
        assert changed_files(before, sources.snapshot()) == ["pkgd.yaml"]


def test_no_system_tree_watches_nothing(tmp_path):
    sources = ConfigSources(None)
    assert sources.watch_paths() == [] and sources.files() == {} and sources.snapshot() == {}


def test_a_whole_tree_mounted_from_a_configmap(tmp_path):
    """A ConfigMap mounted at the config directory itself (pkgd.yaml a key beside ..data)."""
    root = tmp_path / "etc"
    write_configmap(root, {"pkgd.yaml": "model: {name: one}\n"}, "t1")
    sources = ConfigSources.of(ComposeRequest(config_dir=str(root)))
    before = sources.snapshot()
    assert list(before) == ["pkgd.yaml"]
    write_configmap(root, {"pkgd.yaml": "model: {name: two}\n"}, "t2")
    assert changed_files(before, sources.snapshot()) == ["pkgd.yaml"]
    assert compose(ComposeRequest(config_dir=str(root), env={})).config.model.name == "two"
