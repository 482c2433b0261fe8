"""Where a model name points: a local folder, the local Hugging Face cache, or the hub.

Runs before vLLM is imported, so a missing path or an unreachable hub fails in milliseconds with
an error that says what to pass instead. Pure Python (``huggingface_hub`` only); any thread.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

#: A hub repo id: ``name`` or ``owner/name`` (letters, digits, ``-``, ``_``, ``.``).
_HUB_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")
#: Seconds the hub-reachability probe may take (one request) before the hub counts as unreachable.
HUB_PROBE_TIMEOUT = 3.0


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a local path rather than a hub id."""
    if name in (".", "..") or name.startswith(("/", "./", "../", "~")) or name.endswith("/"):
        return True
    if any(sep and sep != "/" and sep in name for sep in (os.sep, os.altsep)):
        return True
    if not _HUB_ID.match(name) or name.count("/") > 1 or "--" in name or ".." in name:
        return True  # not a valid hub id either
    return "/" in name and os.path.isdir(name.split("/", 1)[0])  # under an existing local folder


def _hub_offline() -> bool:
    """Whether the user turned the hub off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - a transformers dependency
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _cached_snapshot(repo_id: str, revision: str | None, cache_dirs: list[str | None]) -> str | None:
    """The local snapshot folder of ``repo_id`` in the HF cache (no network), or None."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover
        return None
    for cache_dir in cache_dirs:
        try:
            path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached there (LocalEntryNotFoundError and kin)
            continue
        if os.path.isdir(path) and os.listdir(path):
            return str(path)
    return None


def _hub_answers(repo_id: str, revision: str | None, timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """One metadata request to the hub: True when any HTTP answer comes back (404/401 included:
    vLLM then reports what is wrong), False when the request gets no answer (no network, DNS
    failure, refused connection, timeout)."""
    try:
        from huggingface_hub import model_info
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError:  # pragma: no cover
        return True
    try:
        model_info(repo_id, revision=revision, timeout=timeout)
    except HfHubHTTPError:
        return True
    except Exception:  # noqa: BLE001 - transport errors differ between huggingface_hub versions
        return False
    return True


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """Check, before vLLM is imported, that ``name`` can be loaded; return what to give vLLM.

    * An existing local file or folder is returned as is (a leading ``~`` is expanded).
    * A name that looks like a local path (starts with ``/``, ``./``, ``../`` or ``~``, has more
      than one ``/``, is not a valid hub id, or starts with an existing local folder) but does
      not exist raises :class:`FileNotFoundError` ("no such directory").
    * A hub id is looked up in the local Hugging Face cache (and ``download_dir``). When the
      hub is switched off (``HF_HUB_OFFLINE=1``) or does not answer one quick request
      (:data:`HUB_PROBE_TIMEOUT`), a cached model is returned as its local snapshot folder and
      an uncached one raises :class:`FileNotFoundError` at once. When the hub answers, the id is
      returned unchanged and vLLM downloads or updates it as usual.
    * URLs (``s3://...``) and names under ``VLLM_USE_MODELSCOPE`` are returned unchecked.
    """
    if "://" in name or os.environ.get("VLLM_USE_MODELSCOPE", "").strip().lower() in ("1", "true"):
        return name
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded):
        return expanded
    if _looks_like_path(name):
        plainly_path = name.startswith(("/", ".", "~"))
        hint = "" if plainly_path or _HUB_ID.match(name) else f" ({name!r} is not a valid hub id either)"
        raise FileNotFoundError(
            f"no such directory: {os.path.abspath(expanded)!r}{hint}; pass the folder of a "
            "Hugging Face model (config.json and weights) or a hub id such as 'owner/name'"
        )
    offline = _hub_offline()
    if not offline and _hub_answers(name, revision):
        return name
    cached = _cached_snapshot(name, revision, [None, download_dir] if download_dir else [None])
    if cached is not None:
        logger.info("using the cached snapshot of %s at %s (hub %s)", name, cached,
                    "offline" if offline else "not reachable")
        return cached
    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub is not reachable"
    raise FileNotFoundError(
        f"model {name!r} is not in the local Hugging Face cache and {why} (nor is it a local "
        f"folder: no such directory {os.path.abspath(expanded)!r}). Pass the path of a local "
        f"model folder, or download it where there is network (`hf download {name}`) and set "
        "HF_HUB_OFFLINE=1 to use the cached copy"
    )

