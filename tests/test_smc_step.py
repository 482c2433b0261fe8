"""The SMC proposal step (genlm_vlm.smc.step) against a float64 numpy reference, its two paths,
thread-count independence, padding columns, and the GPU check script run on the CPU.

Pure logic on random rows and masks: no engine (the engine runs it in tests/test_smc.py)."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from genlm_vlm.smc import step as S
from genlm_vlm.smc import step_cpu as C

ROOT = pathlib.Path(__file__).resolve().parent.parent


def reference(rows: np.ndarray, mask: np.ndarray, u: np.ndarray, t: float) -> list[tuple[int, float, float]]:
    """Per row: (token, increment, the distance of the inverse-CDF target from the nearest mass
    boundary, relative to the total: small means a float tie). float64 numpy throughout."""
    out = []
    for k in range(rows.shape[0]):
        allowed = np.flatnonzero(mask[k])
        vals = rows[k, allowed].astype(np.float64)
        top = vals.max() if vals.size else -math.inf
        if not math.isfinite(top):
            out.append((-1, -math.inf, math.inf))
            continue
        if t == 0.0:
            j = int(np.argmax(vals))
            out.append((int(allowed[j]), float(vals[j]), math.inf))
            continue
        z = (vals - top) / t  # the shift first: exact for float32 values, no cancellation, no inf - inf
        cdf = np.cumsum(np.exp(z))
        tot = float(cdf[-1])
        target = u[k] * tot
        j = min(int(np.searchsorted(cdf, target, side="right")), len(cdf) - 1)
        inc = float(vals[j]) - (float(z[j]) - math.log(tot))
        out.append((int(allowed[j]), inc, float(np.min(np.abs(cdf - target))) / tot))
    return out


def random_case(rng: np.random.Generator, m: int, v: int, width: int, density: float, scale: float = 3.0):
    rows = torch.log_softmax(torch.from_numpy(rng.standard_normal((m, v)) * scale).float(), dim=1)
    mask = rng.random((m, v)) < density
    mask[:, width:] = False
    mask[0] = False  # dies: nothing allowed
    mask[1, :] = False
    mask[1, rng.integers(width)] = True  # one token only
    return rows, mask, rng.random(m)


#: The CPU's dense path exponentiates float32 differences (docs: within about one unit in the last
#: place of the float32 rows); the gather path and the GPU's dense path work in float64.
F32_REL = 1e-6
#: The fused path's exponential (a table and a polynomial) is within two ulps of the exact value:
#: increments agree with the gather path's float64 arithmetic to round-off.
FUSED_REL = 1e-13


def check_against_reference(tok, inc, ref, *, rel=1e-9, tie=1e-9, abs_=1e-12) -> int:
    """Tokens equal away from ties (a target within ``tie`` of a boundary, relative to the
    total), increments close; returns the number of ties skipped."""
    ties = 0
    for k, (rt, ri, gap) in enumerate(ref):
        if tok[k] != rt:
            assert gap < tie, f"row {k}: token {tok[k]} != {rt} and the target is {gap} from a boundary"
            ties += 1
            continue
        if rt == -1:
            assert inc[k] == -math.inf
        else:
            assert inc[k] == pytest.approx(ri, rel=rel, abs=abs_), f"row {k}"
    return ties


def chosen_path(path: str, mask: np.ndarray, width: int, t: float) -> str:
    """The path ``propose(path=path)`` takes on the CPU."""
    return path if path != "auto" else S.choose_path(S.popcounts(S.pack(mask)), width, "cpu", t)


@pytest.mark.parametrize("density", [0.9, 0.1, 0.004])
@pytest.mark.parametrize("t", [1.0, 0.6, 1.7, 0.0])
@pytest.mark.parametrize("path", ["dense", "gather", "fused", "auto"])
def test_step_matches_float64_reference(density, t, path):
    rng = np.random.default_rng(int(density * 1000) + int(t * 10))
    m, v, width = 12, 3000, 2950
    rows, mask, u = random_case(rng, m, v, width, density)
    ref = reference(rows.numpy(), mask, u, t)
    if path == "fused" and t == 0.0:  # greedy is the torch paths' (an argmax)
        with pytest.raises(ValueError, match="path='fused' runs on float32 CPU rows at temperatures"):
            S.propose(rows.clone(), S.pack(torch.from_numpy(mask)), u, t, width=width, path=path)
        return
    tok, inc = S.to_host(*S.propose(rows.clone(), S.pack(torch.from_numpy(mask)), u, t, width=width, path=path))
    assert tok[0] == -1 and tok[1] == int(np.flatnonzero(mask[1])[0])
    chosen = chosen_path(path, mask, width, t)
    tol = 1e-9 if chosen in ("gather", "fused") or t == 0.0 else F32_REL
    assert check_against_reference(tok, inc, ref, rel=tol, tie=tol, abs_=tol) <= 1


#: Temperatures far from 1 (issue 42, item 5): small (1e-5 was greedy's threshold; below it a
#: temperature is no longer greedy), large, past float32's range (3.4e38), and float64's largest.
EXTREME_T = [1e-300, 1e-7, 1e-5, 1e-3, 1e3, 1e39, 1e300, sys.float_info.max]


@pytest.mark.parametrize("t", EXTREME_T)
@pytest.mark.parametrize("path", ["dense", "gather", "fused", "auto"])
def test_any_temperature_gives_the_float64_references_draws_and_weights(t, path):
    """Every finite ``t > 0`` is a tempered proposal on every path: tokens equal away from ties,
    increments within float32 ``exp``'s round-off (the CPU's dense path) or float64's (the others)
    of the float64 reference. Rows with close entries (a spread of 1e-4 nats among the best) so
    that small temperatures still split the mass, and rows with ``-inf`` entries. Before: the
    dense path computed ``x / t`` in float32, off by up to 0.06 nats at ``t = 1e-5`` and
    ``IndexError`` at ``1e39`` (``-inf / inf`` is NaN); every path computed ``x / t - top / t``,
    NaN once ``x / t`` overflows (``t = 1e-300``); below 1e-5 the step was greedy."""
    if path == "fused" and not C.fused_available():
        pytest.skip(C.fused_error() or "no numba")
    rng = np.random.default_rng(17)
    for m, v, density in ((12, 3000, 0.5), (10, 9000, 0.05)):
        rows, mask, u = random_case(rng, m, v, v, density)
        rows[2:6, :] = torch.from_numpy(-5.0 - 1e-4 * rng.random((4, v))).float()  # near-ties at every t
        rows[6, ::3] = -math.inf  # some entries of no probability, allowed or not
        bits = S.pack(torch.from_numpy(mask))
        tok, inc = S.to_host(*S.propose(rows.clone(), bits, u, t, width=v, path=path))
        chosen = chosen_path(path, mask, v, t)
        tol = F32_REL if chosen == "dense" else 1e-9
        ref = reference(rows.numpy(), mask, u, t)
        assert check_against_reference(tok, inc, ref, rel=tol, tie=tol, abs_=tol) <= 1
        assert tok[0] == -1 and np.isfinite(inc[1:]).all()


@pytest.mark.parametrize("tau", [1e-45, 1e-5, 1e3, 1e39, sys.float_info.max])
def test_a_target_temperature_tempers_the_rows_exactly_at_any_tau(tau):
    """``target_temperature`` rows (``log_softmax(rows / tau)``) equal a float64 numpy reference
    to float32 round-off at any finite ``tau > 0``, ``-inf`` entries kept. Before: float32
    ``rows / tau`` (NaN rows at 1e-45 and past 3.4e38, entries off by up to 0.06 nats at 1e-5)."""
    import types

    from genlm_vlm.smc.algorithm import SMCController

    rng = np.random.default_rng(4)
    rows = torch.log_softmax(torch.from_numpy(rng.standard_normal((5, 300)) * 3).float(), dim=1)
    rows[1, ::4] = -math.inf
    rows[2, :] = torch.from_numpy(-5.0 - 1e-4 * rng.random(300)).float()
    got = SMCController._target_rows(types.SimpleNamespace(target_temperature=tau), rows).numpy()
    x = rows.double().numpy()
    z = (x - x.max(axis=1, keepdims=True)) / tau
    ref = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    with np.errstate(over="ignore"):  # entries past float32's range are -inf there
        ref32 = ref.astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(np.isneginf(got), np.isneginf(ref32))
    finite = np.isfinite(ref32)
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-6, atol=1e-6)


def test_temperature_zero_is_greedy_and_a_negative_or_infinite_one_is_refused():
    rows, mask, u = random_case(np.random.default_rng(3), 4, 100, 100, 0.5)
    bits = S.pack(torch.from_numpy(mask))
    tok, inc = S.to_host(*S.propose(rows.clone(), bits, u, 0.0))
    assert tok[2:] == [int(np.flatnonzero(mask[k])[np.argmax(rows[k].numpy()[mask[k]])]) for k in (2, 3)]
    for bad in (-1e-9, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            S.propose(rows.clone(), bits, u, bad)


@pytest.mark.parametrize("fused", [True, False])
def test_the_paths_agree_and_auto_chooses_by_density(fused, monkeypatch):
    """Every path draws the same tokens; the fused one's increments are the gather path's to
    float64 round-off (the same arithmetic but for the exponential's polynomial). ``auto``: fused on narrow rows and on wide rows with
    sparse masks; without numba (simulated), dense or gather by density."""
    if not fused:
        monkeypatch.setattr(C._FUSED, "kernel", None)
        monkeypatch.setattr(C._FUSED, "failed", ["the fused CPU step is off: ModuleNotFoundError('numba')"])
    rng = np.random.default_rng(5)
    m = 40
    cases = ((4096, 0.8, "fused" if fused else "dense"), (4096, 0.002, "fused" if fused else "gather"),
             (20000, 0.8, "dense"), (20000, 0.2, "fused" if fused else "dense"))
    for v, density, expect in cases:
        rows, mask, u = random_case(rng, m, v, v, density)
        bits = S.pack(torch.from_numpy(mask))
        paths = ("dense", "gather", "auto") + (("fused",) if fused else ())
        got = {p: S.to_host(*S.propose(rows.clone(), bits, u, 1.0, path=p)) for p in paths}
        assert got["dense"][0] == got["gather"][0]
        np.testing.assert_allclose(got["dense"][1], got["gather"][1], rtol=F32_REL, atol=F32_REL)
        if fused:  # the same float64 arithmetic but for the exponential (within two ulps of the exact value)
            assert got["fused"][0] == got["gather"][0]
            np.testing.assert_allclose(got["fused"][1], got["gather"][1], rtol=FUSED_REL, atol=FUSED_REL)
        assert chosen_path("auto", mask, v, 1.0) == expect
        assert got["auto"][0] == got[expect][0]
        assert got["auto"][1].tobytes() == got[expect][1].tobytes()
    if not fused:
        with pytest.raises(ValueError, match="numba"):
            S.propose(rows.clone(), bits, u, 1.0, path="fused")


@pytest.mark.parametrize("path", ["dense", "gather", "fused"])
def test_thread_count_does_not_change_a_bit(path, monkeypatch):
    """On the CPU the step is a function of its inputs: 1 thread and 2 threads give the same
    bytes (rows wide enough that torch splits elementwise work and reductions across threads)."""
    rng = np.random.default_rng(11)
    m, v = 24, 70000
    rows, mask, u = random_case(rng, m, v, v - 100, 0.6 if path == "dense" else 0.02)
    bits = S.pack(torch.from_numpy(mask))
    monkeypatch.setattr(S, "CPU_STEP_THREADS", None)  # the kernels run with the thread count set here
    before = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2):
            S.set_threads(n)  # torch.set_num_threads is a no-op once a vLLM CPU engine was built
            assert torch.get_num_threads() == n
            for t in (1.0, 0.8):
                tok, inc = S.to_host(*S.propose(rows.clone(), bits, u, t, width=v - 100, path=path))
                out[n, t] = (tok, inc.tobytes())
    finally:
        S.set_threads(before)
    for t in (1.0, 0.8):
        assert out[1, t] == out[2, t]


@pytest.mark.parametrize("path", ["dense", "gather", "fused", "auto"])
def test_padding_columns_are_never_drawn_nor_written(path):
    """Columns at or past width hold huge values and their bits are set: never drawn, never read
    into the mass, never written."""
    rng = np.random.default_rng(3)
    m, v, width = 10, 1000, 900
    rows, mask, u = random_case(rng, m, v, width, 0.02)
    rows[:, width:] = 50.0
    mask[2:, width:] = True  # a constraint that (wrongly) allows padding: the step ignores it
    work = rows.clone()
    tok, inc = S.to_host(*S.propose(work, S.pack(torch.from_numpy(mask)), u, 1.0, width=width, path=path))
    assert all(t < width for t in tok)
    assert torch.equal(work[:, width:], rows[:, width:])
    trimmed = mask.copy()
    trimmed[:, width:] = False
    check_against_reference(tok, inc, reference(rows.numpy(), trimmed, u, 1.0), rel=F32_REL, tie=F32_REL,
                            abs_=F32_REL)
    # greedy too: the padding's +50 would win any argmax that read it
    if path == "fused":
        return  # greedy: not the fused path's
    g, _ = S.to_host(*S.propose(rows.clone(), S.pack(torch.from_numpy(mask)), u, 0.0, width=width, path=path))
    assert all(t < width for t in g) and g[0] == -1


def test_minus_inf_rows_die_and_edge_uniforms_stay_in_the_mask():
    rows = torch.full((3, 64), -math.inf)
    rows[1, 5] = 0.0
    rows[2, 7] = -1.0
    rows[2, 9] = -2.0
    mask = np.zeros((3, 64), dtype=bool)
    mask[0, :10] = True  # allowed, but all -inf: no probability
    mask[1, 5] = True
    mask[2, [7, 9, 30]] = True  # 30 is -inf: never drawn, even at u -> 1
    u = np.array([0.5, 0.999999999999, np.nextafter(1.0, 0.0)])
    for path in ("dense", "gather", "fused"):
        tok, inc = S.to_host(*S.propose(rows.clone(), S.pack(torch.from_numpy(mask)), u, 1.0, path=path))
        assert tok == [-1, 5, 9]
        assert inc[0] == -math.inf and inc[1] == 0.0
        assert inc[2] == pytest.approx(math.log(math.exp(-1) + math.exp(-2)), rel=1e-12 if path != "dense" else F32_REL)


def test_pack_unpack_roundtrip_and_bad_input():
    rng = np.random.default_rng(0)
    mask = rng.random((5, 77)) < 0.5
    bits = S.pack(mask)
    assert bits.dtype == torch.int32 and bits.shape == (5, 3)
    assert torch.equal(bits, S.pack(torch.from_numpy(mask)))  # numpy's packing == the torch op's
    assert np.array_equal(S.unpack(bits, 77).numpy(), mask)
    assert list(S.popcounts(bits)) == list(mask.sum(1))
    rows = torch.zeros(5, 77)
    with pytest.raises(ValueError, match="bits must be int32"):
        S.propose(rows, bits.long(), np.zeros(5))
    with pytest.raises(ValueError, match="uniforms must hold 5"):
        S.propose(rows, bits, np.zeros(4))
    with pytest.raises(ValueError, match=r"uniforms must be numbers in \[0, 1\)"):
        S.propose(rows, bits, np.array([0.1, 0.2, -0.1, 0.3, 0.4]))
    with pytest.raises(ValueError, match=r"uniforms must be numbers in \[0, 1\)"):
        S.propose(rows, bits, np.array([0.1, 0.2, np.nan, 0.3, 1.0]))
    with pytest.raises(ValueError, match="width"):
        S.propose(rows, bits, np.zeros(5), width=78)
    with pytest.raises(ValueError, match="temperature"):
        S.propose(rows, bits, np.zeros(5), -1.0)


def test_the_torch_mask_kernel_equals_xgrammars():
    rng = np.random.default_rng(1)
    rows = torch.randn(6, 300)
    bits = S.pack(rng.random((6, 300)) < 0.3)
    a, b = rows.clone(), rows.clone()
    used = S.apply_bitmask(a, bits[:, : S.words(290)].contiguous(), 290)
    assert S.apply_bitmask(b, bits[:, : S.words(290)].contiguous(), 290, kernel="torch") == "torch"
    assert used in ("xgrammar", "torch")
    assert torch.equal(a, b) and torch.equal(a[:, 290:], rows[:, 290:])
    # float64 rows (xgrammar's kernels take 16/32-bit floats): the torch op, and xgrammar stays in use
    d = rows.double()
    assert S.apply_bitmask(d, bits[:, : S.words(290)].contiguous(), 290) == "torch"
    assert torch.equal(d, a.double())
    if used == "xgrammar":
        assert S.mask_kernel_error("cpu") is None and S.mask_kernel("cpu") == "xgrammar"


def test_importing_the_step_imports_neither_vllm_nor_transformers():
    code = ("import sys; import genlm_vlm.smc.step; "
            "print(sorted(m for m in ('vllm', 'transformers', 'xgrammar') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_gpu_controller_check_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu/controller_check.py at a tiny width on the CPU: every cell ok, the JSON
    written with the fields the GPU run reports. Run as on the GPU host, where numba is not
    installed: the fused CPU step off, so the cells take the torch paths the GPU runs (and
    report them: the path is ``choose_path``'s, the one ``propose`` takes)."""
    args = ["controller_check.py", "--device", "cpu", "--out", str(tmp_path), "--width", "2048", "--ms", "3", "8",
            "--reps", "2", "--warmup", "1", "--host-reps", "1"]
    code = ("import runpy, sys; from genlm_vlm.smc import step_cpu; "
            "step_cpu._FUSED.failed.append('off: the GPU host has no numba'); "
            f"sys.argv = {args!r}; runpy.run_path('benchmarks/gpu/controller_check.py', run_name='__main__')")
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((tmp_path / "controller_check.json").read_text())
    assert res["ok"] and len(res["cells"]) == 6
    for cell in res["cells"]:
        for key in ("step_ms", "bytes_to_device", "bytes_to_host", "mask_kernel", "path", "token_mismatch",
                    "max_rel_err", "host_path_ms", "repeat_identical"):
            assert key in cell, key
        assert cell["dead_row_died"] and cell["padding_never_drawn"] and cell["bytes_to_host"] == 16 * cell["m"]
    assert {c["path"] for c in res["cells"]} == {"dense", "gather"}


def test_gpu_controller_check_loads_the_step_where_the_package_does_not_import():
    """On the GPU host the package may not import (no vLLM, no transformers): the check loads
    smc/step.py from its file, with step_cpu.py beside it (step.py imports it relatively)."""
    code = ("import runpy, sys; sys.modules['genlm_vlm'] = None; sys.argv = ['controller_check.py']; "
            "mod = runpy.run_path('benchmarks/gpu/controller_check.py', run_name='check'); "
            "step, how = mod['load_step'](); import numpy as np, torch; "
            "tok, inc = step.to_host(*step.propose(torch.zeros(2, 40), step.pack(np.eye(2, 40, dtype=bool)), "
            "np.zeros(2), path='dense')); print(how.split(' ')[0].endswith('step.py'), tok)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True [0, 1]"


# ------------------------------------------------------------------------------ in the controller
def _mock(**kw):
    from genlm_vlm import MockAsyncLM

    return MockAsyncLM(seed=1, **kw)


def _fingerprint(result) -> list:
    return [(p.token_ids, p.log_weight, p.status) for p in result.particles]


def test_a_token_mask_may_return_a_bitmask():
    """The same run whether the mask function returns bool [m, V], an int32 bitmask (numpy or
    torch) or a bool tensor; a wrong shape is refused with the shapes it accepts."""
    from genlm_vlm.smc import TokenMask

    lm = _mock()
    v = lm.vocab_size
    allow = np.zeros(v, dtype=bool)
    allow[[3, 5, 8, 13, 21, 34, 55]] = True
    allow[lm.tokenizer.eos_token_id] = True
    bits = S.pack(allow[None, :])

    def as_bool(gens):
        out = np.repeat(allow[None, :], len(gens), axis=0)
        for k, g in enumerate(gens):  # state-dependent: no token twice in a row
            if g:
                out[k, g[-1]] = False
        return out

    variants = {
        "bool": as_bool,
        "bits numpy": lambda gens: S.pack(as_bool(gens)).numpy(),
        "bits torch": lambda gens: S.pack(as_bool(gens)),
        "bool torch": lambda gens: torch.from_numpy(as_bool(gens)),
    }
    runs = {k: lm.smc_sync([1, 2], TokenMask(fn, k), 10, 8, seed=4, ess_threshold=0.8) for k, fn in variants.items()}
    base = _fingerprint(runs["bool"])
    assert all(_fingerprint(r) == base for r in runs.values())
    assert all(set(p.token_ids) <= set(np.flatnonzero(allow)) for p in runs["bool"].particles)
    with pytest.raises(ValueError, match=rf"bool \[1, {v}\] or an int32 bitmask \[1, {S.words(v)}\]"):
        lm.smc_sync([1, 2], TokenMask(lambda g: np.repeat(bits.numpy()[:, :-1], len(g), 0)), 4, 4)
    lm.cleanup()


@pytest.mark.parametrize("step_threads", [1, None])
def test_a_seeded_run_is_the_same_whatever_the_thread_count_and_never_draws_padding(step_threads, monkeypatch):
    """A whole seeded run (MockAsyncLM: its rows do not depend on threads) gives the same bytes
    with 1 and 2 torch threads; a mask that allows every column never draws the padding columns
    (the model's width past its vocabulary), and the stats report the step's costs."""
    from genlm_vlm.smc import TokenMask

    byte_vocab = [b""] + [bytes([c]) for c in range(97, 123)] + [b"<eos>"]
    lm = _mock(byte_vocab=byte_vocab, eos_token_id=len(byte_vocab) - 1, vocab_size=64)
    everything = TokenMask(lambda g: np.ones((len(g), 64), dtype=bool), "everything")
    monkeypatch.setattr(S, "CPU_STEP_THREADS", step_threads)
    before = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 1):
            S.set_threads(n)
            runs.append(lm.smc_sync([1], everything, 16, 10, seed=9, ess_threshold=0.7))
    finally:
        S.set_threads(before)
    assert _fingerprint(runs[0]) == _fingerprint(runs[1]) == _fingerprint(runs[2])
    assert all(t < len(byte_vocab) for r in runs for p in r.particles for t in p.token_ids)
    stats = runs[0].stats
    for key in ("mask_s", "mask_ms_per_step", "step_ms_per_step", "controller_s"):
        assert stats[key] >= 0, key
    assert stats["mask_s"] <= stats["controller_s"]
    lm.cleanup()


def test_masks_are_asked_once_per_distinct_history():
    """Resampled copies share their history: the mask function sees each history once a step."""
    from genlm_vlm.smc import TokenMask

    lm = _mock()
    calls = []

    def fn(gens):
        calls.append(list(gens))
        out = np.zeros((len(gens), lm.vocab_size), dtype=bool)
        out[:, 3:40] = True  # no EOS: every particle runs to max_tokens
        return out

    r = lm.smc_sync([1, 2], TokenMask(fn, "some"), 16, 8, seed=2, ess_threshold=1.0)
    assert r.resamples >= 3
    steps = calls[1:]  # the first call is bind's check of the empty prefix
    assert all(len(set(c)) == len(c) for c in steps)
    assert sum(len(c) for c in steps) < r.stats["rows"]  # copies shared a call's row
    lm.cleanup()


def test_a_bound_constraint_may_implement_masks_or_bitmasks():
    from genlm_vlm.smc.constraints import BoundConstraint, unpack_bits, usable_width

    class OnlyMasks(BoundConstraint):
        width = 40

        def initial(self):
            return ()

        def masks(self, states):
            out = np.zeros((len(states), 40), dtype=bool)
            out[:, [1, 33, 39]] = True
            return out

        def advance(self, state, token):
            return state

        def copy(self, state):
            return state

    class Neither(OnlyMasks):
        masks = BoundConstraint.masks

    bits = OnlyMasks().bitmasks([(), ()])
    assert bits.dtype == torch.int32 and bits.shape == (2, 2)
    assert np.array_equal(unpack_bits(bits, 40), OnlyMasks().masks([(), ()]))
    with pytest.raises(NotImplementedError, match="must implement bitmasks"):
        Neither().bitmasks([()])
    assert usable_width([b"a", b"", b"bc", b"", b""], [0]) == 3
    assert usable_width([b"a", b"", b"", b"", b""], [3]) == 4  # EOS with no bytes counts


def test_allowed_tokens_far_below_the_rows_best_keep_their_mass():
    """The CPU's dense path shifts by the row's best usable entry and exponentiates in float32:
    allowed tokens 150 nats below it would underflow to no mass. Such a row is recomputed with
    the allowed tokens' own best as the shift: it lives, with the right increment."""
    rows = torch.full((2, 600), -300.0)
    rows[:, 0] = 0.0  # the best token, masked
    rows[0, [10, 400]] = torch.tensor([-150.0, -151.0])
    rows[1, 7] = -3.0  # an ordinary row beside it
    mask = np.zeros((2, 600), dtype=bool)
    mask[0, [10, 400]] = True
    mask[1, [7, 8]] = True
    u = np.array([0.9, 0.2])
    tok, inc = S.to_host(*S.propose(rows.clone(), S.pack(mask), u, 1.0, path="dense"))
    assert tok == [400, 7]
    assert inc[0] == pytest.approx(-150.0 + math.log1p(math.exp(-1.0)), abs=1e-5)
    assert inc[1] == pytest.approx(math.log(math.exp(-3.0) + math.exp(-300.0)), abs=1e-5)


def test_scratch_buffers_reused_at_another_width_carry_nothing_over():
    """The CPU path's per-thread buffers outlive a step: a narrower step after a wider one (the
    last block's columns past the width held the wider step's values) draws within its width
    and matches the reference."""
    rng = np.random.default_rng(9)
    for m, v in ((3, 900), (5, 300), (3, 900), (2, 257)):
        rows, mask, u = random_case(rng, m, v, v, 0.9)
        tok, inc = S.to_host(*S.propose(rows.clone(), S.pack(mask), u, 1.0, path="dense"))
        assert all(t < v for t in tok)
        check_against_reference(tok, inc, reference(rows.numpy(), mask, u, 1.0), rel=F32_REL, tie=F32_REL,
                                abs_=F32_REL)


def test_the_fused_step_draws_no_column_past_its_rows_and_takes_any_strides():
    """Rows that are a column slice of a wider tensor (not contiguous), as wide as the
    vocabulary (77: a partial last word): the columns past them hold +50 and are never drawn;
    tokens are the gather path's, increments within float64 round-off."""
    if not C.fused_available():
        pytest.skip(C.fused_error() or "no numba")
    rng = np.random.default_rng(21)
    big = torch.full((6, 96), 50.0)
    rows = big[:, :77]
    rows.copy_(torch.log_softmax(torch.from_numpy(rng.standard_normal((6, 77))).float(), dim=1))
    assert not rows.is_contiguous()
    mask = rng.random((6, 77)) < 0.5
    mask[:, 76] = True  # the last column, in the partial last word
    u = np.array([0.0, 0.3, 0.6, 0.9, np.nextafter(1.0, 0.0), 0.5])
    bits = S.pack(mask)
    fused = S.to_host(*S.propose(rows, bits, u, 0.7, path="fused"))
    gather = S.to_host(*S.propose(rows.clone(), bits, u, 0.7, path="gather"))
    assert fused[0] == gather[0] and all(0 <= t < 77 for t in fused[0])
    np.testing.assert_allclose(fused[1], gather[1], rtol=FUSED_REL, atol=FUSED_REL)
    assert torch.equal(big[:, 77:], torch.full((6, 19), 50.0))


def test_the_fused_steps_best_entry_is_the_in_order_maximum_ignoring_nan():
    """The fused kernel's shift (``step_cpu._best``, eight running maxima) is what ``top = max(top,
    v)`` in order gives: NaN entries ignored, ``-inf`` for none, every length mod 8 (the Python
    function that numba compiles, run as Python; the compiled kernel is covered by the paths
    above)."""
    rng = np.random.default_rng(5)
    best = getattr(C._best, "py_func", C._best)
    for n in [0, 1, 7, 8, 9, 15, 16, 17, 100]:
        for fill in ("normal", "nan", "-inf"):
            vals = rng.standard_normal(n + 3).astype(np.float32)
            if fill != "normal" and n:
                vals[rng.random(n + 3) < 0.5] = np.nan if fill == "nan" else -np.inf
            top = -np.inf
            for v in vals[:n]:
                top = max(top, v)
            got = best(vals, n)
            assert got == top or (np.isnan(got) and np.isnan(top)), (n, fill, got, top)


@pytest.mark.parametrize("t", [1.0, 0.5])
def test_the_fused_exponential_holds_over_the_whole_float64_range(t):
    """Entries from 0 down to -1,600 after the temperature (past float64's smallest normal
    exponential, e ** -708): increments within round-off of the float64 reference, tokens equal."""
    if not C.fused_available():
        pytest.skip(C.fused_error() or "no numba")
    rng = np.random.default_rng(8)
    m, v = 16, 4000
    rows = torch.from_numpy(-800.0 * rng.random((m, v)) ** 4).float()  # many entries near the top, a tail to -800
    mask = rng.random((m, v)) < 0.7
    u = rng.random(m)
    tok, inc = S.to_host(*S.propose(rows, S.pack(mask), u, t, path="fused"))
    assert check_against_reference(tok, inc, reference(rows.numpy(), mask, u, t), rel=FUSED_REL, tie=1e-12,
                                   abs_=FUSED_REL) == 0


def test_a_grammar_advances_its_states_together_as_one_by_one_and_names_a_refused_token():
    """``advance_many`` (the controller's one call per step) leaves each matcher where
    ``advance`` would, and a token the grammar refuses raises, naming it."""
    from genlm_vlm.smc import Regex

    vocab = [b"a", b"b", b"ab", b"ba", b""]
    bound = Regex("(ab)+").bind(vocab, [4], 5, {})
    together = [bound.initial() for _ in range(3)]
    one_by_one = [bound.initial() for _ in range(3)]
    moves = [0, 2, 0]
    together = bound.advance_many(together, moves)
    one_by_one = [bound.advance(s, t) for s, t in zip(one_by_one, moves, strict=True)]
    assert np.array_equal(bound.masks(together), bound.masks(one_by_one))
    assert bound.masks(together)[0].tolist() == [False, True, False, True, False]  # after "a": "b" or "ba"
    with pytest.raises(ValueError, match="token 1 is not allowed here"):
        bound.advance_many([bound.initial()], [1])  # "b" cannot start (ab)+


def test_strided_uniforms_and_bitmasks_are_taken():
    """Uniforms and bitmasks handed as strided views (every other entry of a larger tensor)."""
    rng = np.random.default_rng(4)
    rows, mask, _ = random_case(rng, 6, 300, 300, 0.4)
    u = torch.from_numpy(rng.random(12))[::2]
    bits = S.pack(np.repeat(mask, 2, axis=0))[::2]
    assert not u.is_contiguous() and not bits.is_contiguous()
    got = S.to_host(*S.propose(rows, bits, u, 1.0))
    want = S.to_host(*S.propose(rows, bits.contiguous(), u.contiguous().numpy(), 1.0, path="gather"))
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], rtol=FUSED_REL, atol=FUSED_REL)


def test_scratch_buffers_made_in_inference_mode_serve_a_later_step_outside_it():
    """A step run inside ``torch.inference_mode`` (as in vLLM's sampler) and then one outside it,
    on the same thread: the per-thread scratch buffers are ordinary tensors, so both run (an
    inference-tensor buffer failed the second with "Inplace update to inference tensor")."""
    import genlm_vlm.smc.step_cpu as C

    for name in ("keep", "e", "masses", "picks"):
        if hasattr(C._workspace, name):
            delattr(C._workspace, name)
    rng = np.random.default_rng(5)
    rows = torch.log_softmax(torch.from_numpy(rng.normal(size=(4, 300)).astype(np.float32)), dim=1)
    bits = S.pack(np.ones((4, 300), dtype=bool))
    u = rng.random(4)
    with torch.inference_mode():
        inside = S.to_host(*S.propose(rows.clone(), bits, u, path="dense"))
    outside = S.to_host(*S.propose(rows.clone(), bits, u, path="dense"))
    assert inside[0] == outside[0] and np.array_equal(inside[1], outside[1])


@pytest.mark.parametrize("t", [1.0, 0.7])
def test_the_controllers_direct_fused_call_is_proposes_fused_path_bit_for_bit(t):
    """The built-in controller hands the fused kernel its numpy arrays directly
    (``step.fused_inputs`` and ``step_cpu.fused_arrays``, no checks or tensors around it):
    the same tokens and increments, bit for bit, as ``propose(path="fused")``, at a width that
    ends inside a word (its last word's bits past the width cleared), with rows that are a column
    slice; not taken where ``propose`` would take another path; a malformed bitmask refused with
    ``propose``'s own error."""
    if not C.fused_available():
        pytest.skip(C.fused_error() or "no numba")
    rng = np.random.default_rng(4)
    big = torch.log_softmax(torch.from_numpy(rng.standard_normal((7, 320)).astype(np.float32)), dim=1)
    rows, width = big[:, :300], 290
    mask = rng.random((7, 320)) < 0.6  # allowed bits past the width too: both must clear them
    bits = S.pack(mask)
    u = rng.random(7)
    x, b = S.fused_inputs(rows, bits, width, t, None)
    assert b.shape == (7, 10) and not (b[:, -1] >> 2).any()  # 290 = 9 words + 2 bits
    tok, inc = C.fused_arrays(x, b, u, t, width)
    want_tok, want_inc = S.to_host(*S.propose(rows, bits, u, t, width=width, path="fused"))
    assert tok.tolist() == want_tok and np.array_equal(inc, want_inc)
    assert all(0 <= k < width for k in tok.tolist())
    assert S.fused_inputs(rows, bits, width, 0.0, None) is None  # greedy: not the fused path
    assert S.fused_inputs(rows.double(), bits, width, t, None) is None
    for bad in (bits[:, :5], bits.long()):  # too few words, another dtype: propose's own error
        with pytest.raises(ValueError, match=r"bits must be int32 \[7, >= 10\]"):
            S.fused_inputs(rows, bad, width, t, None)
        with pytest.raises(ValueError, match=r"bits must be int32 \[7, >= 10\]"):
            S.propose(rows, bad, u, t, width=width, path="fused")
