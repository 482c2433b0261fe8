"""The controller seam (``lm.run_controller``, ``lm.smc``) fails only the run whose controller,
mask or ``start`` is wrong, on the real engine (issue 35, cases 1, 2, 3, 4, 6 and 7).

Every test runs its faulty runs beside a witness: a seeded ``sample`` and a fresh row, which must
equal their undisturbed values bit for bit; then a later run must equal its per-token reference
(:func:`genlm_vlm.smc.drive`). Where the reference can meet the same mistake it raises the same
message (both check with :class:`~genlm_vlm.smc.controller.ParticleSet`). Each test failed on the
code before the fix (the engine died, callers hung or failed with vLLM's errors).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import types

import numpy as np
import pytest
import torch

from genlm_vlm.smc import Controller, ControllerError, Decision, Regex, TokenMask, drive

#: No faulty run may leave its caller waiting: a hang fails the test after this long.
TIMEOUT = 120
_fresh = itertools.count(40)  # witness rows: a prefix no earlier call asked for
_solo: dict[int, list[int]] = {}


def _prompt(lm) -> list[int]:
    tok = lm.tokenizer
    return [tok.bos_token_id, *tok.encode("def main():\n    return", add_special_tokens=False)]


class Argmax(Controller):
    """Particle ``i`` takes its row's ``(i+1)``-th likeliest token; the run stops after
    ``steps`` steps. At step ``at``, ``decide(tokens)`` makes the decision instead (a mistake).
    The result: what each particle was fed."""

    def __init__(self, n, steps, at=None, decide=None):
        self.n_particles, self.steps, self.at, self.decide, self.seen = n, steps, at, decide, 0

    def step(self, rows, particles):
        self.seen += 1
        order = rows.argsort(dim=1, descending=True)
        tokens = [int(order[k, i]) for k, i in enumerate(particles)]
        if self.seen == self.at:
            return self.decide(tokens)
        return Decision(tokens, stop=self.seen >= self.steps)

    def result(self, generated):
        return [list(g) for g in generated]


async def _beside(lm, *runs):
    """Await ``runs`` beside a seeded sample and a fresh row (exceptions returned as values);
    check both witnesses equal their undisturbed values, and a later run its reference."""
    prompt = _prompt(lm)
    if id(lm) not in _solo:
        _solo[id(lm)] = await lm.sample(prompt, max_tokens=6, eos_token_ids=[], seed=5)
    other = [*prompt[:-1], next(_fresh)]
    *out, sample, row = await asyncio.wait_for(asyncio.gather(
        *runs, lm.sample(prompt, max_tokens=6, eos_token_ids=[], seed=5), lm.next_token_logprobs(other),
        return_exceptions=True,
    ), TIMEOUT)
    assert sample == _solo[id(lm)], sample
    assert torch.equal(row, lm.next_token_logprobs_sync(other))  # computed beside the runs, then again
    later = await asyncio.wait_for(lm.run_controller(prompt, Argmax(3, 4)), TIMEOUT)
    assert later == await drive(lm, prompt, Argmax(3, 4))
    s = lm.stats
    assert s["bursts"]["running"] == 0 and s["sessions"]["live"] == 0
    return out


def _faults(lm) -> dict:
    return lm.stats["faults"]


async def _same_from_drive(lm, controller, match, start=None):
    """The per-token reference raises the same message for the same mistake."""
    with pytest.raises(ControllerError, match=match):
        await drive(lm, _prompt(lm), controller, start=start)


class _NoCount(Controller):
    def step(self, rows, particles):
        return Decision([0] * len(particles), stop=True)

    def result(self, generated):
        return generated


# ------------------------------------------------------------------------------ case 1
async def test_case1_a_bad_setup_fails_its_run_and_the_engine_lives(llama_lm):
    """Before: Burst.__init__ raised inside admission; the loop died (EngineDiedError for
    everyone after) and the caller's future never resolved."""
    lm = llama_lm
    prompt = _prompt(lm)
    bad = [
        (Argmax(2, 3), [[5]], "start has 1 particles; the controller has 2"),
        (Argmax(2, 3), [["a"], ["b"]], r"start\[0\]\[0\] must be an int token id, got str"),
        (_NoCount(), None, "has no n_particles"),
        (Argmax("2", 3), None, "n_particles must be an int >= 1, got '2'"),
        (Argmax(True, 3), None, "n_particles must be an int >= 1, got True"),
        (Argmax(0, 3), None, "n_particles must be an int >= 1, got 0"),
        (Argmax(2, 3), "ab", "start must be a list of 2 token-id lists"),
    ]
    before = _faults(lm)["controller_errors"]
    out = await _beside(lm, *(lm.run_controller(prompt, c, start=s) for c, s, _ in bad))
    for (c, s, match), got in zip(bad, out, strict=True):
        assert isinstance(got, ControllerError) and isinstance(got, ValueError), got
        assert got.args and re.search(match, str(got)), (match, got)
        await _same_from_drive(lm, c, match, start=s)
    assert _faults(lm)["controller_errors"] == before + len(bad)


# ------------------------------------------------------------------------------ case 2
async def test_case2_bad_tokens_and_starts_fail_their_run_only(llama_lm):
    """Before: a token == V or -1 failed the engine step (IndexError for every caller in it); a
    token 2**40 broke the engine for good (OverflowError, then 'Cannot register new removed
    request'); out-of-vocabulary or too long starts did the same."""
    lm = llama_lm
    prompt = _prompt(lm)
    v = lm.vocab_size

    def token(t):
        return lambda toks: Decision([toks[0], t])

    bad = [
        (Argmax(2, 4, 2, token(v)), None, rf"Decision.tokens\[1\] is {v}, outside the vocabulary \[0, {v}\)"),
        (Argmax(2, 4, 2, token(-1)), None, r"Decision.tokens\[1\] is -1, outside the vocabulary"),
        (Argmax(2, 4, 2, token(2**40)), None, rf"Decision.tokens\[1\] is {2**40}, outside the vocabulary"),
        (Argmax(2, 4, 2, token(1.5)), None, r"Decision.tokens\[1\] is 1.5 \(float\)"),
        (Argmax(2, 4, 2, token(True)), None, r"Decision.tokens\[1\] is True \(bool\)"),
        (Argmax(2, 4, 2, lambda toks: Decision(toks[:1])), None, "returned 1 tokens for 2 particles"),
        (Argmax(2, 4, 2, lambda toks: Decision(toks, parents=[0, 2])), None, r"parents must be 2 indices in \[0, 2\)"),
        (Argmax(2, 4, 2, lambda toks: Decision(toks, parents=[0.0, 1])), None, "parents must be 2 indices"),
        (Argmax(2, 4), [[v], [1]], rf"start\[0\] holds token id {v} at index 0, outside the vocabulary"),
        (Argmax(2, 4), [[3], [2**40]], rf"start\[1\] holds token id {2**40}"),
        (Argmax(2, 4), [[1] * 600, []], rf"start\[0\] makes particle 0's context {len(prompt) + 600} tokens"),
    ]
    before = _faults(lm)["controller_errors"]
    out = await _beside(lm, *(lm.run_controller(prompt, c, start=s) for c, s, _ in bad))
    for (_, _, match), got in zip(bad, out, strict=True):
        assert isinstance(got, ControllerError), got
        assert re.search(match, str(got)), (match, got)
    assert _faults(lm)["controller_errors"] == before + len(bad)
    await _same_from_drive(lm, Argmax(2, 4, 2, token(2**40)), "outside the vocabulary")
    # numpy and torch integers are tokens; the failed run's sessions were released
    ok = await lm.run_controller(prompt, Argmax(2, 3, 2, lambda toks: Decision(np.array(toks), parents=torch.tensor([1, 0]))))
    assert ok == await drive(lm, prompt, Argmax(2, 3, 2, lambda toks: Decision(np.array(toks), parents=torch.tensor([1, 0]))))
    lm.release_sessions()
    with pytest.raises(ControllerError, match="outside the vocabulary"):
        await asyncio.wait_for(lm.run_controller(prompt, Argmax(2, 5, 3, token(v))), TIMEOUT)
    s = lm.stats
    assert s["sessions"]["idle"] == 0 and s["sessions"]["live"] == 0


# ------------------------------------------------------------------------------ case 3
@pytest.fixture(scope="module")
def short_lm(model_paths):
    from conftest import ENGINE_OPTS, _engine

    return _engine(model_paths["llama"], {**ENGINE_OPTS, "max_model_len": 64})


async def test_case3_a_run_into_max_model_len_fails_that_run(short_lm):
    """Before: vLLM asserted ('Sampled token IDs exceed the max model length') inside the step
    and every caller in it failed."""
    lm = short_lm
    prompt = _prompt(lm)
    room = 64 - len(prompt)  # steps until a particle's context is 64 tokens
    before = _faults(lm)["controller_errors"]
    [got] = await _beside(lm, lm.run_controller(prompt, Argmax(2, 10**6)))
    assert isinstance(got, ControllerError), got
    assert "the controller ran particle 0 to 64 tokens (max_model_len=64): stop it earlier" in str(got)
    assert _faults(lm)["controller_errors"] == before + 1
    await _same_from_drive(lm, Argmax(2, 10**6), r"ran particle 0 to 64 tokens \(max_model_len=64\)")
    # stopping in the step that reaches it is fine: no row is needed after that
    full = await asyncio.wait_for(lm.run_controller(prompt, Argmax(2, room)), TIMEOUT)
    assert [len(g) for g in full] == [room, room]
    assert full == await drive(lm, prompt, Argmax(2, room))


# ------------------------------------------------------------------------------ case 4
async def test_case4_bad_decisions_and_blocking_calls_raise_instead_of_hanging(llama_lm):
    """Before: a decision without ``stop`` was read outside the burst's guard (the outbox logged
    'a result listener failed' and the caller hung); a mask or controller calling the model's
    sync API on the engine thread deadlocked that run and every other sync caller."""
    lm = llama_lm
    prompt = _prompt(lm)
    shapes = [
        (lambda toks: types.SimpleNamespace(tokens=toks, parents=None), "without 'stop'"),
        (lambda toks: list(toks), "returned a list without 'tokens'"),
        (lambda toks: Decision(toks, stop=np.array([True, False])), r"Decision.stop must be a bool"),
        (lambda toks: Decision(toks, stop="yes"), r"Decision.stop must be a bool, got 'yes'"),
        (lambda toks: Decision(5), "Decision.tokens must be a sequence"),
    ]

    def calls_model(call):
        return lambda toks: (call(), Decision(toks))[1]

    other = [*prompt[:-1], 7]
    blocking = [
        calls_model(lambda: lm.next_token_logprobs_sync(prompt)),
        calls_model(lambda: lm.batch_next_token_logprobs_sync([prompt, other])),
        calls_model(lambda: lm.score_sync(prompt, [5, 6])),
        calls_model(lambda: lm.smc_sync(prompt, Regex("[a-z]+"), 2, 3)),
    ]
    allow = np.ones(lm.vocab_size, dtype=bool)

    def mask(generated):
        lm.next_token_logprobs_sync(prompt)  # a blocking call from the engine thread
        return np.repeat(allow[None, :], len(generated), axis=0)

    before = dict(_faults(lm))
    loop = asyncio.get_running_loop()
    sync_other = loop.run_in_executor(None, lm.next_token_logprobs_sync, other)  # another thread's sync call
    out = await _beside(
        lm,
        *(lm.run_controller(prompt, Argmax(2, 4, 2, d)) for d, _ in shapes),
        *(lm.run_controller(prompt, Argmax(2, 4, 2, d)) for d in blocking),
        lm.smc(prompt, TokenMask(mask, "calls the model"), 3, 4, seed=0),
        sync_other,
    )
    *out, other_row = out
    for (_, match), got in zip(shapes, out, strict=False):
        assert isinstance(got, ControllerError), got
        assert re.search(match, str(got)), (match, got)
    for got in out[len(shapes):]:
        assert isinstance(got, RuntimeError) and "Do not block inside a controller or mask" in str(got), got
    assert torch.equal(other_row, lm.next_token_logprobs_sync(other))
    after = _faults(lm)
    assert after["blocking_calls"] == before["blocking_calls"] + len(blocking) + 1
    assert after["controller_errors"] == before["controller_errors"] + len(shapes) + len(blocking) + 1


# ------------------------------------------------------------------------------ case 6
async def test_case6_clear_messages_for_seed_and_eos(llama_lm):
    """Before: seed=-1 raised numpy's 'expected non-negative integer', eos_token_ids=[] said 'a
    prompt needs at least one token'."""
    lm = llama_lm
    prompt = _prompt(lm)
    requests = lm.stats["engine_requests"]
    for in_engine in (True, False):
        with pytest.raises(ValueError, match=r"seed must be None or an int >= 0 for smc .*got -1"):
            await lm.smc(prompt, Regex("[a-z]+"), 2, 3, seed=-1, in_engine=in_engine)
        with pytest.raises(ValueError, match="eos_token_ids is empty: SMC needs at least one id that ends a text"):
            await lm.smc(prompt, Regex("[a-z]+"), 2, 3, eos_token_ids=[], in_engine=in_engine)
    assert lm.stats["engine_requests"] == requests  # refused before any engine work
    out = await _beside(lm, lm.smc(prompt, Regex("[a-z]+"), 2, 3, seed=-1),
                        lm.smc(prompt, Regex("[a-z]+"), 2, 3, eos_token_ids=[]))
    assert all(isinstance(e, ValueError) for e in out), out
    a = await lm.smc(prompt, Regex("[a-z]+"), 3, 4, seed=2**64 - 1)  # the largest seed runs, the same each time
    assert [p.token_ids for p in a.particles] == [p.token_ids for p in (await lm.smc(prompt, Regex("[a-z]+"), 3, 4, seed=2**64 - 1)).particles]


# ------------------------------------------------------------------------------ case 7
async def test_case7_a_finished_run_releases_its_sessions(llama_lm):
    """Before: a finished run left its last round's sessions idle (up to 247 seen) until
    eviction or release_sessions()."""
    lm = llama_lm
    prompt = _prompt(lm)
    lm.release_sessions()
    released = lm.stats["bursts"]["sessions_released"]
    r = await lm.smc(prompt, Regex("[a-z ]+"), 6, 8, seed=3, engine_path="bursts")  # sessions: bursts only
    s = lm.stats
    assert s["sessions"]["idle"] == 0 and s["sessions"]["live"] == 0
    assert r.stats["sessions_released"] >= 1
    assert s["bursts"]["sessions_released"] == released + r.stats["sessions_released"]
    [got] = await _beside(lm, lm.run_controller(prompt, Argmax(3, 4)))
    assert got == await drive(lm, prompt, Argmax(3, 4))


async def test_case7_a_session_another_caller_joined_is_kept(llama_lm):
    """The run's last round computes a prefix another caller asked for at the same time: that
    session is left to the ordinary eviction (the other caller may extend it); the rest go."""
    lm = llama_lm
    prompt = _prompt(lm)
    lm.release_sessions()
    ready, posted = threading.Event(), threading.Event()
    seen: dict = {}

    def before_last_round(toks):  # step 2 of 3: the prefixes of the last round are known now
        seen["prefix"] = (*prompt, *seen["first"], toks[0])
        ready.set()
        posted.wait(TIMEOUT)  # the other caller's query is in the inbox: admitted after the round
        return Decision(toks)

    class Joined(Argmax):
        def step(self, rows, particles):
            decision = super().step(rows, particles)
            if self.seen == 1:
                seen["first"] = (decision.tokens[0],)
            return decision

    ctl = Joined(3, 3, 2, before_last_round)
    run = asyncio.ensure_future(lm.run_controller(prompt, ctl, engine_path="bursts"))  # a burst's sessions
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, ready.wait, TIMEOUT)
    [fut] = lm._driver.submit_logprobs([(seen["prefix"], None)])  # joins the run's request
    posted.set()
    got = await asyncio.wait_for(run, TIMEOUT)
    row = await asyncio.wait_for(asyncio.wrap_future(fut), TIMEOUT)
    assert lm.stats["sessions"]["idle"] == 1  # the joined one; the run's other two were released
    assert got == await drive(lm, prompt, Argmax(3, 3))
    assert torch.equal(row, lm.next_token_logprobs_sync(list(seen["prefix"])))


# ------------------------------------------------------------------------------ the catch-all
POINTS = ["__init__", "start", "_on_rows", "_finish", "_resolve"]


@pytest.mark.parametrize("point", POINTS)
async def test_an_exception_anywhere_in_a_run_fails_that_run_only(llama_lm, monkeypatch, point):
    """An exception raised while a run is set up, started, stepped, finished or resolved (here
    injected) fails that run with an error naming it; the loop, other callers and later calls
    are untouched. Before: the loop died (setup, start) or the caller hung (the rest)."""
    from genlm_vlm.engine.bursts import Burst

    lm = llama_lm
    prompt = _prompt(lm)
    real = getattr(Burst, point)
    calls = {"n": 0}

    def injected(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == (2 if point == "_on_rows" else 1):  # _on_rows: after one step
            raise KeyError(f"injected at {point}")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Burst, point, injected)  # fires once: the later runs in _beside go through
    before = _faults(lm)["burst_errors"]
    [got] = await _beside(lm, lm.run_controller(prompt, Argmax(3, 4), engine_path="bursts"))  # Burst's methods
    later = await asyncio.wait_for(lm.run_controller(prompt, Argmax(3, 4), engine_path="bursts"), TIMEOUT)
    assert later == await drive(lm, prompt, Argmax(3, 4))  # the next burst goes through
    assert calls["n"] > 1
    assert isinstance(got, RuntimeError) and f"injected at {point}" in str(got), got
    assert "genlm_vlm failed on the engine thread while" in str(got)
    assert _faults(lm)["burst_errors"] == before + 1


# ------------------------------------------------------------------------------ devices (issue 42, item 4)
@pytest.fixture(scope="module")
def meta_lm(model_paths):
    """The tiny Llama delivering rows to ``output_device="meta"``: a stand-in, on the CPU, for an
    output device other than the engine's (a burst's rows on meta carry no values and fail)."""
    from conftest import ENGINE_OPTS, _engine

    return _engine(model_paths["llama"], ENGINE_OPTS, output_device="meta")


def _hold(lm):
    """Block the engine thread (between two steps) until the returned gate is set: what is
    submitted meanwhile is admitted together, so identical queries join one job."""
    import concurrent.futures as cf

    from genlm_vlm.engine.jobs import Call

    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(TIMEOUT)

    lm._driver._post(Call(hold, (), {}, cf.Future()))
    assert entered.wait(TIMEOUT)
    return gate


class Devices(Argmax):
    """:class:`Argmax` that records the device of every step's rows."""

    def __init__(self, *args):
        super().__init__(*args)
        self.devices = set()

    def step(self, rows, particles):
        self.devices.add(rows.device.type)
        return super().step(rows, particles)


async def test_joined_bursts_keep_their_rows_on_the_engines_device(meta_lm):
    """Two runs on one prompt join each other's row jobs (every row of the first round, some of
    the later ones): each still gets its rows on the engine's device and equals its solo run.
    Before: the joined rows went to ``output_device`` (here meta) and the step failed (the issue
    saw ``torch.stack`` refuse the mixed devices in 4 of 4 trials)."""
    lm = meta_lm
    prompt = _prompt(lm)
    solo = [await lm.run_controller(prompt, Argmax(n, 4)) for n in (3, 1)]
    gate = _hold(lm)
    ctls = [Devices(3, 4), Devices(1, 4)]  # the second's contexts are among the first's
    futs = [lm._submit_burst(prompt, c, None, None) for c in ctls]
    gate.set()
    got = [await asyncio.wait_for(asyncio.wrap_future(f), TIMEOUT) for f in futs]
    assert got == solo
    assert [c.devices for c in ctls] == [{"cpu"}, {"cpu"}]


async def test_a_seeded_run_beside_a_joined_await_equals_its_solo_run(meta_lm):
    """A seeded ``lm.smc`` run whose first row another caller asks for at the same time (the
    await joins the run's job): the run's result is its solo run's, bit for bit, and the await
    gets its own row on ``output_device``. Before: that row went to meta for both, and the run's
    step ran there (on a GPU: on the CPU, a result that depended on other traffic)."""
    from genlm_vlm.smc import api

    lm = meta_lm
    prompt = _prompt(lm)
    solo = await lm.smc(prompt, Regex("[a-z ]+"), 8, 6, seed=9)
    gate = _hold(lm)
    _, controller = api.prepare(lm, prompt, Regex("[a-z ]+"), 8, 6, seed=9)  # what lm.smc runs
    run = lm._submit_burst(prompt, controller, None, None)
    [row] = lm._driver.submit_logprobs([(tuple(prompt), None)])  # admitted first: the run joins it
    gate.set()
    got = await asyncio.wait_for(asyncio.wrap_future(run), TIMEOUT)
    row = await asyncio.wait_for(asyncio.wrap_future(row), TIMEOUT)
    assert [(p.token_ids, p.log_weight, p.status) for p in got.particles] == \
        [(p.token_ids, p.log_weight, p.status) for p in solo.particles]
    assert got.log_marginal == solo.log_marginal
    assert row.device.type == "meta" and row.shape == (lm.vocab_size,)


# ------------------------------------------------------------------------------ pure parts
def test_a_refused_decision_changes_nothing():
    """ParticleSet checks a whole decision before applying any of it; numpy/torch integers and
    bools are taken where they mean ints and a bool, Python bools are not tokens."""
    from genlm_vlm.smc import ParticleSet

    ps = ParticleSet((1, 2), 3, vocab_size=10, max_len=5)
    assert ps.apply(Decision(np.array([3, 4, 5]), parents=torch.tensor([2, 1, 0]), stop=np.bool_(False)), [0, 1, 2]) is False
    assert ps.generated == [(5,), (4,), (3,)]
    for bad in (Decision([1, 2, 10]), Decision([1, 2, 3], parents=[0, 1, 3]), Decision([1, None, False]),
                Decision([1, 2, 3], stop=2), Decision([1, 2, 3, 4]), Decision([torch.tensor(1.0), 2, 3]),
                Decision(torch.tensor([1.0, 2.0, 3.0])), Decision([np.bool_(True), 2, 3])):
        with pytest.raises(ControllerError):
            ps.apply(bad, [0, 1, 2])
        assert ps.generated == [(5,), (4,), (3,)] and ps.live() == [0, 1, 2]
    ps.apply(Decision([torch.tensor(6), np.int32(7), None], stop=torch.tensor(False)), [0, 1, 2])
    with pytest.raises(ControllerError, match=r"ran particle 1 to 5 tokens \(max_model_len=5\)"):
        ps.apply(Decision([None, 8]), [0, 1])  # particle 1's context would be 5 tokens
    assert ps.apply(Decision([None, 8], stop=True), [0, 1]) is True  # fine when the run stops
    assert ps.generated == [(5, 6), (4, 7, 8), (3,)]
