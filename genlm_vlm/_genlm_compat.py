"""Let type checks made by genlm's packages accept genlm_vlm's model classes.

llamppl's ``CachedCausalLM(model)`` accepts a model only if
``isinstance(model, C)`` holds for one of genlm-backend's classes ``AsyncVirtualLM``,
``AsyncTransformer``, ``MockAsyncLM`` or ``AsyncMlxLM`` (genlm.backend.llm). Those classes derive
from ``abc.ABC``, so the supported way to pass that check without inheriting from them is
:meth:`abc.ABCMeta.register`: genlm_vlm's :class:`~genlm_vlm.AsyncVirtualLM` is registered as a
virtual subclass of genlm-backend's ``AsyncVirtualLM`` (llamppl then treats it as its vLLM
backend) and :class:`~genlm_vlm.mock.MockAsyncLM` as one of ``MockAsyncLM``.

genlm_vlm never imports genlm-backend for this. A class declares what it stands in for with
:func:`declare_stand_in` (done by :class:`genlm_vlm.base.AsyncLM` subclasses that set
``genlm_backend_class``); the registration happens at once if ``genlm.backend.llm`` is already
loaded, else right after it is first imported, through a finder on ``sys.meta_path`` that
watches for that one module name and leaves every other import alone. So the import order of
genlm_vlm, genlm-backend and llamppl does not matter.
"""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["declare_stand_in", "register_now"]

logger = logging.getLogger(__name__)

#: The genlm-backend module whose classes llamppl checks against.
BACKEND_LLM_MODULE = "genlm.backend.llm"

_lock = threading.RLock()
#: (genlm_vlm class, name of the genlm-backend class it stands in for).
_declared: list[tuple[type, str]] = []


def register_now() -> list[tuple[type, type]]:
    """Register every declared class with its genlm-backend counterpart, if genlm-backend is loaded.

    Returns the ``(ours, theirs)`` pairs registered by this call (empty when genlm-backend is
    not loaded or everything was registered already). Safe to call any number of times.
    """
    module = sys.modules.get(BACKEND_LLM_MODULE)
    if module is None:
        return []
    done = []
    with _lock:
        for ours, name in _declared:
            theirs = getattr(module, name, None)
            if not isinstance(theirs, abc.ABCMeta):
                # e.g. genlm-backend's placeholder AsyncVirtualLM when vLLM is not installed
                logger.debug("genlm.backend.llm.%s is not an ABC; %s not registered", name, ours)
                continue
            if issubclass(ours, theirs):
                continue
            theirs.register(ours)
            done.append((ours, theirs))
    return done


def declare_stand_in(cls: type, backend_class: str) -> None:
    """Declare that ``cls`` stands in for ``genlm.backend.llm.<backend_class>`` (see module doc)."""
    with _lock:
        _declared.append((cls, backend_class))
    if BACKEND_LLM_MODULE in sys.modules:
        register_now()
    else:
        _watch(BACKEND_LLM_MODULE, register_now)


# ------------------------------------------------------------------------------ import watcher
class _NotifyingLoader(importlib.abc.Loader):
    """Runs the real loader, then ``callback``; everything else is the real loader's."""

    def __init__(self, loader: Any, callback: Callable[[], Any], watcher: _Watcher) -> None:
        self._loader = loader
        self._callback = callback
        self._watcher = watcher

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _unwatch(self._watcher)  # after a failed import, the next attempt is watched again
        try:
            self._callback()
        except Exception:  # noqa: BLE001 - never break the user's import
            logger.warning("registering genlm_vlm classes with %s failed", module.__name__, exc_info=True)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when ``name`` is imported, wraps the real spec's loader."""

    def __init__(self, name: str, callback: Callable[[], Any]) -> None:
        self.name = name
        self.callback = callback
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _NotifyingLoader(spec.loader, self.callback, self)
        return spec


def _watch(name: str, callback: Callable[[], Any]) -> None:
    with _lock:
        if not any(isinstance(f, _Watcher) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _Watcher(name, callback))


def _unwatch(watcher: _Watcher) -> None:
    with _lock:
        try:
            sys.meta_path.remove(watcher)
        except ValueError:
            pass
