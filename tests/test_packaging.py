"""``pyproject.toml`` installs every package of the source: a folder with an ``__init__.py`` under
one of ``package-dir``'s folders that ``packages`` does not list is left out of a wheel (an
editable install would still find it, so nothing else here would notice)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def listed_and_found() -> tuple[set[str], set[str]]:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            name = ".".join([package, *parts])
            owner = max((p for p in setuptools["package-dir"] if name == p or name.startswith(p + ".")), key=len)
            if owner == package:
                found.add(name)
    return set(setuptools["packages"]), found


def test_every_source_package_is_installed():
    listed, found = listed_and_found()
    assert found - listed == set(), f"pyproject.toml [tool.setuptools] packages misses {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages with no __init__.py: {sorted(listed - found)}"
