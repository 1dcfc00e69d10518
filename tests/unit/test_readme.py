from pathlib import Path

from dsv3_plugin.config import reference_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_config_table_is_current():
    assert reference_table() in README.read_text(), (
        'README\'s "dsv3" table is stale: paste dsv3_plugin.config.reference_table() output'
    )


def test_readme_shows_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
