"""Lazy re-exports for a package's ``__init__``: the public names resolve on first use, so that
importing a package costs nothing beyond itself (no torch, vLLM or transformers until a name
that needs them is used) and no package's ``__init__`` takes part in an import cycle."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``) re-exporting, for each
    module path in ``exports``, the names listed (``{"kvcomm.reuse.engine": ("ReuseEngine",)}``).
    A name is imported from its module on first access and then cached on the package."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__


def names(exports: Mapping[str, Sequence[str]]) -> list[str]:
    """Every name ``exports`` lists, sorted: the package's ``__all__``."""
    return sorted(name for listed in exports.values() for name in listed)
