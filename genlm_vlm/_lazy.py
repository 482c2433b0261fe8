"""Names a package loads on first access (PEP 562), so importing it stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(
    package: str, table: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a public name to the module
    (relative to ``package``) that defines it; a loaded name is stored in ``namespace`` (the
    package's globals), so the next access is a plain lookup."""

    def getattr_(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *table})

    return getattr_, dir_
