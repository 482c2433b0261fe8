"""The SMC demo: helper functions with a fake model, then the real command on the shipped model."""

from __future__ import annotations

import asyncio
import json
import math
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

import genlm_vlm
from genlm_vlm import cli, demo
from genlm_vlm.demo import report
from genlm_vlm.smc import Particle, SMCController, SMCResult, drive

REPO = pathlib.Path(__file__).resolve().parent.parent

# A toy vocabulary: <s>=0, </s>=1 (EOS), then ordinary tokens.
VOCAB = [b"<s>", b"</s>", b"a", b"b", b" ", b"ab", b".", b"\xc3"]
EOS = 1


def _row(probs: dict[int, float]) -> torch.Tensor:
    p = torch.zeros(len(VOCAB), dtype=torch.float64)
    for i, v in probs.items():
        p[i] = v
    return torch.log(p / p.sum()).float()


# ------------------------------------------------------------------------------ constraints
def test_charset_and_regex_constraints() -> None:
    cs = demo.CharSetConstraint("ab ", VOCAB, EOS, special_ids=[0, 1])
    assert cs.mask(b"").nonzero().flatten().tolist() == [1, 2, 3, 4, 5]  # EOS + a, b, " ", ab
    rc, _ = demo.demo_constraint(None, "ab+", VOCAB, EOS, [0, 1])
    bound = rc.bind(VOCAB, [EOS], len(VOCAB))
    s0 = bound.initial()
    assert np.flatnonzero(bound.masks([s0])[0]).tolist() == [2, 5]  # "a", "ab"
    s1 = bound.advance(bound.copy(s0), 2)
    assert np.flatnonzero(bound.masks([s1])[0]).tolist() == [3]
    s2 = bound.advance(bound.copy(s0), 5)
    assert np.flatnonzero(bound.masks([s2])[0]).tolist() == [1, 3]  # EOS once it fully matches
    both, described = demo.demo_constraint("ab ", "ab+", VOCAB, EOS, [0, 1])
    b2 = both.bind(VOCAB, [EOS], len(VOCAB))
    assert np.flatnonzero(b2.masks([b2.advance(b2.initial(), 5)])[0]).tolist() == [1, 3]
    assert "characters in 'ab '" in described and "/ab+/" in described


def test_parse_engine_opts() -> None:
    opts = cli.parse_engine_opts(
        [
            "max_model_len=256",
            "enforce_eager=true",
            "gpu_memory_utilization=0.5",
            "dtype=bfloat16",
            "seed=none",
        ]
    )
    assert opts == {
        "max_model_len": 256,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.5,
        "dtype": "bfloat16",
        "seed": None,
    }
    with pytest.raises(ValueError):
        cli.parse_engine_opts(["novalue"])


# ------------------------------------------------------------------------ SMC with a fake model
class FakeLM:
    """A next-token distribution given by ``probs`` (a dict, or a function of the generated ids),
    with the one method :func:`genlm_vlm.smc.drive` awaits; counts rows and checks that every
    context starts with the prompt."""

    def __init__(
        self, probs: dict[int, float] | Callable[[list[int]], dict[int, float]], prompt: list[int]
    ) -> None:
        self.probs = probs
        self.prompt = prompt
        self.calls = 0

    async def batch_next_token_logprobs(self, ids_list: list, lora_name: str | None = None) -> torch.Tensor:
        rows = []
        for ids in ids_list:
            ids = list(ids)
            assert ids[: len(self.prompt)] == self.prompt
            self.calls += 1
            probs = self.probs(ids[len(self.prompt) :]) if callable(self.probs) else self.probs
            rows.append(_row(probs))
        await asyncio.sleep(0)
        return torch.stack(rows)


def _run(fake: FakeLM, allowed: str, n_particles: int, max_tokens: int, seed: int) -> SMCResult:
    constraint, _ = demo.demo_constraint(allowed, None, VOCAB, EOS, [0, 1])
    bound = constraint.bind(VOCAB, [EOS], len(VOCAB))
    ctl = SMCController(bound, n_particles, max_tokens, eos_ids=[EOS], byte_vocab=VOCAB, seed=seed)
    return asyncio.run(drive(fake, fake.prompt, ctl))


def test_smc_exact_weights_without_eos() -> None:
    # p(a)=p(b)=0.3, p(".")=0.4; allowed mass is 0.6 at every step for every particle. EOS is
    # never allowed: every particle is cut, so nothing finished (log_marginal = -inf) and the
    # cut particles' mass is exactly 0.6^5.
    fake = FakeLM({2: 0.3, 3: 0.3, 6: 0.4}, prompt=[0])
    res = _run(fake, "ab", n_particles=16, max_tokens=5, seed=1)
    assert res.log_marginal == -math.inf and res.posterior == {}
    assert res.log_marginal_cut == pytest.approx(5 * math.log(0.6), abs=1e-5)
    assert res.log_marginal_with_cut == pytest.approx(5 * math.log(0.6), abs=1e-5)
    assert res.empty_reason is not None and "no particle finished within max_tokens=5 (16 of 16 cut)" in res.empty_reason
    assert res.resamples == 0 and res.steps == 5
    assert res.stats["rows"] == fake.calls == 16 * 5
    for p in res.particles:
        assert len(p.token_ids) == 5 and set(p.text) <= set(b"ab")
        assert p.log_weight == pytest.approx(5 * math.log(0.6), abs=1e-5)


def test_smc_evidence_with_eos_is_unbiased() -> None:
    # Each step: EOS 0.1, allowed 0.5, forbidden 0.4. log_marginal estimates P(EOS within T
    # tokens, every token before it allowed) = sum_k<T 0.5^k 0.1; the cut particles' estimate is
    # P(T allowed tokens, no EOS) = 0.5^T; the two add up to what both estimated together.
    T = 4
    finished = sum(0.5**k * 0.1 for k in range(T))
    cut = 0.5**T
    fake = FakeLM({1: 0.1, 2: 0.25, 4: 0.25, 6: 0.4}, prompt=[0, 2])
    estimates, cuts, both = [], [], []
    for seed in range(24):
        res = _run(fake, "a ", n_particles=200, max_tokens=T, seed=seed)
        estimates.append(math.exp(res.log_marginal))
        cuts.append(math.exp(res.log_marginal_cut))
        both.append(math.exp(res.log_marginal_with_cut))
        assert res.n_cut > 0 and res.n_finished > 0 and res.empty_reason is None
        for p in res.particles:
            assert set(p.text) <= set(b"a ") and len(p.token_ids) <= T
            assert p.finished or len(p.token_ids) == T
    # (one standard error over 24 runs: 1.7% of `finished`, 1.2% of `cut`; the sum is 33% above `finished`)
    assert np.mean(estimates) == pytest.approx(finished, rel=0.05)
    assert np.mean(cuts) == pytest.approx(cut, rel=0.05)
    assert np.mean(both) == pytest.approx(finished + cut, rel=0.05)


def test_smc_resamples_away_from_dead_ends() -> None:
    # After "b" the model almost surely says "." (forbidden): those particles lose their weight,
    # the ESS collapses and resampling replaces them with "a" particles.
    def probs(generated: list[int]) -> dict[int, float]:
        if generated and generated[-1] == 3:
            return {6: 0.99, 2: 0.01}
        return {2: 0.3, 3: 0.6, 6: 0.1}

    fake = FakeLM(probs, prompt=[0])
    estimates, resampled = [], 0
    for seed in range(100):
        res = _run(fake, "ab", n_particles=64, max_tokens=3, seed=seed)
        # the weights part at step 2; after step 3 every particle is cut: nothing to resample for
        assert res.resampled_at in ([], [2])
        if res.resampled_at:
            resampled += 1
            assert sum(p.text.startswith(b"b") for p in res.particles) <= 6  # ~2% of them in expectation
        assert res.log_marginal == -math.inf and res.n_cut == 64  # every particle is cut: nothing finished
        estimates.append(math.exp(res.log_marginal_cut))
    assert resampled >= 90
    # P(3 allowed tokens) = aa* + ab* + ba* = .3*.3*.9 + .3*.6*.01 + .6*.01*.9
    # (about 3 standard errors over 100 runs)
    assert np.mean(estimates) == pytest.approx(0.3 * 0.3 * 0.9 + 0.3 * 0.6 * 0.01 + 0.6 * 0.01 * 0.9, rel=0.1)


def test_smc_dead_particles() -> None:
    fake = FakeLM({6: 1.0}, prompt=[0])  # only "." has probability: nothing allowed survives
    res = _run(fake, "ab", n_particles=4, max_tokens=3, seed=0)
    assert res.log_marginal == -math.inf and res.log_marginal_cut == -math.inf
    assert all(p.dead and not p.token_ids for p in res.particles)
    assert res.stats["died_at"] == 1 and res.posterior == {}
    assert res.empty_reason.startswith("every particle died (all 4 by step 1)")


# ------------------------------------------------------------------------------ the real thing
def test_shipped_model_files() -> None:
    path = pathlib.Path(genlm_vlm.demo_model_path())
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "TRAINING.md",
    ):
        assert (path / name).is_file(), name
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert total < 5_000_000
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] >= 64
    assert config.get("dtype", config.get("torch_dtype")) in ("float16", "bfloat16")


_PARTICLE = re.compile(
    r'^  (?P<w>\d\.\d{4})  x(?P<n>\d+)\s+(?P<prompt>".*?") \+ (?P<text>".*")(?P<end>  <(?:eos|dead)>)?$'
)


def _parse(output: str) -> tuple[list[tuple[float, int, str, bool]], dict[str, int]]:
    particles = []
    for line in output.splitlines():
        m = _PARTICLE.match(line)
        if m:
            particles.append((float(m["w"]), int(m["n"]), json.loads(m["text"]), m["end"] == "  <eos>"))
    stats = {
        key: int(m.group(1))
        for key, pattern in (
            ("rows", r"rows \(particle-steps\):\s+(\d+)"),
            ("engine_steps", r"engine steps:\s+(\d+)"),
        )
        if (m := re.search(pattern, output))
    }
    return particles, stats


def _check(
    output: str, allowed: Callable[[str], bool], n_particles: int, max_tokens: int
) -> list[tuple[float, int, str, bool]]:
    particles, stats = _parse(output)
    assert particles, output
    assert sum(n for _, n, _, _ in particles) == n_particles
    assert sum(w for w, _, _, _ in particles) == pytest.approx(1.0, abs=1e-3 * len(particles))
    for _, _, text, _ in particles:
        assert allowed(text), text
    assert stats["engine_steps"] <= max_tokens + 1  # one engine step per SMC step (+ the prompt's)
    assert stats["engine_steps"] < stats["rows"], stats
    assert "estimated log P(constraint)" in output
    return particles


_RUN = re.compile(r"^SMC: (\d+) steps, (?:resampled (once|\d+ times) \(after steps? ([\d, and]+):|never resampled)", re.M)
_ENDED = re.compile(r"^particles: (\d+) of (\d+) ended with EOS, (\d+) cut off by --max-tokens (\d+)", re.M)


@pytest.fixture(scope="module")
def default_demo() -> subprocess.CompletedProcess[str]:
    """One run of the command with every default, as `bash scripts/demo.sh --quiet` runs it
    (--quiet changes stderr only), shared by the tests below."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "GENLM_VLM_VERBOSE")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "genlm_vlm", "demo", "--quiet"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_default_demo_resamples_and_particles_finish_quietly(default_demo: subprocess.CompletedProcess[str]) -> None:
    """The default run: SMC resamples, particles end with EOS, the texts obey the default
    constraint (no letter e), and --quiet leaves stderr empty (torch's C++ NUMA notice and vLLM's
    log included)."""
    proc = default_demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    particles = _check(out, lambda text: "e" not in text, 32, 32)
    assert "shipped demo model" in out and "text matching /[^e]*/" in out
    assert "(weight: the particles' share" in out  # the table is explained
    run, ended = _RUN.search(out), _ENDED.search(out)
    assert run and ended, out
    assert run.group(2) is not None, f"the default run did not resample:\n{out}"
    resamples = 1 if run.group(2) == "once" else int(run.group(2).split()[0])
    assert resamples == len(re.findall(r"\d+", run.group(3))) >= 1
    n_eos, n, n_cut = int(ended.group(1)), int(ended.group(2)), int(ended.group(3))
    assert n == 32 and n_eos >= 16 and n_eos + n_cut <= 32, out
    assert n_eos == sum(count for _, count, _, eos in particles if eos)


def _readme_demo_excerpt() -> list[str]:
    """The lines of the README's demo excerpt: the fenced block after the sentence that
    introduces `bash scripts/demo.sh`'s output."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    intro = readme.index("`bash scripts/demo.sh` runs SMC")
    start = readme.index("```\n", intro) + 4
    return readme[start : readme.index("```", start)].splitlines()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the README's excerpt is the CPU build's run")
def test_readme_demo_excerpt_is_what_the_demo_prints(default_demo: subprocess.CompletedProcess[str]) -> None:
    """Every line of the README's excerpt (``...`` stands for lines left out) is a line of the
    default run's output, in the same order. The excerpt holds no timing-dependent figure: the
    weights, texts, resampling steps and estimates are fixed by the seed."""
    # the README's command runs exactly this command (scripts/demo.sh adds no argument)
    assert '-m genlm_vlm demo "$@"' in (REPO / "scripts" / "demo.sh").read_text()
    assert default_demo.returncode == 0, default_demo.stdout + default_demo.stderr
    excerpt = [line for line in _readme_demo_excerpt() if line.strip() != "..."]
    assert len(excerpt) >= 6 and excerpt[0].startswith("particles (32, ")
    assert any(_PARTICLE.match(line) for line in excerpt)
    output = default_demo.stdout.splitlines()
    at = 0
    for line in excerpt:
        assert line in output[at:], (
            f"README.md's demo excerpt has a line the demo does not print (in this order):\n  {line}\n"
            f"update the excerpt to the run's output:\n{default_demo.stdout}"
        )
        at = output.index(line, at) + 1


def test_describe_run_counts_resamples_and_endings() -> None:
    p = Particle
    particles = [
        p([2], b"a", 0.0, "finished"),
        p([2], b"a", 0.0, "finished"),
        p([3], b"b", 0.0, "cut"),
        p([], b"", -math.inf, "dead"),
    ]
    result = SMCResult(particles, -1.0, {}, resampled_at=[3, 5], stats={"steps": 7})
    assert report.describe_run(result, 0.5, 7) == [
        "SMC: 7 steps, resampled 2 times (after steps 3 and 5: the effective sample size fell "
        "below 0.5 x 4)",
        "particles: 2 of 4 ended with EOS, 1 cut off by --max-tokens 7, 1 died",
    ]
    once = SMCResult(particles[:3], -1.0, {}, resampled_at=[2], stats={"steps": 4})
    assert "resampled once (after step 2:" in report.describe_run(once, 0.5, 7)[0]
    never = SMCResult(particles[:3], -1.0, {}, stats={"steps": 4})
    assert report.describe_run(never, 0.25, 7)[0] == (
        "SMC: 4 steps, never resampled (the effective sample size stayed at or above 0.25 x 3)"
    )


def test_summarize_counts_finished_texts_and_reports_the_cut_mass() -> None:
    p = Particle
    done, cut, dead = p([2], b"a", -1.0, "finished"), p([3, 3], b"bb", -2.0, "cut"), p([], b"", -math.inf, "dead")
    some = SMCResult([done, cut], -1.5, {b"a": 1.0}, log_marginal_cut=-2.5)
    lines = report.summarize(some, 2)
    assert lines[0].startswith("estimated log P(constraint) = -1.500: ") and "ends with EOS within 2 tokens" in lines[0]
    assert "1 of 2 particles were cut off" in lines[1] and "-2.500, not counted above" in lines[1]
    none = SMCResult([cut, dead], -math.inf, {}, log_marginal_cut=-2.7, stats={})
    lines = report.summarize(none, 2)
    assert lines[0].startswith("no particle ended with EOS within --max-tokens 2 (1 of 2 cut off, 1 died), "
                               "so estimated log P(constraint) = -inf")
    assert "-2.700; raise --max-tokens" in lines[1]
    lines = report.summarize(SMCResult([dead, dead], -math.inf, {}, stats={"died_at": 1}), 2)
    assert lines[0].startswith("no particle can satisfy the constraint: all 2 died at step 1")


def test_demo_main_in_process_with_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--particles",
        "6",
        "--max-tokens",
        "5",
        "--seed",
        "3",
        "--no-progress",
        "--prompt",
        "this function",
        "--allowed-chars",
        "etaoinshrdlu ",
        "--regex",
        "[a-z ]*",
        "--engine-opt",
        "max_model_len=256",
        "--engine-opt",
        "kv_cache_memory_bytes=134217728",
    ]
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    _check(out, lambda text: set(text) <= set("etaoinshrdlu "), 6, 5)
    prompts = [json.loads(m["prompt"]) for line in out.splitlines() if (m := _PARTICLE.match(line))]
    assert prompts and set(prompts) == {"this function"}
