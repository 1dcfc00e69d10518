from pathlib import Path

from dsv3_plugin.config import reference_table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
README_MAX_LINES = 200  # the README is for users: what it is, install, how to use it, status; details live in docs/


def test_readme_config_table_is_current():
    assert reference_table() in CONFIGURATION.read_text(), (
        'docs/configuration.md\'s "dsv3" table is stale: paste dsv3_plugin.config.reference_table() output'
    )


def test_readme_shows_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}): move details to docs/, measurements to docs/results.md"
    )
