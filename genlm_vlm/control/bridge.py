"""genlm-control's SMC run in the engine: :func:`smc` (see docs/API.md, "genlm-control in the
engine").

A genlm-control token sampler targets ``sampler.target`` (times the critic, if any); whichever
sampler it is (direct, AWRS, eager), its particles are properly weighted for that target. When
the target is one :class:`~genlm.control.PromptedLLM` over a genlm_vlm model times Boolean
conditions, the same target is run here as :meth:`~genlm_vlm.AsyncLM.smc` with the locally
optimal proposal (on an :class:`~genlm_vlm.AsyncVirtualLM`: one burst on the engine thread),
with genlm-control's conventions: ``max_tokens`` counts the EOS, which is forced at the limit
and weighted by ``log P(EOS)`` (``force_eos=True``); the ``PromptedLLM``'s temperature tempers
the target (``target_temperature=``); the prompt, the EOS ids and the LoRA are the
``PromptedLLM``'s. The result is genlm-control's own ``Sequences``, whose ``log_ml`` is the run's
``log_marginal`` (the target's mass on the accepted texts that end within ``max_tokens``, EOS
included: :func:`to_sequences`).

A product of ``PromptedLLM``s (``llm1 * llm2 * ...``) targets ``prod_j p(x | prompt_j)`` times
the conditions, with EOS weighted by ``sum_j log P_j(EOS)``: it runs as
``lm.smc(None, ..., prompts=[prompt_1, ...], force_eos=True)`` when every factor has the same
model object, EOS (one token id: the engine sums the factors per id, which equals the product of
each factor's EOS mass only then), LoRA and temperature 1; anything else is refused, naming why.

Anything that cannot run exactly so is refused with :class:`UntranslatableError` naming the part
and why, or, with ``fallback=True``, run by genlm-control itself, per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..smc.constraints import AllOf, BoundConstraint, Constraint, TokenMask, usable_width
from .options import (
    FALLBACK_HINT,
    check_options,
    check_sampler,
    require_genlm_control,
    said_if_empty,
)
from .options import RESAMPLING as _RESAMPLING
from .translate import EmptyLanguageError, UntranslatableError, condition_constraint, is_json_schema

__all__ = ["Plan", "plan", "smc"]



def _unwrap(p: Any) -> Any:
    """``p`` without genlm-control's ``AutoBatchedPotential`` wrappers."""
    while type(p).__name__ == "AutoBatchedPotential":
        p = p.potential
    return p


def _factors(p: Any) -> list[Any]:
    """The factors of a product of potentials (a ``JsonSchema`` stays one factor)."""
    p = _unwrap(p)
    if type(p).__name__ == "Product" and not is_json_schema(p):
        return _factors(p.p1) + _factors(p.p2)
    return [p]


def _is_byte_join(f: Any) -> bool:
    try:
        return bool(f == b"".join)
    except Exception:  # noqa: BLE001 - an exotic callable's __eq__
        return False


class Plan:
    """What :func:`smc` runs: the ``PromptedLLM`` (``llms``: every factor of a product of
    prompts, ``llm`` the first) and the constraints of its conditions."""

    def __init__(self, llm: Any, constraints: list[Constraint], llms: Sequence[Any] | None = None) -> None:
        self.llm = llm
        self.constraints = constraints
        self.llms = list(llms) if llms else [llm]


def _conditions(factors: list[Any], where: str, json_schema: bool) -> tuple[list[Any], list[Any]]:
    """Split ``factors`` into PromptedLLMs and translated conditions; refuse the rest."""
    llms, out = [], []
    for f in factors:
        kind = type(f).__name__
        if kind == "PromptedLLM":
            llms.append(f)
            continue
        if kind == "Coerced":
            if not _is_byte_join(f.f):
                raise UntranslatableError(
                    f"{where}: coerce(..., f={f.f!r}) is not translated: only f=b''.join (the tokens' bytes, "
                    "concatenated) maps a byte condition onto token masks; coerce with f=b''.join"
                )
            inner = _factors(f.potential)
        else:
            inner = [f]
        for c in inner:
            try:
                out.append(condition_constraint(c, json_schema=json_schema))
            except UntranslatableError as e:
                raise type(e)(f"{where}: {e}") from None
    return llms, out


def plan(sampler: Any, critic: Any = None, *, json_schema: bool = False) -> Plan:
    """Check that ``sampler`` (and ``critic``) can run exactly in the engine and translate its
    conditions; raises :class:`UntranslatableError` naming the part that cannot, why, and what
    to do instead (``fallback=True`` among it, unless the condition accepts no text at all:
    :class:`~.translate.EmptyLanguageError`). A ``sampler`` that is not a genlm-control token
    sampler, or a ``critic`` that is not a potential, is a ``TypeError``."""
    check_sampler(sampler, critic)
    try:
        return _plan(sampler, critic, json_schema)
    except EmptyLanguageError:
        raise
    except UntranslatableError as e:
        if "fallback=True" in str(e):
            raise
        raise UntranslatableError(f"{e}{FALLBACK_HINT}") from None


def _plan(sampler: Any, critic: Any, json_schema: bool) -> Plan:
    kind = type(sampler).__name__
    if kind in ("DirectTokenSampler", "AWRS"):
        if kind == "AWRS" and not getattr(sampler, "proper_weights", True):
            raise UntranslatableError(
                "AWRS(proper_weights=False) is not properly weighted for its target, so no exact run reproduces it; "
                "AWRS(llm, condition) with proper_weights=True (the default) targets the same and runs in the engine"
            )
        llms, conds = _conditions(_factors(sampler.target), f"{kind}'s target", json_schema)
    elif kind == "SetTokenSampler":
        inner = type(sampler.set_sampler).__name__
        if inner != "EagerSetSampler":
            raise UntranslatableError(
                f"set sampler {inner}: only EagerSetSampler (eager_token_sampler) is mapped onto the engine; "
                "eager_token_sampler(llm, condition) or AWRS(llm, condition) targets the same"
            )
        llms, _ = _conditions(_factors(sampler.set_sampler.iter_potential), "eager_token_sampler's LM", json_schema)
        more, conds = _conditions(_factors(sampler.set_sampler.item_potential), "eager_token_sampler's condition",
                                  json_schema)
        llms += more
    else:
        raise UntranslatableError(
            f"{kind}: only direct_token_sampler, AWRS and eager_token_sampler are mapped onto the engine; "
            "direct_token_sampler(llm) or AWRS(llm, condition) over the same PromptedLLM runs there"
        )
    if critic is not None:
        if getattr(critic, "token_type", None) != getattr(sampler, "token_type", None):
            raise ValueError(  # what genlm-control's SMC says too
                f"the critic's token type ({getattr(critic, 'token_type', None)}) is not the sampler's "
                f"({getattr(sampler, 'token_type', None)}): coerce it, e.g. critic.coerce(llm, f=b''.join)"
            )
        c_llms, c_conds = _conditions(_factors(critic), "the critic", json_schema)
        if c_llms:
            raise UntranslatableError(
                "the critic has a PromptedLLM factor: a weighted critic twists the intermediate targets that "
                "resampling works on, which the engine's SMC does not do; only Boolean critics (BoolFSA, BoolCFG) "
                "are folded into the mask"
            )
        conds += c_conds
    if not llms:
        raise UntranslatableError(
            "the target has no PromptedLLM factor: there is no language model to run; build the sampler over a "
            "PromptedLLM of a genlm_vlm model, e.g. AWRS(PromptedLLM(lm, ...), condition)"
        )
    llm = llms[0]
    from ..base import AsyncLM

    if not isinstance(llm.model, AsyncLM):
        raise UntranslatableError(
            f"the PromptedLLM's model is a {type(llm.model).__name__}, not a genlm_vlm model; build the PromptedLLM "
            "over one, e.g. PromptedLLM(genlm_vlm.AsyncVirtualLM.from_name(name), ...)"
        )
    try:
        tau = float(llm.temperature)
    except (TypeError, ValueError):
        tau = math.nan
    if not 0.0 < tau < math.inf:
        raise UntranslatableError(
            f"PromptedLLM(temperature={llm.temperature!r}): the target temperature must be a finite number > 0; "
            "use llm.spawn(temperature=1.0) (or another t > 0)"
        )
    if len(llms) > 1:
        _check_product(llms)
    _check_padding(llm)
    return Plan(llm, conds, llms)


def _check_padding(llm: Any) -> None:
    """Refuse a ``PromptedLLM`` whose vocabulary holds padded logit columns (ids past the last
    token with bytes or EOS): genlm-control proposes them as empty tokens wherever the condition
    can still be completed (with no condition, everywhere), and ``lm.smc`` never reads those
    columns (its controller stops at the usable width), so the targets would differ by their mass."""
    from ..smc.api import bind_cache, text_vocab

    lm = llm.model
    reach = _reach(text_vocab(lm), list(llm.token_maps.eos_idxs), lm.vocab_size, bind_cache(lm))
    padded = [i for i in _empty_ids(llm) if i >= reach]
    if padded:
        raise UntranslatableError(
            f"the PromptedLLM's vocabulary holds {len(padded)} padded logit columns (ids {padded[0]}..{padded[-1]}, "
            "no token stands for them): genlm-control proposes them as empty tokens, the engine's SMC never reads "
            "those columns, so the targets differ. Build the PromptedLLM over genlm_vlm.without_padding(lm) (rows "
            "renormalised over the real tokens, as the engine's), or pass fallback=True"
        )


def _check_product(llms: list[Any]) -> None:
    """Refuse a product of ``PromptedLLM``s that ``lm.smc(prompts=...)`` does not run exactly:
    they must share the model object, the EOS token (exactly one id), the LoRA and temperature 1."""
    first = llms[0]
    where = f"a product of {len(llms)} PromptedLLMs"
    for j, other in enumerate(llms[1:], start=1):
        if other.model is not first.model:
            raise UntranslatableError(
                f"{where}: factor {j}'s model is another object than factor 0's; a product of prompts runs "
                "on one genlm_vlm model: use the same model object for every PromptedLLM"
            )
        if list(other.token_maps.eos_idxs) != list(first.token_maps.eos_idxs):
            raise UntranslatableError(
                f"{where}: factor {j}'s EOS ids {list(other.token_maps.eos_idxs)} differ from factor 0's "
                f"{list(first.token_maps.eos_idxs)}; the product ends every factor at the same EOS: build every "
                "factor with the same eos_byte_strings"
            )
        if other.lora_name != first.lora_name:
            raise UntranslatableError(
                f"{where}: factor {j}'s lora_name={other.lora_name!r} differs from factor 0's "
                f"{first.lora_name!r}; a product of prompts runs every factor under one adapter: give every "
                "factor the same lora_name"
            )
    for j, f in enumerate(llms):
        if f.temperature != 1:
            raise UntranslatableError(
                f"{where}: factor {j} has temperature={f.temperature!r}; a product of prompts runs at "
                "temperature 1 only (lm.smc(prompts=) takes no target_temperature): spawn the factors with "
                "temperature=1.0"
            )
    eos = list(first.token_maps.eos_idxs)
    if len(eos) != 1:
        raise UntranslatableError(
            f"{where}: {len(eos)} EOS ids {eos}; the product's EOS weight is the product of each factor's "
            "summed EOS probability, while the engine sums the factors' product per id: they agree for one "
            "EOS id only: use one eos_byte_string that is one token"
        )


# ------------------------------------------------------------------------------ constraints
class _WithEmptyTokens(Constraint):
    """``inner``, plus tokens with no bytes wherever the text so far can still be completed
    (a byte condition coerced with ``b''.join`` allows them there: they add no bytes).
    ``inner`` is one of the bridge's xgrammar constraints, which allow only tokens with bytes and
    the EOS ids (:func:`~genlm_vlm.smc.constraints.usable_width` bounds them)."""

    def __init__(self, inner: Constraint, empty_ids: Sequence[int]) -> None:
        self.inner = inner
        self.empty_ids = list(empty_ids)

    def bind(self, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int,
             cache: dict[Any, Any] | None = None) -> BoundConstraint:
        reach = _reach(byte_vocab, eos_ids, width, cache)
        return _BoundWithEmpty(self.inner.bind(byte_vocab, eos_ids, width, cache), self.empty_ids, reach)

    def describe(self) -> str:
        return f"{self.inner.describe()} (tokens with no bytes allowed)"


def _reach(byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int, cache: dict[Any, Any] | None) -> int:
    """The usable width (one past the last token with bytes or EOS id, at most ``width``), kept
    in ``cache`` (the model's bind cache): a scan back over the padding once per model and EOS."""
    key = ("usable_width", tuple(int(e) for e in eos_ids), width)
    reach = None if cache is None else cache.get(key)
    if reach is None:
        reach = min(width, usable_width(byte_vocab[:width], eos_ids))
        if cache is not None:
            cache[key] = reach
    return reach


class _BoundWithEmpty(BoundConstraint):
    """``inner``'s masks with the empty tokens added to every row that allows something.
    ``reach``: one past the last column ``inner`` can allow."""

    def __init__(self, inner: BoundConstraint, empty_ids: list[int], reach: int) -> None:
        self.inner = inner
        self.empty = np.array(empty_ids, dtype=np.int64)
        self.is_empty = np.zeros(int(self.empty.max()) + 1 if self.empty.size else 0, dtype=bool)
        self.is_empty[self.empty] = True
        self.reach = reach
        self._extra: dict[tuple[int, int], Any] = {}

    @property
    def seconds(self) -> float:  # type: ignore[override]
        return self.inner.seconds

    def initial(self) -> Any:
        return self.inner.initial()

    def masks(self, states: Sequence[Any]) -> np.ndarray:
        m = np.array(self.inner.masks(states), dtype=bool, copy=True)
        live = m.any(axis=1)
        m[np.ix_(live, self.empty)] = True
        return m

    def bitmasks_upto(self, states: Sequence[Any], width: int) -> Any:
        """:meth:`masks` packed, for a caller reading the first ``width`` columns (the SMC
        controller: the usable width), without unpacking: ``inner``'s bitmasks, with the empty
        tokens below ``width`` ORed into the rows that allow something. Every column ``inner``
        can allow lies below ``reach``, so when ``width >= reach`` those rows are the rows
        :meth:`masks` finds alive; a narrower caller gets the full path."""
        import torch

        if width < self.reach:
            return BoundConstraint.bitmasks(self, states)
        bits = self.inner.bitmasks_upto(states, width)
        extra = self._extra_bits(int(bits.shape[1]), int(width))
        if extra is None:
            return bits
        live = bits.ne(0).any(dim=1, keepdim=True)
        return torch.where(live, bits | extra, bits)

    def _extra_bits(self, words: int, width: int) -> Any:
        """``int32 [words]``: the empty tokens below ``width`` as bits (None: there are none)."""
        import torch

        key = (words, width)
        if key not in self._extra:
            ids = self.empty[self.empty < min(width, 32 * words)]
            if ids.size == 0:
                self._extra[key] = None
            else:
                acc = np.zeros(words, dtype=np.uint32)
                np.bitwise_or.at(acc, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
                self._extra[key] = torch.from_numpy(acc.view(np.int32))
        return self._extra[key]

    def advance(self, state: Any, token: int) -> Any:
        t = int(token)
        if t < self.is_empty.size and self.is_empty[t]:
            return state
        return self.inner.advance(state, token)

    def copy(self, state: Any) -> Any:
        return self.inner.copy(state)


def constraint_for(p: Plan) -> Constraint:
    """The one constraint :func:`smc` passes to ``lm.smc`` for plan ``p``."""
    llm = p.llm
    ids = [t.token_id for t in llm.vocab]
    width = llm.model.vocab_size
    empty = _empty_ids(llm)
    if not p.constraints:  # a TokenMask allows no token without bytes: the empty ones come back below
        allowed = np.zeros(width, dtype=bool)
        allowed[ids] = True
        allowed[list(llm.token_maps.eos_idxs)] = True
        inner: Constraint = TokenMask(lambda states: np.repeat(allowed[None, :], len(states), axis=0),
                                      "PromptedLLM's vocabulary")
    else:
        inner = p.constraints[0] if len(p.constraints) == 1 else AllOf(*p.constraints)
    return _WithEmptyTokens(inner, empty) if empty else inner


def _empty_ids(llm: Any) -> list[int]:
    """Ids of the ``PromptedLLM``'s vocabulary tokens that have no bytes (in the model's byte
    vocabulary, where special tokens have their literal text: so none of these is a special
    token, which no constraint allows). The model's ids with no bytes are found once per model
    (kept on it); each run only looks those few up in the ``PromptedLLM``'s own table
    (``lookup``), instead of scanning its whole vocabulary. (The grammars read every token's
    bytes from the model too: :func:`~genlm_vlm.smc.api.text_vocab`.)"""
    lm = llm.model
    model_empty = lm.__dict__.get("_bridge_empty_ids")
    if model_empty is None:
        model_empty = lm.__dict__["_bridge_empty_ids"] = [i for i, b in enumerate(lm._byte_strings) if not b]
    lookup = getattr(llm, "lookup", None)
    decode = llm.token_maps.decode
    if lookup is None:  # not a genlm-control Potential's layout: scan
        return [t.token_id for t in llm.vocab if len(t.byte_string) == 0]
    eos = set(llm.token_maps.eos_idxs)
    return [i for i in model_empty if i < len(decode) and i not in eos and decode[i] in lookup]


# ------------------------------------------------------------------------------ the run
async def smc(sampler: Any, n_particles: int, ess_threshold: float, max_tokens: int, *, critic: Any = None,
              seed: int | None = None, fallback: bool = False, json_schema: bool = False,
              resampling_method: str = "multinomial", in_engine: bool = True, engine_path: str = "auto",
              mask_overlap: bool = False) -> Any:
    """``sampler.smc(n_particles, ess_threshold, max_tokens, critic=critic)`` of genlm-control,
    run as :meth:`~genlm_vlm.AsyncLM.smc` on the ``PromptedLLM``'s genlm_vlm model (on an
    :class:`~genlm_vlm.AsyncVirtualLM`, in the engine). Same target, same ``max_tokens``
    convention (EOS included, forced at the limit with its ``log P(EOS)`` weight); returns
    genlm-control's ``Sequences`` (``.posterior``, ``.decoded_posterior``, ``.log_ml``: ``lm.smc``'s
    ``log_marginal``, see :func:`to_sequences`). A run whose particles all die warns as ``lm.smc``
    does (:class:`~genlm_vlm.smc.EmptyPosteriorWarning`).

    ``sampler``: ``direct_token_sampler(llm)``, ``AWRS(llm, condition)`` or
    ``eager_token_sampler(llm, condition)``, ``llm`` one ``PromptedLLM`` or a product of them
    (``llm1 * llm2``: same model object, one EOS id, same LoRA, temperature 1; run with
    ``prompts=``); the conditions (and ``critic``) Boolean:
    ``BoolFSA``, ``BoolCFG`` (ASCII), products of these, coerced with ``f=b"".join``;
    ``JsonSchema`` with ``json_schema=True`` only (xgrammar's JSON language, see docs/API.md).
    ``seed`` makes the engine run reproducible. Anything else raises
    :class:`~genlm_vlm.control.translate.UntranslatableError` naming what, why and what to do
    instead; with ``fallback=True`` genlm-control runs it itself, per token, instead. Options of
    the wrong type raise ``TypeError``, before anything runs. ``engine_path`` and ``mask_overlap``
    are passed to ``lm.smc`` (defaults ``"auto"`` and False, as there; checked as there, before
    anything runs; ignored by ``in_engine=False`` and ``fallback``'s runs).

    A run in which no particle finished (every particle died, e.g. at the forced EOS where the
    condition does not accept the text yet) warns (:class:`~genlm_vlm.smc.EmptyPosteriorWarning`) that the posterior is empty
    and says what to change; ``Sequences`` is returned all the same.
    """
    check_options(n_particles, ess_threshold, max_tokens, seed, fallback, json_schema, resampling_method, in_engine,
                  engine_path, mask_overlap)
    check_sampler(sampler, critic)
    if resampling_method not in _RESAMPLING:
        if not fallback:
            raise UntranslatableError(
                f"resampling_method={resampling_method!r} is not one of lm.smc's ({', '.join(_RESAMPLING)}): "
                f"use one of those{FALLBACK_HINT}"
            )
        return said_if_empty(await _fallback(sampler, n_particles, ess_threshold, max_tokens, critic,
                                              resampling_method), max_tokens)
    try:
        p = plan(sampler, critic, json_schema=json_schema)
    except UntranslatableError:
        if not fallback:
            raise
        return said_if_empty(await _fallback(sampler, n_particles, ess_threshold, max_tokens, critic,
                                              resampling_method), max_tokens)
    llm = p.llm
    if len(p.llms) > 1:  # a product of prompts: lm.smc(None, ..., prompts=[...]), temperature 1
        prompt, extra = None, {"prompts": [list(f.prompt_ids) for f in p.llms]}
    else:
        prompt, extra = list(llm.prompt_ids), {"target_temperature": float(llm.temperature)}
    result = await llm.model.smc(
        prompt, constraint_for(p), n_particles, max_tokens, ess_threshold=ess_threshold,
        resampling=resampling_method, seed=seed, lora_name=llm.lora_name,
        eos_token_ids=list(llm.token_maps.eos_idxs), force_eos=True, in_engine=in_engine,
        engine_path=engine_path, mask_overlap=mask_overlap, **extra,
    )
    seqs = to_sequences(llm, result)
    # A result that carries its own reason (empty_reason) was announced by lm.smc already.
    return seqs if getattr(result, "empty_reason", None) else said_if_empty(seqs, max_tokens)


async def _fallback(sampler: Any, n_particles: int, ess_threshold: float, max_tokens: int, critic: Any,
                    resampling_method: str) -> Any:
    return await sampler.smc(n_particles, ess_threshold, max_tokens, critic=critic,
                             resampling_method=resampling_method)


def to_sequences(llm: Any, result: Any) -> Any:
    """An :class:`~genlm_vlm.smc.SMCResult` as genlm-control's ``Sequences``: contexts of the
    ``PromptedLLM``'s tokens, ending with genlm-control's ``EOS`` where the particle finished.

    ``Sequences`` computes ``log_ml``, ``log_total``, ``ess`` and its posteriors itself from the
    log weights it is given (``log_ml = log mean_i exp(log_weights[i])`` over all ``N``), so the
    weights handed over make them ``lm.smc``'s: a finished particle's log weight plus the
    resampling steps' log normalisers (the same for every particle), a cut or dead particle's
    ``-inf`` (they count zero in ``log_marginal``). Then ``log_ml`` is ``log_marginal`` (up to
    float rounding: it is summed again), ``posterior`` the finished texts' normalised weights,
    and ``ess`` the effective sample size of the finished particles' final weights (not the
    run's per-step ``ess``). With the bridge's ``force_eos=True`` no particle is cut."""
    require_genlm_control("genlm_vlm.control.smc")
    from genlm.control.constant import EOS
    from genlm.control.sampler.sequence import Sequences

    decode = llm.token_maps.decode
    lw = np.array([p.log_weight if p.finished else -math.inf for p in result.particles], dtype=np.float64)
    top = float(np.max(lw)) if lw.size else -math.inf
    if math.isfinite(top) and math.isfinite(result.log_marginal):
        current = top + math.log(float(np.mean(np.exp(lw - top))))
        lw = lw + (result.log_marginal - current)  # the weight the resampling steps averaged away
    contexts = []
    for part in result.particles:
        ctx: list[Any] = [decode[t] for t in part.token_ids]
        if part.finished:
            ctx.append(EOS)
        contexts.append(ctx)
    return Sequences(contexts, [float(w) for w in lw])

