#!/usr/bin/env python3
"""Helpers for the offline vLLM wheelhouse (stdlib + `packaging` only).

Subcommands
-----------
closure     Check a downloaded wheelhouse against requirements-offline.txt:
            every pinned line has a wheel, and every Requires-Dist of every
            shipped wheel (markers evaluated for the target interpreter) is
            satisfied by another shipped wheel, a ``# host:`` line or a
            ``# skip:`` line (required but not needed at run time).
            Also lists which of vLLM's own Requires-Dist are not shipped.
pins        Compare the shipped pins with a pip resolution report
            (``pip install --dry-run --report``): pins that differ, and
            resolved packages that are neither shipped, host nor skipped.
host-check  On the GPU host: check the ``# host:`` packages are installed at
            acceptable versions (warns; ``--strict`` makes it an error).
install     Minimal wheel installer (unzip into a target folder) for hosts
            whose Python has no pip. Handles ``*.data/{purelib,platlib,scripts}``.
supported   Split wheels into those this interpreter/platform can install and
            those it cannot (e.g. a manylinux_2_31 wheel on a glibc 2.28 host).
stub        Write an import-only stand-in package (only for STUBBABLE names).
store       Rewrite wheels in place with uncompressed (stored) zip members, so
            that the xz-compressed transfer tar compresses the raw bytes
            (~30% smaller than xz over deflate). Contents and RECORD are
            unchanged, so pip installs them exactly as before.

Runs on Python >= 3.10; needs ``packaging`` (a transformers dependency) or
falls back to the copy vendored inside pip.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - only on hosts without `packaging`
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.tags import sys_tags  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import (  # type: ignore[no-redef]
        canonicalize_name,
        parse_wheel_filename,
    )
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

HOST_PREFIX = re.compile(r"^#\s*(?P<kind>host|skip):\s*(?P<req>[^#]*?)\s*(#.*)?$")


def target_env(python_version: str) -> dict[str, str]:
    major, minor = python_version.split(".")[:2]
    return {
        "python_version": f"{major}.{minor}",
        "python_full_version": f"{major}.{minor}.0",
        "implementation_name": "cpython",
        "implementation_version": f"{major}.{minor}.0",
        "platform_python_implementation": "CPython",
        "platform_machine": "x86_64",
        "platform_system": "Linux",
        "sys_platform": "linux",
        "os_name": "posix",
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def parse_requirements(
    path: Path, with_skipped: bool = False
) -> tuple[list[Requirement], list[Requirement]]:
    """Return (shipped, host_provided) requirements from requirements-offline.txt; with
    ``with_skipped`` the ``# skip:`` lines count as host-provided (for the closure check)."""
    shipped: list[Requirement] = []
    host: list[Requirement] = []
    for raw in path.read_text().splitlines():
        m = HOST_PREFIX.match(raw.strip())
        if m:
            if m.group("kind") == "host" or with_skipped:
                host.append(Requirement(m.group("req")))
            continue
        line = raw.split("#", 1)[0].strip()
        if line:
            shipped.append(Requirement(line))
    return shipped, host


def wheel_metadata(whl: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist lines) read from a wheel."""
    with zipfile.ZipFile(whl) as zf:
        metas = [
            n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
        ]
        if len(metas) != 1:
            raise SystemExit(f"{whl.name}: expected one .dist-info/METADATA, found {metas}")
        msg = email.parser.Parser().parsestr(zf.read(metas[0]).decode("utf-8"))
    return (
        canonicalize_name(msg["Name"]),
        msg["Version"],
        msg.get_all("Requires-Dist") or [],
    )


def _applies(req: Requirement, env: dict[str, str]) -> bool:
    return req.marker is None or req.marker.evaluate(env)


def cmd_closure(args: argparse.Namespace) -> int:
    env = target_env(args.python_version)
    shipped, host = parse_requirements(Path(args.requirements), with_skipped=True)
    host_names = {canonicalize_name(r.name): r for r in host}
    wheels: dict[str, tuple[str, list[str], str]] = {}
    for whl in sorted(Path(args.wheelhouse).glob("*.whl")):
        name, version, requires = wheel_metadata(whl)
        if name in wheels:
            print(f"ERROR: two wheels for {name}: {wheels[name][2]} and {whl.name}")
            return 1
        wheels[name] = (version, requires, whl.name)

    errors: list[str] = []
    for req in shipped:
        got = wheels.get(canonicalize_name(req.name))
        if got is None:
            errors.append(f"requirement {req} has no wheel in the wheelhouse")
        elif not req.specifier.contains(got[0], prereleases=True):
            errors.append(f"requirement {req} but wheelhouse has {got[2]}")
    listed = {canonicalize_name(r.name) for r in shipped} | {canonicalize_name(args.main)}
    for name in sorted(set(wheels) - listed):
        errors.append(f"wheel {wheels[name][2]} is not listed in {args.requirements}")

    missing_vllm: list[tuple[str, str]] = []
    for name, (_version, requires, fname) in sorted(wheels.items()):
        for line in requires:
            req = Requirement(line)
            if not _applies(req, env):
                continue
            dep = canonicalize_name(req.name)
            if dep in wheels:
                if not req.specifier.contains(wheels[dep][0], prereleases=True):
                    errors.append(f"{fname} needs {req}, wheelhouse has {wheels[dep][2]}")
                continue
            if dep in host_names:
                continue
            if name == canonicalize_name(args.main):
                missing_vllm.append((dep, str(req)))
            else:
                errors.append(f"{fname} needs {req}: neither shipped nor host-provided")

    print(f"wheels: {len(wheels)}")
    if missing_vllm:
        print(f"{args.main} Requires-Dist deliberately NOT shipped ({len(missing_vllm)}):")
        for _dep, req in missing_vllm:
            print(f"  - {req}")
    for e in errors:
        print(f"ERROR: {e}")
    if errors:
        return 1
    print("closure OK: every shipped wheel's dependencies are shipped or host-provided")
    return 0


def cmd_pins(args: argparse.Namespace) -> int:
    import json

    report = json.loads(Path(args.report).read_text())
    resolved = {
        canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]
    }
    shipped, host = parse_requirements(Path(args.requirements), with_skipped=True)
    differ = 0
    for req in shipped:
        got = resolved.get(canonicalize_name(req.name))
        if got is None:
            print(f"not in the resolution: {req}")
            differ += 1
        elif not req.specifier.contains(got, prereleases=True):
            print(f"pin {req} but the resolution has {got}")
            differ += 1
    listed = {canonicalize_name(r.name) for r in shipped + host} | {canonicalize_name(args.main)}
    extra = sorted(set(resolved) - listed)
    print(f"resolved but not shipped ({len(extra)}): {' '.join(f'{n}=={resolved[n]}' for n in extra)}")
    print("pins agree with the resolution" if not differ else f"{differ} pin(s) differ")
    return 1 if differ else 0


def _installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cmd_host_check(args: argparse.Namespace) -> int:
    _, host = parse_requirements(Path(args.requirements))
    bad = 0
    for req in host:
        ver = _installed_version(req.name)
        if ver is None:
            status, bad = "MISSING", bad + 1
        else:
            try:
                ok = req.specifier.contains(Version(ver), prereleases=True)
            except InvalidVersion:
                ok = False
            status = "ok" if ok else f"UNSUPPORTED (have {ver})"
            bad += 0 if ok else 1
        print(f"  host {str(req):28s} {ver or '-':20s} {status}")
    if bad:
        level = "ERROR" if args.strict else "WARNING"
        print(f"{level}: {bad} host-provided package(s) missing or at unsupported versions")
        return 1 if args.strict else 0
    return 0


def _install_one(whl: Path, target: Path) -> None:
    bindir = target / "bin"
    with zipfile.ZipFile(whl) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            parts = info.filename.split("/")
            if len(parts) >= 3 and parts[0].endswith(".data"):
                kind, rest = parts[1], parts[2:]
                if kind in ("purelib", "platlib"):
                    dest = target.joinpath(*rest)
                elif kind == "scripts":
                    dest = bindir.joinpath(*rest)
                else:  # headers / data: not needed at runtime
                    continue
            else:
                dest = target.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                if dest.parent == bindir:
                    first = src.readline()
                    if first.startswith(b"#!python"):  # wheel spec: rewrite to this interpreter
                        first = b"#!" + sys.executable.encode() + first[len(b"#!python") :]
                    out.write(first)
                shutil.copyfileobj(src, out)
            mode = (info.external_attr >> 16) & 0o777
            if dest.parent == bindir:
                mode |= 0o755
            if mode:
                os.chmod(dest, mode)


def cmd_install(args: argparse.Namespace) -> int:
    target = Path(args.target)
    target.mkdir(parents=True, exist_ok=True)
    for whl in args.wheels:
        _install_one(Path(whl), target)
    print(f"unzip-installed {len(args.wheels)} wheels into {target}")
    return 0


def cmd_supported(args: argparse.Namespace) -> int:
    here = set(sys_tags())
    bad = 0
    for whl in args.wheels:
        _name, _ver, _build, tags = parse_wheel_filename(Path(whl).name)
        ok = not here.isdisjoint(tags)
        bad += not ok
        print(f"{'OK' if ok else 'UNSUPPORTED'} {whl}")
    return 1 if bad else 0


# Packages vLLM 0.25 imports only to evaluate class-body annotations
# (vllm/v1/structured_output/backend_guidance.py); a stand-in whose attributes
# are placeholder classes lets `import vllm` / `LLM(...)` work. Using the
# "guidance" structured-output backend then fails with a clear error.
STUBBABLE = {
    "llguidance": [
        "LLMatcher",
        "LLTokenizer",
        "LLInterpreter",
        "LLParserLimits",
        "StructTag",
        "grammar_from",
    ],
}

STUB_TEMPLATE = """\
# Import-only stand-in written by benchmarks/gpu/wheelhouse_tool.py stub.
# The real wheel could not be installed on this host (see install_offline.sh).
GENLM_STUB = True
__version__ = "0+genlm.stub"
_MSG = "{name} is a stub on this host; the real package could not be installed"


class _Missing:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(_MSG)


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (_Missing,), {{}})
"""


def cmd_stub(args: argparse.Namespace) -> int:
    name = canonicalize_name(args.name).replace("-", "_")
    if name not in STUBBABLE:
        print(f"ERROR: no stub known for {args.name}; stubbable: {sorted(STUBBABLE)}")
        return 1
    pkg = Path(args.target) / name
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STUB_TEMPLATE.format(name=name))
    for sub in ("hf", "torch"):
        (pkg / f"{sub}.py").write_text(f"from {name} import __getattr__  # noqa: F401\n")
    print(f"wrote import-only stub package {pkg}")
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    for whl in map(Path, args.wheels):
        if not zipfile.is_zipfile(whl):
            print(f"store: {whl.name} is not a zip file; left as is")
            continue
        with zipfile.ZipFile(whl) as zi:
            infos = zi.infolist()
            if all(i.compress_type == zipfile.ZIP_STORED for i in infos):
                continue
            tmp = whl.with_name(whl.name + ".stored.tmp")
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zo:
                for info in infos:
                    out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                    out.external_attr = info.external_attr
                    out.create_system = info.create_system
                    out.compress_type = zipfile.ZIP_STORED
                    with zi.open(info) as src, zo.open(out, "w", force_zip64=True) as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, whl)
        print(f"store: {whl.name} -> {whl.stat().st_size} bytes")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("closure")
    c.add_argument("--wheelhouse", required=True)
    c.add_argument("--requirements", required=True)
    c.add_argument("--python-version", default="3.12")
    c.add_argument("--main", default="vllm", help="distribution added outside the file")
    c.set_defaults(func=cmd_closure)

    pn = sub.add_parser("pins")
    pn.add_argument("--report", required=True, help="pip install --dry-run --report JSON")
    pn.add_argument("--requirements", required=True)
    pn.add_argument("--main", default="vllm")
    pn.set_defaults(func=cmd_pins)

    h = sub.add_parser("host-check")
    h.add_argument("--requirements", required=True)
    h.add_argument("--strict", action="store_true")
    h.set_defaults(func=cmd_host_check)

    i = sub.add_parser("install")
    i.add_argument("--target", required=True)
    i.add_argument("wheels", nargs="+")
    i.set_defaults(func=cmd_install)

    s = sub.add_parser("supported")
    s.add_argument("wheels", nargs="+")
    s.set_defaults(func=cmd_supported)

    st = sub.add_parser("stub")
    st.add_argument("--target", required=True)
    st.add_argument("name")
    st.set_defaults(func=cmd_stub)

    so = sub.add_parser("store")
    so.add_argument("wheels", nargs="+")
    so.set_defaults(func=cmd_store)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
