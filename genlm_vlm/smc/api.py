"""``lm.smc(...)``: argument checks and the controller, shared by every model class.

:func:`prepare` validates every argument (before any engine work) and builds the
:class:`~.algorithm.SMCController`; :func:`run` runs it where the model runs controllers
(:meth:`~genlm_vlm.AsyncLM.run_controller`: in the engine for
:class:`~genlm_vlm.AsyncVirtualLM`, per token in Python elsewhere) or, with ``in_engine=False``,
always per token in Python (the reference).
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

from ..checks import (
    as_token_ids,
    check_count,
    check_engine_path,
    check_flag,
    check_name,
    check_real,
    check_seed,
)
from .algorithm import RESAMPLING, SMCController, SMCResult, warn_if_empty
from .constraints import Constraint, as_constraint
from .controller import drive
from .product import check_options, criticise, criticise_sync, resolve_prompts

__all__ = ["bind", "check_options", "criticise", "criticise_sync", "prepare", "resolve_prompts", "run", "smc",
           "text_vocab"]


def _eos_ids(lm: Any, eos_token_ids: Any) -> tuple[int, ...]:
    if eos_token_ids is None:
        eos = getattr(lm.tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id: pass eos_token_ids= (the ids that end a text)")
        eos_token_ids = [eos]
    elif isinstance(eos_token_ids, numbers.Integral):
        eos_token_ids = [eos_token_ids]
    eos = as_token_ids(eos_token_ids, "eos_token_ids", lm.vocab_size)
    if not eos:
        raise ValueError(
            "eos_token_ids is empty: SMC needs at least one id that ends a text (None: the tokenizer's eos_token_id)"
        )
    return eos


def bind(lm: Any, constraint: Any, eos: tuple[int, ...]) -> Any:
    """``constraint`` compiled for ``lm``'s vocabulary as constraints see it (:func:`text_vocab`;
    the grammar compiler for the vocabulary and EOS ids is made once per model and kept with
    it)."""
    c: Constraint = as_constraint(constraint)
    return c.bind(text_vocab(lm), eos, lm.vocab_size, cache=bind_cache(lm))


def text_vocab(lm: Any) -> list[bytes]:
    """``lm``'s byte vocabulary as every constraint and the SMC bookkeeping see it: the special
    and added tokens (``lm._special_ids``: ``<s>``, ``<|end_of_text|>``, chat markers, which the
    byte vocabulary writes as their literal text) have no bytes, like the padding columns, so
    no constraint ever allows them; only the EOS ids a run is given end a text. Made once per
    model and kept in :func:`bind_cache`."""
    cache = bind_cache(lm)
    vocab = cache.get("text_vocab")
    if vocab is None:
        vocab = list(lm._byte_strings)
        for i in lm._special_ids:
            if 0 <= i < len(vocab):
                vocab[i] = b""
        cache["text_vocab"] = vocab
    return vocab


def bind_cache(lm: Any) -> dict[Any, Any]:
    """The per-model cache :func:`bind` hands to ``Constraint.bind`` (grammar compilers, usable
    tokens and widths per EOS ids), kept on ``lm``."""
    return lm.__dict__.setdefault("_smc_compilers", {})


def prepare(lm: Any, prompt_ids: Any, constraint: Any, n_particles: Any, max_tokens: Any, *,
            ess_threshold: Any = 0.5, resampling: Any = "systematic", temperature: Any = 1.0, seed: Any = None,
            lora_name: str | None = None, eos_token_ids: Any = None, force_eos: Any = False,
            target_temperature: Any = 1.0, mask_overlap: Any = False, build: bool = True) -> tuple[tuple[int, ...], SMCController | None]:
    """Check the arguments of :meth:`~genlm_vlm.AsyncLM.smc` and build its controller: a wrong
    type raises ``TypeError``, a wrong value ``ValueError`` (:class:`ConstraintError` for a
    constraint that does not compile or allows nothing), each naming the argument. With
    ``build=False`` the constraint is still compiled (that is where a bad pattern or an empty
    language shows), but no controller (with its ``n_particles`` matchers) is made: None."""
    prompt = lm._check_ids(prompt_ids, "prompt_ids")
    n_particles = check_count(n_particles, "n_particles")
    max_tokens = check_count(max_tokens, "max_tokens")
    limit = getattr(lm, "max_model_len", None)
    if isinstance(limit, int) and len(prompt) + max_tokens > limit:
        raise ValueError(
            f"prompt_ids ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len={limit}: "
            f"lower max_tokens to at most {limit - len(prompt)}, or build the model with a larger max_model_len"
        )
    thr = check_real(ess_threshold, "ess_threshold", "a number in [0, 1]")
    if not 0.0 <= thr <= 1.0:
        raise ValueError(f"ess_threshold must be a number in [0, 1], got {ess_threshold!r}")
    if not isinstance(resampling, str):
        raise TypeError(f"resampling must be one of {', '.join(RESAMPLING)} (a str), got {type(resampling).__name__}")
    if resampling not in RESAMPLING:
        raise ValueError(f"resampling must be one of {', '.join(RESAMPLING)}; got {resampling!r}")
    temp = check_real(temperature, "temperature", "a finite number >= 0")
    if not 0.0 <= temp < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    tau = check_real(target_temperature, "target_temperature", "a finite number > 0")
    if not 0.0 < tau < math.inf:
        raise ValueError(f"target_temperature must be a finite number > 0, got {target_temperature!r}")
    seed = check_seed(seed, "seed")
    if seed is not None and seed < 0:  # numpy's generator, which draws the run's numbers, takes none
        raise ValueError(f"seed must be None or an int >= 0 for smc (it seeds numpy's default_rng), got {seed}")
    check_flag(force_eos, "force_eos")
    check_flag(mask_overlap, "mask_overlap")
    check_name(lora_name, "lora_name")
    loras = getattr(lm, "_loras", None)
    if loras is not None:
        loras.resolve(lora_name)  # an unknown adapter fails here, before any engine work
    elif lora_name is not None:
        raise ValueError(f"{type(lm).__name__} has no LoRA adapters (lora_name={lora_name!r}): pass lora_name=None")
    eos = _eos_ids(lm, eos_token_ids)
    bound = bind(lm, constraint, eos)
    if not build:
        return prompt, None
    controller = SMCController(
        bound, n_particles, max_tokens, eos_ids=eos, byte_vocab=text_vocab(lm),
        ess_threshold=thr, resampling=resampling, temperature=temp, seed=seed, force_eos=force_eos,
        target_temperature=tau, mask_overlap=mask_overlap,
    )
    return prompt, controller


async def run(lm: Any, prompt: tuple[int, ...], controller: SMCController, *, lora_name: str | None,
              in_engine: bool, prompts: tuple[tuple[int, ...], ...] | None = None,
              critic: Any = None, engine_path: str = "auto") -> SMCResult:
    """Run ``controller`` on ``lm`` (see the module docstring) and time it; ``prompts``
    (checked by :func:`check_prompts`): a product of prompts; ``critic`` (checked by
    :func:`check_critic`): applied once at the end, here, in the caller's coroutine
    (:func:`~.product.criticise`). A result whose posterior is empty gives its
    :class:`~.algorithm.EmptyPosteriorWarning` here (``empty_reason``), after the critic.
    ``engine_path`` (checked): ``"auto"``, ``"bursts"`` or ``"requests"``, the path an engine that
    runs controllers takes (passed on unless ``"auto"``, every ``run_controller``'s default;
    other models run the reference, which the option does not change)."""
    t0 = time.perf_counter()
    if in_engine:
        path = {} if engine_path == "auto" else {"engine_path": engine_path}
        if prompts is None:
            result = await lm.run_controller(prompt, controller, lora_name=lora_name, **path)
        else:
            result = await lm.run_controller(None, controller, lora_name=lora_name, prompts=prompts, **path)
    else:
        result = await drive(lm, prompt, controller, lora_name=lora_name, prompts=prompts)
    if critic is not None:
        await criticise(result, critic)
    result.stats["wall_s"] = round(time.perf_counter() - t0, 6)
    result.stats.setdefault("where", "python")
    warn_if_empty(result, stacklevel=4)  # run <- smc <- AsyncLM.smc <- the caller
    return result


async def smc(lm: Any, prompt_ids: Any, constraint: Any, n_particles: Any, max_tokens: Any, *, in_engine: bool = True,
              prompts: Any = None, critic: Any = None, engine_path: Any = "auto", **kwargs: Any) -> SMCResult:
    """:meth:`~genlm_vlm.AsyncLM.smc`: every argument checked (``in_engine``, ``engine_path``,
    ``prompts``, ``critic``, then :func:`prepare`'s), then :func:`run`."""
    check_flag(in_engine, "in_engine")
    engine_path = check_engine_path(engine_path)
    prompt, prompts, critic = check_options(lm, prompt_ids, max_tokens, prompts, critic, kwargs)
    prompt, controller = prepare(lm, prompt, constraint, n_particles, max_tokens, **kwargs)
    return await run(lm, prompt, controller, lora_name=kwargs.get("lora_name"), in_engine=in_engine,
                     prompts=prompts, critic=critic, engine_path=engine_path)
