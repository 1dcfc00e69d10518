"""pyproject.toml's package list: every package folder on disk is installed, `patches/` as `dsv3_plugin_patches`."""

import os

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setuptools_table() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _packages_on_disk(folder: str, name: str) -> set[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            found.add(name if rel == "." else ".".join([name, *rel.split(os.sep)]))
    return found


def test_every_package_folder_is_listed():
    table = _setuptools_table()
    assert table["package-dir"] == {"dsv3_plugin_patches": "patches"}
    on_disk = _packages_on_disk("dsv3_plugin", "dsv3_plugin") | _packages_on_disk("patches", "dsv3_plugin_patches")
    assert set(table["packages"]) == on_disk


def test_benchmarks_are_not_installed():
    """`benchmarks/` (the benches and their tests) is a folder of the checkout beside the package, never installed:
    no package of the list is it or lies under it, and no package folder is taken from inside it."""
    table = _setuptools_table()
    assert os.path.isfile(os.path.join(ROOT, "benchmarks", "__init__.py"))  # the folder this is about exists
    listed = set(table["packages"])
    assert not {p for p in listed if p == "benchmarks" or p.startswith("benchmarks.")}
    for folder in table["package-dir"].values():
        assert os.path.normpath(folder).split(os.sep)[0] != "benchmarks", folder
