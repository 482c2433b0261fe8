"""Two options of ``lm.smc``: a product of prompts (``prompts=``) and a terminal critic (``critic=``).

**Product of prompts.** With ``prompts=[p_1, ..., p_k]`` (``k >= 2``, ``prompt_ids=None``) the
target is ``prod_j p(x | p_j)`` on the constraint's language. The runner keeps one context per
factor per particle (``p_j + generated``), computes the ``k`` rows of each particle in the same
round and hands the controller their float32 sum (:func:`~.controller.fold_rows`): unnormalised
log weights ``sum_j log p(x_t | p_j, x_<t)``. The locally optimal proposal on such rows is exact:
it draws ``q(x) ∝ prod_j p_j(x)`` on the mask and the weight grows by
``logsumexp_mask sum_j log p_j(x)``, so the final weights target the product and
``log_marginal`` estimates ``log sum_x prod_j p(x EOS | p_j)`` over the accepted texts that end
within ``max_tokens`` (the finished particles, as in a one-prompt run;
``log_marginal_cut`` the cut ones' ``sum_s prod_j p(s | p_j)``). With ``temperature`` t the
proposal is ``∝ prod_j p_j(x)^(1/t)`` and the weights still target the product
(``row - log q``); ``t = 0`` is greedy on the product.

**Terminal critic.** ``critic(texts) -> log weights``, one per finished particle, called once
when the run has returned (never on the engine thread), batched: ``texts`` are the finished
particles' bytes in particle order (it is not called when none finished). It may be a
coroutine function. Its values (floats; ``-inf`` allowed, NaN and ``+inf`` not) are added to
those particles' log weights; ``posterior`` is renormalised over the finished particles and
``log_marginal`` follows its one definition (:func:`~.algorithm.log_marginals`) with the new
weights: ``log_marginal + lse(finished after) - lse(finished before)``, i.e.
``L * mean_i w_i c(x_i) 1[i finished]`` (``L``: the resampling steps' factors), unbiased for ``sum_x p(x EOS) c(x)`` over the accepted texts that
end within ``max_tokens``, since SMC's ``L * mean_i w_i f(x_i)`` is unbiased for any function
``f`` of the final particles. The cut and dead particles, which the critic does not see, keep
their weights (``log_marginal_cut`` is unchanged). A critic that weighs every finished text
zero empties ``posterior`` (``log_marginal = -inf``; ``empty_reason`` says so).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .algorithm import _logsumexp, posterior_of

Tokens = tuple[int, ...]


def check_prompts(lm: Any, prompt_ids: Any, prompts: Any, max_tokens: Any = None) -> tuple[Tokens, ...] | None:
    """``prompts`` checked for ``lm``: None (one prompt, ``prompt_ids``), or a tuple of ``k >= 2``
    prompts, each non-empty, in the vocabulary and with ``len + max_tokens <= max_model_len``;
    ``prompt_ids`` must then be None. Anything else raises ``ValueError``/``TypeError`` naming it."""
    if prompts is None:
        return None
    if prompt_ids is not None:
        raise ValueError("pass prompt_ids=None with prompts= (the factors' prompts replace prompt_ids)")
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists (one per factor), got {type(prompts).__name__}")
    if prompts and all(isinstance(p, numbers.Integral) for p in prompts):
        raise TypeError("prompts must be a list of token-id lists (one per factor), got one list of ints: "
                        "pass prompt_ids= for a single prompt")
    if len(prompts) < 2:
        raise ValueError(f"prompts needs at least 2 prompts (a product of factors), got {len(prompts)}: "
                         "pass prompt_ids= for a single prompt")
    out = tuple(lm._check_ids(p, f"prompts[{j}]") for j, p in enumerate(prompts))
    limit = getattr(lm, "max_model_len", None)
    # max_tokens of another type is prepare's TypeError, after this
    if isinstance(limit, int) and isinstance(max_tokens, numbers.Integral) and not isinstance(max_tokens, bool):
        for j, p in enumerate(out):
            if len(p) + int(max_tokens) > limit:
                raise ValueError(
                    f"prompts[{j}] ({len(p)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len={limit}: "
                    f"lower max_tokens to at most {limit - len(p)}"
                )
    return out


def resolve_prompts(lm: Any, prompt_ids: Any, prompts: Any, max_tokens: Any = None
                    ) -> tuple[Tokens, tuple[Tokens, ...] | None]:
    """``(the run's first prompt, the checked prompts or None)``: ``prompt_ids`` checked when
    ``prompts`` is None, else :func:`check_prompts` (the first prompt is ``prompts[0]``)."""
    checked = check_prompts(lm, prompt_ids, prompts, max_tokens)
    return (lm._check_ids(prompt_ids, "prompt_ids") if checked is None else checked[0]), checked


def check_options(lm: Any, prompt_ids: Any, max_tokens: Any, prompts: Any, critic: Any,
                  others: dict[str, Any]) -> tuple[Tokens, tuple[Tokens, ...] | None, Any]:
    """``lm.smc``'s ``prompts`` and ``critic`` checked, and their combination with its other
    options (``others``): ``(the run's first prompt, the prompts or None, the critic or None)``.
    A product of prompts refuses a ``target_temperature`` other than 1: tempering normalises
    each step's summed row, which would target the locally normalised product, not
    ``prod_j p(x | p_j)``."""
    prompt, checked = resolve_prompts(lm, prompt_ids, prompts, max_tokens)
    tau = others.get("target_temperature")
    # a target_temperature that is not a number is prepare's TypeError, after this
    if checked is not None and isinstance(tau, numbers.Real) and not isinstance(tau, bool) and tau != 1:
        raise ValueError(f"prompts= (a product of prompts) takes no target_temperature (got {tau!r}): tempering "
                         "normalises each step's product, a different target; use temperature= (the proposal)")
    return prompt, checked, check_critic(critic)


def check_critic(critic: Any) -> Any:
    """``critic``: None or a callable (a function or coroutine function of a list of bytes)."""
    if critic is not None and not callable(critic):
        raise TypeError(f"critic must be a callable of the finished texts (list[bytes]) or None, "
                        f"got {type(critic).__name__}")
    return critic


def _name(critic: Any) -> str:
    return getattr(critic, "__qualname__", None) or type(critic).__name__


def critic_values(critic: Any, values: Any, n: int) -> list[float]:
    """``critic``'s answer for ``n`` finished texts checked: ``n`` real numbers, none NaN or
    ``+inf`` (``-inf``: weight zero); else ``ValueError``/``TypeError`` naming the critic."""
    if hasattr(values, "tolist") and hasattr(values, "dtype"):
        values = values.tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"the critic {_name(critic)!r} must return a sequence of log weights (one per finished "
                        f"text), got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"the critic {_name(critic)!r} returned {len(values)} log weights for {n} finished texts")
    out = []
    for i, v in enumerate(values):
        v = v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"the critic {_name(critic)!r} returned {v!r} ({type(v).__name__}) at [{i}]: "
                            "a log weight must be a real number")
        f = float(v)
        if math.isnan(f) or f == math.inf:
            raise ValueError(f"the critic {_name(critic)!r} returned {f} at [{i}]: a log weight must be finite "
                             "or -inf (weight zero)")
        out.append(f)
    return out


def apply_critic(result: Any, critic: Any, values: Any) -> Any:
    """Reweight ``result`` (an :class:`~.algorithm.SMCResult`) by the critic's ``values`` for
    its finished particles (checked by :func:`critic_values`): their log weights grow by them,
    ``posterior``, ``log_marginal`` and ``empty_reason`` are recomputed (see the module
    docstring)."""
    done = [p for p in result.particles if p.finished]
    add = critic_values(critic, values, len(done))
    before = _logsumexp(np.array([p.log_weight for p in done], dtype=np.float64))
    for p, c in zip(done, add, strict=True):
        p.log_weight = p.log_weight + c
    after = _logsumexp(np.array([p.log_weight for p in done], dtype=np.float64))
    if math.isfinite(result.log_marginal) and math.isfinite(before):
        # log L + lse(finished) - log N, with log L = log_marginal - lse(before) + log N
        result.log_marginal = result.log_marginal + (after - before) if math.isfinite(after) else -math.inf
    result.posterior = posterior_of(result.particles)
    if not result.posterior and result.empty_reason is None:
        result.empty_reason = (
            f"the critic {_name(critic)!r} weighed every finished text zero ({len(done)} of {len(result.particles)} "
            "particles finished, each given -inf): log_marginal is -inf and posterior is empty"
        )
    return result


async def criticise(result: Any, critic: Any) -> Any:
    """Call ``critic`` on ``result``'s finished texts (awaiting it if it is a coroutine
    function) and apply it (:func:`apply_critic`); not called when nothing finished."""
    texts = [p.text for p in result.particles if p.finished]
    t0 = time.perf_counter()
    if texts:
        values = critic(texts)
        if inspect.isawaitable(values):
            values = await values
        apply_critic(result, critic, values)
    result.stats["critic_s"] = round(time.perf_counter() - t0, 6)
    return result


def criticise_sync(result: Any, critic: Any) -> Any:
    """:func:`criticise` for a blocking caller (``smc_sync``): an awaitable answer is awaited in
    a fresh event loop (on a helper thread if this thread runs one)."""
    texts = [p.text for p in result.particles if p.finished]
    t0 = time.perf_counter()
    if texts:
        values = critic(texts)
        if inspect.isawaitable(values):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                values = asyncio.run(_wait(values))
            else:
                with ThreadPoolExecutor(1) as pool:
                    values = pool.submit(asyncio.run, _wait(values)).result()
        apply_critic(result, critic, values)
    result.stats["critic_s"] = round(time.perf_counter() - t0, 6)
    return result


async def _wait(awaitable: Any) -> Any:
    return await awaitable
