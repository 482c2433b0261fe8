"""Sampling on a :class:`~.pool.ReplicaPool`: each prompt on the replica it routes to.

A mixin (kept apart so each file stays readable); validation and the context-limit warning
follow :class:`~genlm_vlm.AsyncVirtualLM`'s.
"""

from __future__ import annotations

import asyncio
import numbers
import warnings
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import TokenIds
from ..lora import Adapter


class SamplingMixin:
    """``sample`` / ``batch_sample`` (see :class:`~.pool.ReplicaPool`)."""

    max_model_len: int

    async def sample(
        self,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """As :meth:`genlm_vlm.AsyncVirtualLM.sample`, on the replica the prompt routes to."""
        spec, adapter = self._sample_spec(prompt_token_ids, max_tokens, eos_token_ids, temperature, seed, lora_name)
        outs = await self._samples([spec], adapter)
        self._warn_context_limit([spec], outs)
        return outs[0]

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[TokenIds],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        """:meth:`sample` per prompt; with ``seed``, prompt ``i`` uses ``seed + i``."""
        made = [
            self._sample_spec(p, max_tokens, eos_token_ids, temperature, None if seed is None else seed + i,
                              lora_name, f"prompt_token_ids_list[{i}]")
            for i, p in enumerate(prompt_token_ids_list)
        ]
        if not made:
            return []
        specs = [s for s, _ in made]
        outs = await self._samples(specs, made[0][1])
        self._warn_context_limit(specs, outs)
        return outs

    def _sample_spec(self, prompt: Any, max_tokens: Any, eos: Any, temperature: Any, seed: Any,
                     lora_name: str | None, what: str = "prompt_token_ids") -> tuple[tuple[Any, ...], Adapter | None]:
        self._check_open()
        ids = self._check_ids(prompt, what)
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if isinstance(eos, int):
            eos = [eos]
        eos_ids = self._check_ids(eos, "eos_token_ids") if len(eos) else ()
        if not isinstance(temperature, numbers.Real) or temperature < 0 or not np.isfinite(temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        spec = (ids, max_tokens, eos_ids, float(temperature), None if seed is None else int(seed))
        return spec, self._loras.resolve(lora_name)

    def _warn_context_limit(self, specs: Sequence[tuple[Any, ...]], outs: Sequence[list[int]]) -> None:
        from ..base import ContextLimitWarning

        cut = [i for i, (s, o) in enumerate(zip(specs, outs, strict=True))
               if len(o) < s[1] and len(s[0]) + len(o) >= self.max_model_len]
        if cut:
            which = "the sample" if len(specs) == 1 else f"{len(cut)} of {len(specs)} samples (first: index {cut[0]})"
            warnings.warn(
                f"{which} stopped at the context limit max_model_len={self.max_model_len} before "
                "max_tokens and before an EOS token. Shorten the prompt, or build the pool with a "
                "larger max_model_len (engine_opts={'max_model_len': N}).",
                ContextLimitWarning, stacklevel=3,
            )

    async def _samples(self, specs: list[tuple[Any, ...]], adapter: Any) -> list[list[int]]:
        akey = 0 if adapter is None else adapter.int_id
        lora = None if adapter is None else adapter.name
        routes = self._router.route_many([(akey, s[0]) for s in specs], record=False)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, route in enumerate(routes):
            groups[route].append(i)
        keys = list(groups)
        results = await asyncio.gather(
            *(self._await_call(r, g, len(groups[(r, g)]), "sample", [specs[i] for i in groups[(r, g)]], lora)
              for r, g in keys),
            return_exceptions=True,
        )
        outs: list[list[int]] = [[] for _ in specs]
        for key, res in zip(keys, results, strict=True):
            if isinstance(res, BaseException):
                raise res
            for i, o in zip(groups[key], res, strict=True):
                outs[i] = list(o)
        return outs
