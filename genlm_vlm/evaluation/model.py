"""The lm-eval model over a genlm_vlm model (see :mod:`genlm_vlm.evaluation`). Imports lm-eval."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import lm_eval.models  # noqa: F401 - lm-eval's own models registered before ours (its lazy registry)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from . import MODEL_NAME

logger = logging.getLogger(__name__)

#: ``model_args`` this class reads itself; every other one goes to ``vllm.LLM`` (checked).
_OWN_ARGS = (
    "pretrained", "max_length", "add_bos_token", "prefix_token_id", "max_gen_toks", "truncation",
    "lora_local_path", "max_lora_rank", "sessions", "forks", "cache_size", "chunk_size",
)
#: What lm-eval passes every model besides ``model_args`` (``--batch_size`` etc.): not needed
#: here, the engine batches every request of a task itself.
_IGNORED_ARGS = ("batch_size", "max_batch_size", "device")
#: Generation arguments accepted with the value that changes nothing.
_NO_OP_GEN_KWARGS = {"top_p": (1.0,), "top_k": (0, -1, None), "min_p": (0.0,), "repetition_penalty": (1.0,),
                     "num_beams": (1,)}
#: Name of the adapter registered from ``lora_local_path``.
ADAPTER_NAME = "lm_eval"
#: Rows per engine call on the row path (models without prompt log-probabilities).
_ROW_CHUNK = 256
#: First number of tokens generated per step of ``generate_until`` (doubled at every step): a
#: generation stops early at a stop sequence instead of always running ``max_gen_toks``.
_GEN_STEP = 32


class GenlmVLMEval(TemplateLM):
    """lm-evaluation-harness's ``LM`` interface over a genlm_vlm model.

    Build it from a model you have (an :class:`~genlm_vlm.AsyncVirtualLM`,
    :class:`~genlm_vlm.ReplicaPool` or :class:`~genlm_vlm.MockAsyncLM`)::

        lm_eval.simple_evaluate(model=GenlmVLMEval(lm), tasks=[...])

    or let lm-eval build it from ``--model_args pretrained=PATH,...`` (``python -m genlm_vlm
    eval``). ``model_args`` other than the ones below are ``vllm.LLM`` options (``dtype``,
    ``max_model_len``, ``block_size``, ...; an unknown name is an error naming the nearest one).

    Args:
        pretrained: a Hugging Face id or local path (an engine is built and owned), or an
            existing genlm_vlm model (used as it is; :meth:`close` leaves it open).
        max_length: the longest ``context + continuation`` window scored, minus one (lm-eval's
            convention); default and maximum ``max_model_len - 1``.
        add_bos_token, prefix_token_id: as in lm-eval's ``hf`` backend (tokenization and the
            token that prefixes an empty context and rolling windows; default BOS, else EOS).
        max_gen_toks: ``generate_until``'s default ``max_gen_toks`` (256).
        truncation: False (default): a request that does not fit (``context + continuation``
            over ``max_length + 1`` tokens; a generation prompt plus ``max_gen_toks`` over
            ``max_model_len``) is an error naming it. True: its context is cut from the left
            as lm-eval's ``hf`` and ``vllm`` backends do, with a warning.
        lora_local_path: a local LoRA adapter folder: registered as ``"lm_eval"`` and used for
            every request (the engine is built with ``enable_lora=True`` and ``max_lora_rank``).
        sessions, forks, cache_size, chunk_size: options of ``AsyncVirtualLM.from_name``.
    """

    def __init__(
        self,
        pretrained: Any = None,
        *,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        max_gen_toks: int = 256,
        truncation: bool = False,
        lora_local_path: str | None = None,
        max_lora_rank: int = 16,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        for name in _IGNORED_ARGS:
            kwargs.pop(name, None)
        if pretrained is None:
            raise ValueError(
                "genlm_vlm needs a model: --model_args pretrained=NAME_OR_PATH, or "
                "GenlmVLMEval(<an AsyncVirtualLM, ReplicaPool or MockAsyncLM>)"
            )
        self._owned = isinstance(pretrained, str)
        if self._owned:
            self.lm = _build(pretrained, kwargs, lora_local_path, max_lora_rank)
        else:
            if kwargs:
                raise ValueError(
                    f"unknown argument{'s' if len(kwargs) > 1 else ''} {', '.join(map(repr, kwargs))} "
                    "for an existing model (engine options apply only when genlm_vlm builds the model "
                    "from pretrained=NAME_OR_PATH)"
                )
            self.lm = pretrained
        self.lora_name: str | None = None
        if lora_local_path is not None:
            self.lm.add_new_lora(lora_local_path, ADAPTER_NAME)  # FileNotFoundError names a bad path
            self.lora_name = ADAPTER_NAME
        self.tokenizer = self.lm.tokenizer
        limit = int(self.lm.max_model_len)
        if max_length is not None and not (isinstance(max_length, int) and 1 <= max_length <= limit - 1):
            raise ValueError(f"max_length must be an int in [1, {limit - 1}] (max_model_len - 1), got {max_length!r}")
        self._max_length = max_length or limit - 1
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        if not (isinstance(max_gen_toks, int) and max_gen_toks >= 1):
            raise ValueError(f"max_gen_toks must be a positive int, got {max_gen_toks!r}")
        self._max_gen_toks = max_gen_toks
        self.truncation = bool(truncation)

    # ------------------------------------------------------------------ model facts
    @property
    def eot_token_id(self) -> int:
        """The EOS token (lm-eval's end of text)."""
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token before an empty context and a document's first rolling window."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Longest ``context + continuation`` scored is ``max_length + 1`` tokens."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """Recorded in lm-eval's results under ``config``."""
        from .._version import __version__

        info: dict[str, Any] = {"genlm_vlm_version": __version__, "genlm_vlm_model": type(self.lm).__name__}
        engine = getattr(self.lm, "engine_info", None)
        if engine is not None:
            info["vllm_version"] = getattr(engine, "vllm_version", None)
        return info

    def close(self) -> None:
        """Shut down the engine when this object built it (an existing model stays open)."""
        if self._owned:
            self.lm.cleanup()

    # ------------------------------------------------------------------ tokenization
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """As lm-eval's ``hf`` backend: special tokens per ``add_special_tokens``, else
        ``add_bos_token``, else the tokenizer's default; none when ``string`` starts with BOS."""
        if add_special_tokens is not None:
            extra = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            extra = {"add_special_tokens": self.add_bos_token}
        else:
            extra = {}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode([self.prefix_token_id])):
            extra["add_special_tokens"] = False
        return list(self.tokenizer.encode(string, **extra))

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template applied to ``chat_history`` (text, not tokens)."""
        apply = getattr(self.tokenizer, "apply_chat_template", None)
        if apply is None:
            raise NotImplementedError(f"{type(self.tokenizer).__name__} has no chat template")
        return apply(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                     continue_final_message=not add_generation_prompt)

    # ------------------------------------------------------------------ loglikelihood
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per request (lm-eval's tokenization)."""
        for i, req in enumerate(requests):
            if req.args[1] == "":
                raise ValueError(f"{_where(req, i)}: the continuation is empty; loglikelihood needs "
                                 "at least one token to score")
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        items = []
        for i, (key, context, continuation) in enumerate(requests):
            items.append(self._fit(list(context), list(continuation), key, i))
        results = self._score(items, disable_tqdm, "Running loglikelihood requests", greedy=True)
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _fit(self, context: list[int], continuation: list[int], key: Any, i: int) -> tuple[list[int], list[int]]:
        """The ``(prompt, continuation)`` scored for one request: checked, or cut from the left
        with ``truncation=True`` (as lm-eval's ``hf`` backend)."""
        where = _where_key(key, i)
        if not continuation:
            raise ValueError(f"{where}: the continuation has no tokens; loglikelihood needs at least one to score")
        if not context:
            raise ValueError(f"{where}: the context has no tokens (lm-eval gives an empty context the prefix token)")
        total, limit = len(context) + len(continuation), self.max_length + 1
        if total <= limit:
            return context, continuation
        if len(continuation) > self.max_length or not self.truncation:
            raise ValueError(
                f"{where}: context ({len(context)} tokens) + continuation ({len(continuation)}) = {total} tokens; "
                f"this model scores at most {limit} (max_length {self.max_length} + 1; max_model_len "
                f"{self.lm.max_model_len}). Shorten the request (fewer few-shot examples: --num_fewshot), "
                "build the engine with a larger max_model_len, or pass truncation=True to cut the context "
                "from the left as lm-eval's hf backend does"
                + (" (the continuation alone is too long for that)" if len(continuation) > self.max_length else "")
            )
        warnings.warn(f"{where}: {total} tokens exceed {limit}; cutting {total - limit} from the context's left",
                      stacklevel=3)
        kept = (context + continuation)[-limit:]
        return kept[: len(kept) - len(continuation)], continuation

    def _score(self, items: list[tuple[list[int], list[int]]], disable_tqdm: bool,
               desc: str, greedy: bool) -> list[tuple[float, bool]]:
        """``(sum of log-probabilities, greedy)`` for every ``(prompt, continuation)``, all sent
        at once: through vLLM's prompt log-probabilities where the model has them, else rows.
        With ``greedy=False`` the second value is always True and vLLM is asked for no top-1
        per position (the rolling windows: lm-eval reads no ``is_greedy`` there)."""
        out: list[tuple[float, bool] | None] = [None] * len(items)
        bar = tqdm(total=len(items), desc=desc, disable=disable_tqdm)
        try:
            hook = getattr(self.lm, "_score_futures", None)
            futures = None
            if callable(hook) and items:
                futures = hook([(tuple(p), tuple(c), self.lora_name, 0) for p, c in items], "auto", greedy=greedy)
            if futures is not None:
                index = {f: i for i, f in enumerate(futures)}
                try:
                    for fut in cf.as_completed(futures):
                        found = fut.result()
                        out[index[fut]] = (float(found.logprobs.double().sum()), bool(found.greedy) if greedy else True)
                        bar.update(1)
                finally:
                    for fut in futures:
                        fut.cancel()
            else:
                self._score_rows(items, out, bar.update)
        finally:
            bar.close()
        return out  # type: ignore[return-value]

    def _score_rows(self, items: list[tuple[list[int], list[int]]], out: list[Any],
                    done: Callable[[int], Any]) -> None:
        """The row path: the rows of every prefix ``prompt + c_<t``, ``_ROW_CHUNK`` at a time,
        reduced to the token's log-probability and whether it is the row's argmax."""
        work = [(i, t) for i, (_, c) in enumerate(items) for t in range(len(c))]
        sums = [0.0] * len(items)
        greedy = [True] * len(items)
        left = [len(c) for _, c in items]
        for start in range(0, len(work), _ROW_CHUNK):
            chunk = work[start : start + _ROW_CHUNK]
            prefixes = [items[i][0] + items[i][1][:t] for i, t in chunk]
            rows = self.lm.batch_next_token_logprobs_sync(prefixes, lora_name=self.lora_name)
            targets = torch.tensor([items[i][1][t] for i, t in chunk], dtype=torch.long, device=rows.device)
            values = rows.gather(1, targets.unsqueeze(1)).squeeze(1).double().cpu().tolist()
            best = (rows.argmax(dim=1) == targets).cpu().tolist()
            del rows
            for (i, _), v, g in zip(chunk, values, best, strict=True):
                sums[i] += v
                greedy[i] = greedy[i] and bool(g)
                left[i] -= 1
                if left[i] == 0:
                    out[i] = (sums[i], greedy[i])
                    done(1)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, scored in lm-eval's rolling windows of ``max_length``
        tokens (the ``hf`` backend's windows); every window of every document goes at once."""
        windows: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (string,) = req.args
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )):
                windows.append((list(context), list(continuation)))
                owner.append(i)
        scores = self._score(windows, disable_tqdm, "Running loglikelihood_rolling windows", greedy=False)
        totals = [0.0] * len(requests)
        for i, (value, _) in zip(owner, scores, strict=True):
            totals[i] += value
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Text generated after each context up to a stop sequence, EOS or ``max_gen_toks``
        (greedy, or sampled at ``temperature``; ``seed`` in the generation arguments seeds it).
        Every request runs concurrently; the text is decoded as lm-eval's ``vllm`` backend does
        (special tokens kept) and cut at the first stop sequence."""
        eos = self.tokenizer.decode([self.eot_token_id]) or getattr(self.tokenizer, "eos_token", None)
        jobs = [self._gen_job(req, i, eos) for i, req in enumerate(requests)]
        bar = tqdm(total=len(jobs), desc="Running generate_until requests", disable=disable_tqdm)

        async def run_all() -> list[str]:
            async def one(job: dict[str, Any]) -> str:
                text = await self._generate(**job)
                bar.update(1)
                return text

            return list(await asyncio.gather(*(one(j) for j in jobs)))

        try:
            results = _run(run_all())
        finally:
            bar.close()
        for req, text in zip(requests, results, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return results

    def _gen_job(self, req: Any, i: int, eos: str | None) -> dict[str, Any]:
        context, gen_kwargs = req.args
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"{_where(req, i)}: generation arguments must be a dict, got {gen_kwargs!r}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        do_sample = kwargs.pop("do_sample", False)
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        temperature = temperature if do_sample else 0.0
        seed = kwargs.pop("seed", None)
        for key, value in kwargs.items():
            if value not in _NO_OP_GEN_KWARGS.get(key, ()):
                raise ValueError(
                    f"{_where(req, i)}: generation argument {key}={value!r} is not supported by genlm_vlm "
                    "(it takes until, max_gen_toks, do_sample, temperature and seed)"
                )
        ids = self.tok_encode(context)
        if not ids:
            ids = [self.prefix_token_id]
        limit = int(self.lm.max_model_len)
        if max_gen_toks >= limit:
            raise ValueError(f"{_where(req, i)}: max_gen_toks={max_gen_toks} leaves no room for a context "
                             f"(max_model_len {limit})")
        if len(ids) + max_gen_toks > limit:
            if not self.truncation:
                raise ValueError(
                    f"{_where(req, i)}: context ({len(ids)} tokens) + max_gen_toks ({max_gen_toks}) exceed "
                    f"max_model_len {limit}. Shorten the context (--num_fewshot), lower max_gen_toks, build "
                    "the engine with a larger max_model_len, or pass truncation=True to cut the context from "
                    "the left as lm-eval's backends do"
                )
            warnings.warn(f"{_where(req, i)}: cutting the context to its last {limit - max_gen_toks} tokens",
                          stacklevel=3)
            ids = ids[len(ids) + max_gen_toks - limit :]
        return {"ids": ids, "max_tokens": max_gen_toks, "until": until, "temperature": temperature,
                "seed": None if seed is None else int(seed) + i}

    async def _generate(self, ids: list[int], max_tokens: int, until: list[str], temperature: float,
                        seed: int | None) -> str:
        """Generate in growing steps (32, 64, ... tokens) until a stop sequence shows up, EOS,
        or ``max_tokens``; the text up to the first stop sequence."""
        out: list[int] = []
        step, k = _GEN_STEP, 0
        stops = [s for s in until if s]
        eos_ids = [] if self.eot_token_id is None else [self.eot_token_id]
        while len(out) < max_tokens:
            n = min(step, max_tokens - len(out))
            toks = await self.lm.sample(ids + out, max_tokens=n, eos_token_ids=eos_ids, temperature=temperature,
                                        seed=None if seed is None else seed + 1_000_003 * k, lora_name=self.lora_name)
            out.extend(toks)
            k += 1
            if len(toks) < n:  # EOS (stripped by sample)
                break
            if stops and any(s in self.tok_decode(out) for s in stops):
                break
            step *= 2
        return postprocess_generated_text(self.tok_decode(out), until, None)


register_model(MODEL_NAME)(GenlmVLMEval)


# ---------------------------------------------------------------------------- helpers
def _build(pretrained: str, kwargs: dict[str, Any], lora_local_path: str | None, max_lora_rank: int) -> Any:
    """An :class:`~genlm_vlm.AsyncVirtualLM` from ``model_args`` (genlm_vlm's options by name,
    the rest ``vllm.LLM`` options, checked before anything is loaded)."""
    from ..engine.options import check_option_names_early
    from ..vllm_lm import AsyncVirtualLM

    own = {k: kwargs.pop(k) for k in ("sessions", "forks", "cache_size", "chunk_size") if k in kwargs}
    engine_opts = dict(kwargs)
    try:
        check_option_names_early(engine_opts)
    except TypeError as e:
        names = str(e).split(" in engine_opts: ", 1)[-1].split("; ", 1)[0]
        raise ValueError(
            f"unknown model_args for genlm_vlm: {names}. model_args takes {', '.join(_OWN_ARGS)} "
            "and the keyword arguments of vllm.LLM"
        ) from None
    if lora_local_path is not None:
        import os

        path = os.path.abspath(os.path.expanduser(lora_local_path))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"lora_local_path: no such adapter folder: {path}")
        engine_opts.setdefault("enable_lora", True)
        engine_opts.setdefault("max_lora_rank", max_lora_rank)
    return AsyncVirtualLM.from_name(pretrained, engine_opts, **own)


def _where(req: Any, i: int) -> str:
    task = getattr(req, "task_name", None)
    doc = getattr(req, "doc_id", None)
    return f"request {i}" + (f" (task {task!r}, doc {doc})" if task is not None else "")


def _where_key(key: Any, i: int) -> str:
    if key is None:
        return f"request {i}"
    context = str(key[0])
    return f"request {i} (context {context[:40]!r}{'...' if len(context) > 40 else ''})"


def _run(coro: Any) -> Any:
    """Run ``coro`` to completion from synchronous code, also when called inside a running event
    loop (a notebook): then in a thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, name="genlm_vlm-lm-eval")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
