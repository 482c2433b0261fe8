"""``as_token_ids`` with the memo of prompts found valid (:class:`genlm_vlm.checks.KnownIds`): a
prompt that extends a known one by an id skips the range check, and nothing invalid gets in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genlm_vlm.checks import KnownIds, as_token_ids
from genlm_vlm.mock import MockAsyncLM

V = 100


def test_a_continuing_prompt_is_covered_by_its_known_prefix():
    known = KnownIds(V)
    base = [5] * 40
    assert as_token_ids(base, "ids", V, known) == tuple(base)
    assert not known.covers((6,) * 41)
    assert known.covers(tuple(base + [7]))  # known prefix, last id in range: remembered too
    assert known.covers(tuple(base + [7, 8]))
    assert known.covers(tuple(base))  # a repeat
    assert not known.covers(tuple(base + [V]))  # known prefix, last id outside the vocabulary


@pytest.mark.parametrize(
    ("tail", "error", "match"),
    [
        ([V], ValueError, r"token id 100 at index 40, outside the vocabulary"),
        ([-1], ValueError, r"token id -1 at index 40"),
        ([True], TypeError, r"ids\[40\] must be an int"),
        ([2.0], TypeError, r"ids\[40\] must be an int"),
    ],
)
def test_extending_a_known_prompt_with_a_bad_id_still_fails(tail, error, match):
    known = KnownIds(V)
    base = list(range(40))
    as_token_ids(base, "ids", V, known)
    with pytest.raises(error, match=match):
        as_token_ids(base + tail, "ids", V, known)


def test_values_equal_to_a_known_prompt_but_not_ints_are_still_refused_or_converted():
    known = KnownIds(V)
    as_token_ids([1, 2, 3], "ids", V, known)
    with pytest.raises(TypeError, match=r"ids\[0\] must be an int"):
        as_token_ids([True, 2, 3], "ids", V, known)  # True == 1, but not a token id
    with pytest.raises(TypeError, match=r"ids\[2\] must be an int"):
        as_token_ids([1, 2, 3.0], "ids", V, known)
    got = as_token_ids([np.int64(1), 2, 3, 4], "ids", V, known)
    assert got == (1, 2, 3, 4) and all(type(t) is int for t in got)
    got = as_token_ids(torch.tensor([1, 2, 3, 4, 5]), "ids", V, known)
    assert got == (1, 2, 3, 4, 5) and all(type(t) is int for t in got)


def test_the_memo_is_bounded_by_the_ids_it_holds():
    known = KnownIds(V, budget=100)
    for i in range(50):
        as_token_ids([i % V] * 30, "ids", V, known)
    assert known._held <= 100 and len(known._tuples) <= 3
    assert known.covers((49,) * 30) and not known.covers((0,) * 30)


def test_a_model_checks_each_prompt_with_its_memo():
    lm = MockAsyncLM(max_model_len=64)
    prompt = [3] * 20
    lm.next_token_logprobs_sync(prompt)
    lm.next_token_logprobs_sync(prompt + [4])
    known = lm._known_ids
    assert known.vocab_size == lm.vocab_size and known.covers(tuple(prompt + [4]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.next_token_logprobs_sync(prompt + [4, lm.vocab_size])
