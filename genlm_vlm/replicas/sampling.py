"""Sampling on a :class:`~.pool.ReplicaPool`: each prompt on the replica it routes to.

A mixin (kept apart so each file stays readable); validation and the context-limit warning
follow :class:`~genlm_vlm.AsyncVirtualLM`'s.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

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
        self._warn_context_limit([spec[0]], outs, max_tokens)
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
        self._warn_context_limit([s[0] for s in specs], outs, max_tokens)
        return outs

    def _sample_spec(self, prompt: Any, max_tokens: Any, eos: Any, temperature: Any, seed: Any,
                     lora_name: str | None, what: str = "prompt_token_ids") -> tuple[tuple[Any, ...], Adapter | None]:
        self._check_open()
        spec = self._check_sample_args(prompt, max_tokens, eos, temperature, seed, what)
        return spec, self._loras.resolve(lora_name)

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
