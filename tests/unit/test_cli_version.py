"""`dsv3 --version`: the package version (dsv3_plugin.__version__, the one pyproject.toml installs)."""

import importlib.metadata

import pytest

import dsv3_plugin
from dsv3_plugin.cli import main


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"dsv3 {dsv3_plugin.__version__}"


def test_installed_metadata_reads_the_same_version():
    # an editable install records the version at install time: after changing __version__, reinstall
    assert importlib.metadata.version("dsv3-plugin") == dsv3_plugin.__version__, "pip install --no-deps -e ."
