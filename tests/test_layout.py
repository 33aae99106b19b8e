"""The package layout DESIGN.md §1 fixes: import names and packaged data."""

import importlib.resources


def test_import_names_and_package_data():
    import pkgd
    import pkgd_kernels  # noqa: F401

    root = importlib.resources.files(pkgd)
    assert (root / "configs" / "pkgd.yaml").is_file()
    assert (root / "schemas" / "vllm_config.schema.json").is_file()
