"""The built-in controller's particle arrays (genlm_vlm.smc.book), against lists kept one particle
at a time: statuses, tokens, weights, and the history numbers that let particles with the same
tokens share one mask."""

from __future__ import annotations

import math

import numpy as np
import pytest

from genlm_vlm.smc.book import CUT, DEAD, FINISHED, LIVE, Book

EOS = 9


def test_take_ends_particles_and_feeds_the_rest() -> None:
    book = Book(5, cap=3, eos=[EOS])
    idx = np.arange(5)
    moved, moves, out = book.take(idx, np.array([4, -1, EOS, 4, 7]), np.array([-1.0, -math.inf, -2.0, -1.0, -0.5]))
    assert moved.tolist() == [0, 3, 4] and moves.tolist() == [4, 4, 7]
    assert out == [4, None, None, 4, 7]
    assert book.status.tolist() == [LIVE, DEAD, FINISHED, LIVE, LIVE]
    assert book.log_w.tolist() == [-1.0, -math.inf, -2.0, -1.0, -0.5]
    assert [book.tokens(i) for i in range(5)] == [[4], [], [], [4], [7]]
    # particles 0 and 3 took the same token from the same start: one history; 4 another
    h = book.history
    assert h[0] == h[3] != h[4] and not book.distinct
    live = np.array([0, 3, 4])
    moved, _, out = book.take(live, np.array([5, 6, 5]), np.zeros(3))
    assert out == [5, 6, 5] and book.distinct  # 0 and 3 parted
    moved, _, out = book.take(live, np.array([1, 2, EOS]), np.zeros(3))
    assert out == [None, None, None]  # 0 and 3 reached cap = 3 tokens: cut; 4 finished
    assert book.status[[0, 3, 4]].tolist() == [CUT, CUT, FINISHED]
    assert book.tokens(0) == [4, 5, 1] and book.tokens(3) == [4, 6, 2] and book.tokens(4) == [7, 5]
    assert not book.any_live() and book.status_of(1) == "dead"


def test_tokens_grow_past_the_first_columns() -> None:
    book = Book(2, cap=200, eos=[EOS])
    idx = np.arange(2)
    for t in range(150):
        book.take(idx, np.array([t % 7, (t + 1) % 7]), np.zeros(2))
    assert book.tokens(0) == [t % 7 for t in range(150)]
    assert book.tokens(1) == [(t + 1) % 7 for t in range(150)]
    assert book.seq.shape[1] >= 150


def test_histories_match_token_sequences() -> None:
    """Random steps and resamplings: two live particles share a history number exactly when they
    took the same tokens, ``distinct`` says whether any two share one, ``first_of_each`` groups
    them, and the weights are the sums a list of floats gives."""
    rng = np.random.default_rng(0)
    n, cap = 12, 40
    book = Book(n, cap, eos=[EOS, 8])
    seqs: list[list[int]] = [[] for _ in range(n)]
    status = [LIVE] * n
    log_w = [0.0] * n
    resamples = 0
    for _ in range(cap):
        live = [i for i in range(n) if status[i] == LIVE]
        if not live:
            break
        tok = rng.choice([-1, 1, 2, 8, EOS], size=len(live), p=[0.01, 0.47, 0.48, 0.02, 0.02]).astype(np.int64)
        incr = np.where(tok < 0, -math.inf, rng.normal(size=len(live)))
        moved, moves, out = book.take(np.array(live), tok, incr)
        expect_out, expect_moved = [], []
        for i, t, w in zip(live, tok.tolist(), incr.tolist(), strict=True):
            log_w[i] += w
            if t < 0:
                status[i] = DEAD
            elif t in (EOS, 8):
                status[i] = FINISHED
            else:
                seqs[i].append(t)
                expect_moved.append(i)
                status[i] = CUT if len(seqs[i]) >= cap else LIVE
            expect_out.append(t if status[i] == LIVE else None)
        assert out == expect_out and moved.tolist() == expect_moved
        assert book.log_w.tolist() == log_w
        if rng.random() < 0.4:  # resample: copies share their parent's history
            parents = rng.integers(0, n, size=n).tolist()
            book.resample(parents)
            seqs = [list(seqs[p]) for p in parents]
            status = [status[p] for p in parents]
            log_w = [0.0] * n
            resamples += 1
        assert book.status.tolist() == status
        assert [book.tokens(i) for i in range(n)] == seqs
        live = [i for i in range(n) if status[i] == LIVE]
        for a in live:
            for b in live:
                assert (book.history[a] == book.history[b]) == (seqs[a] == seqs[b])
        distinct = len({tuple(seqs[i]) for i in live}) == len(live)
        if book.distinct:
            assert distinct  # the flag may only say "distinct" when it is so
        shared = book.first_of_each(np.array(live, dtype=np.int64))
        if distinct:
            assert shared is None
        else:
            reps, index = shared
            firsts: dict[tuple[int, ...], int] = {}
            for i in live:
                firsts.setdefault(tuple(seqs[i]), i)
            assert reps.tolist() == list(firsts.values())
            assert [seqs[reps[k]] for k in index.tolist()] == [seqs[i] for i in live]
    assert resamples > 2


@pytest.mark.parametrize("n", [1, 3])
def test_a_fresh_book_shares_the_empty_history(n: int) -> None:
    book = Book(n, cap=4, eos=[EOS])
    assert book.any_live() and book.distinct == (n == 1)
    shared = book.first_of_each(np.arange(n))
    if n == 1:
        assert shared is None
    else:
        assert shared[0].tolist() == [0] and shared[1].tolist() == [0] * n
