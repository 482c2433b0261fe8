"""LoRA adapter registry: names -> never-reused vLLM integer ids.

vLLM identifies a loaded adapter by its integer id and silently keeps the old weights when an id
is reused with another path, so every registration here takes a fresh id, also when a name is
registered again. The id is part of every cache key, so rows computed under an older
registration of a name are never returned for the newer one.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: user-facing ``name``, unique ``int_id`` (> 0) and ``path``."""

    name: str
    int_id: int
    path: str


class UnknownAdapterError(ValueError):
    """A call named a LoRA adapter that is not registered."""


def local_adapter_path(path: str, name: str) -> str:
    """``path`` (``~`` expanded) as an absolute path that exists, for adapter ``name``.

    Resolved here, on the caller's side, so vLLM never reads a relative path as a hub repository
    id, and Ray replicas on other nodes get the path the caller meant, not one relative to their
    own working directory. A missing path raises ``FileNotFoundError`` naming it.
    """
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        given = "" if full == path else f" (given as {path!r}, from the working directory {os.getcwd()!r})"
        raise FileNotFoundError(
            f"LoRA adapter {name!r}: no such file or directory: {full!r}{given}; give the folder that "
            "holds the adapter (adapter_config.json and its weights); download a hub adapter first, "
            "e.g. with huggingface_hub.snapshot_download"
        )
    return full


class LoraRegistry:
    """Thread-safe mapping of adapter names to :class:`Adapter` records.

    The default adapter (``set_lora``) is used by calls that pass ``lora_name=None``;
    ``clear_lora`` makes those calls use the base model again.
    """

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._by_name: dict[str, Adapter] = {}
        self._default: str | None = None
        self._lock = threading.Lock()

    def new(self, name: str, path: str | os.PathLike[str], local: bool = False) -> Adapter:
        """A fresh record for ``name`` (not yet registered; see :meth:`commit`). With ``local``
        (what a model that loads adapters needs) the path is made absolute and must exist
        (:func:`local_adapter_path`); otherwise it is kept as given."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"lora_name must be a non-empty str, got {name!r}")
        path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise TypeError(f"lora_path must be a non-empty path, got {path!r}")
        if local:
            path = local_adapter_path(path, name)
        with self._lock:
            return Adapter(name=name, int_id=next(self._ids), path=path)

    def commit(self, adapter: Adapter) -> Adapter | None:
        """Register ``adapter`` under its name; returns the record it replaced, if any."""
        with self._lock:
            old = self._by_name.get(adapter.name)
            self._by_name[adapter.name] = adapter
            return old

    def resolve(self, name: str | None) -> Adapter | None:
        """The adapter a call uses: ``name``, else the default, else None (base model)."""
        with self._lock:
            if name is None:
                name = self._default
                if name is None:
                    return None
            elif not isinstance(name, str):
                raise TypeError(f"lora_name must be a str or None, got {type(name).__name__}")
            adapter = self._by_name.get(name)
        if adapter is None:
            raise UnknownAdapterError(
                f"unknown LoRA adapter {name!r}; register it with add_new_lora(path, {name!r})"
                f" (registered: {sorted(self._by_name) or 'none'})"
            )
        return adapter

    def get(self, name: str) -> Adapter | None:
        """The adapter registered under ``name``, or None (the default adapter plays no part)."""
        with self._lock:
            return self._by_name.get(name)

    def remove(self, name: str) -> Adapter:
        """Unregister ``name`` (and stop using it as the default); raises
        :class:`UnknownAdapterError` when it is not registered."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is not None and self._default == name:
                self._default = None
        if adapter is None:
            raise UnknownAdapterError(f"unknown LoRA adapter {name!r}: nothing to remove")
        return adapter

    def set_default(self, name: str | None) -> None:
        if name is not None:
            self.resolve(name)
        with self._lock:
            self._default = name

    @property
    def default(self) -> str | None:
        return self._default

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)
