"""The requests path writes a flat step's rows into one buffer it reuses from step to step, but
only for a controller that says its step keeps no reference to them (``borrows_rows``, the
built-in SMC controller's): a controller of one's own that keeps its rows still finds them as
they were."""

from __future__ import annotations

import asyncio

from test_controller_seam import TIMEOUT
from test_smc_requests_stress import _idle, _prompt

from genlm_vlm.smc import Controller, Decision, drive
from genlm_vlm.smc.algorithm import SMCController


class Keeper(Controller):
    """Particle ``i`` takes its row's ``(i+1)``-th likeliest token (so after the first step every
    particle is a group of its own: flat steps); keeps every step's rows and a copy of them."""

    def __init__(self, n: int, steps: int) -> None:
        self.n_particles, self.steps = n, steps
        self.kept: list = []
        self.copies: list = []

    def step(self, rows, particles):
        self.kept.append(rows)
        self.copies.append(rows.clone())
        tokens = [int(rows[k].argsort(descending=True)[k]) for k in range(len(particles))]
        return Decision(tokens, stop=len(self.kept) >= self.steps)

    def result(self, generated):
        return [list(g) for g in generated]


class Borrower(Keeper):
    borrows_rows = True  # a lie, to see the buffer: its kept rows are overwritten


def test_the_builtin_controller_borrows_its_rows():
    assert SMCController.borrows_rows is True
    assert getattr(Keeper(1, 1), "borrows_rows", False) is False


async def test_a_controller_that_keeps_its_rows_gets_rows_of_its_own(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm, 9)
    keeper = Keeper(4, 6)
    got = await asyncio.wait_for(lm.run_controller(prompt, keeper, engine_path="requests"), TIMEOUT)
    assert got == await drive(lm, prompt, Keeper(4, 6))
    assert len(keeper.kept) == 6
    for rows, copy in zip(keeper.kept, keeper.copies, strict=True):
        assert rows.data_ptr() != 0 and rows.equal(copy)  # nothing wrote over a step's rows
    assert len({rows.data_ptr() for rows in keeper.kept}) == 6
    _idle(lm)


async def test_a_borrowing_controllers_flat_steps_share_one_buffer(llama_lm):
    lm = llama_lm
    prompt = _prompt(lm, 9)
    borrower = Borrower(4, 6)
    got = await asyncio.wait_for(lm.run_controller(prompt, borrower, engine_path="requests"), TIMEOUT)
    assert got == await drive(lm, prompt, Keeper(4, 6))  # the same run: each step read its rows in time
    flat = {rows.data_ptr() for rows in borrower.kept[1:]}  # the first step's rows: one group, not flat
    assert len(flat) == 1  # one buffer for every flat step ...
    assert not borrower.kept[1].equal(borrower.copies[1])  # ... written over by the next step
    _idle(lm)
