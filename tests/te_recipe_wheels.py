"""Transformer Engine's real recipe module (`transformer_engine/common/recipe/__init__.py`), loaded without a GPU
from the pinned pure-Python TE wheels that `make venv` downloads (see requirements-te-recipe.txt).

The wheels are not installed: without TE's CUDA core library, `import transformer_engine` raises RuntimeError.
The recipe module itself needs only the standard library and pydantic, so it is executed on its own, from the
wheel's bytes, after the wheel's sha256 is checked against the pin."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import types
import zipfile
from pathlib import Path

__all__ = ["PINS_FILE", "pinned_versions", "wheel_dir", "load_recipe_module", "fake_te_package"]

ROOT = Path(__file__).resolve().parents[1]
PINS_FILE = ROOT / "requirements-te-recipe.txt"
RECIPE_PATH = "transformer_engine/common/recipe/__init__.py"
_PIN = re.compile(r"^transformer-engine==(\S+)\s+--hash=sha256:([0-9a-f]{64})\s*$")
_CACHE: dict[str, types.ModuleType] = {}


def _pins() -> dict[str, str]:
    pins = {}
    for line in PINS_FILE.read_text().splitlines():
        m = _PIN.match(line.strip())
        if m:
            pins[m.group(1)] = m.group(2)
    if not pins:
        raise RuntimeError(f"{PINS_FILE}: no `transformer-engine==V --hash=sha256:H` line")
    return pins


def pinned_versions() -> list[str]:
    return list(_pins())


def wheel_dir() -> Path:
    """`$DSV3_TE_WHEELS`, else `te-wheels/` of the running venv (where `make venv` puts them), else ./.venv's."""
    if os.environ.get("DSV3_TE_WHEELS"):
        return Path(os.environ["DSV3_TE_WHEELS"])
    here = Path(sys.prefix) / "te-wheels"
    return here if here.is_dir() else ROOT / ".venv" / "te-wheels"


def load_recipe_module(version: str) -> types.ModuleType:
    """TE `version`'s recipe module, as a standalone module named `_te_recipe_<version>`."""
    if version in _CACHE:
        return _CACHE[version]
    sha = _pins()[version]
    wheel = wheel_dir() / f"transformer_engine-{version}-py3-none-any.whl"
    if not wheel.is_file():
        raise FileNotFoundError(
            f"{wheel} is missing: run `make venv` (it downloads the wheels pinned in "
            f"{PINS_FILE.name}), or point DSV3_TE_WHEELS at a folder holding them"
        )
    data = wheel.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha:
        raise RuntimeError(f"{wheel}: sha256 differs from the pin in {PINS_FILE.name}")
    with zipfile.ZipFile(wheel) as z:
        src = z.read(RECIPE_PATH)
    name = f"_te_recipe_{version.replace('.', '_')}"
    origin = f"{wheel}!/{RECIPE_PATH}"
    spec = importlib.util.spec_from_loader(name, loader=None, origin=origin)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # pydantic resolves the dataclasses' annotations through sys.modules
    try:
        exec(compile(src, origin, "exec"), mod.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    _CACHE[version] = mod
    return mod


def fake_te_package(monkeypatch, version: str) -> types.ModuleType:
    """Make `import transformer_engine` / `from transformer_engine.common import recipe` give TE `version`'s
    real recipe module for the duration of one test (monkeypatch restores sys.modules)."""
    recipe = load_recipe_module(version)
    te = types.ModuleType("transformer_engine")
    te.__version__, te.__path__ = version, []
    common = types.ModuleType("transformer_engine.common")
    common.__path__, common.recipe, te.common = [], recipe, common
    for name, mod in (
        ("transformer_engine", te),
        ("transformer_engine.common", common),
        ("transformer_engine.common.recipe", recipe),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    return recipe
