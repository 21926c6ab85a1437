"""Installs for the version matrix: bitsandbytes and transformers 4.57 in --target folders; no-bnb venv."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from matrix_cells import REPO

CONSTRAINTS = REPO / "constraints.txt"
MARKER = ".matrix-ok"  # written last into a --target dir: its install completed


def log(message: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class SetupError(Exception):
    """The matrix cannot run (an install failed, the package is missing, ...)."""


def pip(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise SetupError(f"{shlex.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return result


def torch_constraint(cache: Path) -> Path:
    """A constraints file that pins torch only (the repo's pin, else the installed version)."""
    line = None
    if CONSTRAINTS.exists():
        for raw in CONSTRAINTS.read_text().splitlines():
            if re.match(r"^\s*torch\s*==", raw):
                line = raw.strip()
    if line is None:
        from importlib import metadata

        try:
            line = "torch==" + metadata.version("torch").split("+")[0]
        except metadata.PackageNotFoundError:
            raise SetupError("torch is not installed in this interpreter")
    path = cache / "torch-constraint.txt"
    path.write_text(line + "\n")
    return path


def _complete(target: Path, distribution: str, version: str) -> bool:
    return (target / MARKER).exists() and (target / f"{distribution}-{version}.dist-info").is_dir()


def install_target(target: Path, requirements: list[str], refresh: bool) -> Path:
    """``pip install --no-deps --target``, atomically: a half-finished install never counts.

    pip byte-compiles what it installs, so children (often run with PYTHONDONTWRITEBYTECODE)
    do not recompile transformers on every start.
    """
    if (target / MARKER).exists() and not refresh:
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    log(f"installing {' '.join(requirements)} into {target}")
    pip("install", "--quiet", "--no-deps", "--target", str(staging), *requirements)
    (staging / MARKER).write_text("\n".join(requirements) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def install_bnb(cache: Path, version: str, refresh: bool) -> Path:
    target = cache / f"bnb-{version}"
    install_target(target, [f"bitsandbytes=={version}"], refresh)
    if not _complete(target, "bitsandbytes", version):
        raise SetupError(f"{target} does not hold bitsandbytes {version}")
    return target


def install_transformers4(cache: Path, spec: str, refresh: bool) -> Path:
    """transformers 4.57.x plus whichever of its dependencies the environment does not satisfy."""
    existing = sorted(cache.glob("transformers-4.*[0-9]"))
    if existing and not refresh and (existing[-1] / MARKER).exists():
        return existing[-1]
    constraint = torch_constraint(cache)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--quiet", "--report", str(report), "-c", str(constraint), spec)
        plan = json.loads(report.read_text())
    pins = [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in plan["install"]]
    names = {pin.split("==")[0].lower().replace("_", "-") for pin in pins}
    if "torch" in names:
        raise SetupError(f"installing {spec} would change torch: {pins}")
    version = next(pin.split("==")[1] for pin in pins if pin.lower().startswith("transformers=="))
    target = cache / f"transformers-{version}"
    install_target(target, pins, refresh=True)
    for stale in existing:
        if stale != target:
            shutil.rmtree(stale, ignore_errors=True)
    return target


def site_dirs() -> list[Path]:
    dirs = [Path(p) for p in site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(Path(site.getusersitepackages()))
    for key in ("purelib", "platlib"):
        dirs.append(Path(sysconfig.get_paths()[key]))
    unique: list[Path] = []
    for path in dirs:
        if path.is_dir() and path.resolve() not in [u.resolve() for u in unique]:
            unique.append(path)
    return unique


def make_no_bnb_python(cache: Path) -> Path:
    """A fresh venv mirroring this interpreter's site-packages by symlinks, minus bitsandbytes.

    Only ever writes inside ``<cache>/no-bnb-venv``: the site-packages folder is asked of the
    venv's own interpreter *with* ``site`` (``python -S`` would answer the base interpreter's) and
    refused unless it lies inside the venv, and only symlinks are ever removed from it.
    """
    root = (cache / "no-bnb-venv").resolve()
    bindir = "Scripts" if os.name == "nt" else "bin"
    python = root / bindir / ("python.exe" if os.name == "nt" else "python")
    if not python.exists():
        log(f"creating {root}")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    asked = subprocess.run(
        [
            str(python),
            "-I",
            "-c",
            "import sys, sysconfig; print(sys.prefix); print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    prefix, target = Path(asked[0].strip()).resolve(), Path(asked[1].strip()).resolve()
    if prefix != root or root not in target.parents:
        raise SetupError(f"the venv at {root} reports prefix {prefix} and site-packages {target}; refusing")
    target.mkdir(parents=True, exist_ok=True)
    for entry in target.iterdir():  # rebuild every run: mirror the environment as it is now
        if not entry.is_symlink():
            raise SetupError(f"{entry} is not one of our symlinks; remove {root} by hand")
        entry.unlink()
    linked: set[str] = set()
    for directory in site_dirs():
        if directory.resolve() == target:
            continue
        for entry in sorted(directory.iterdir()):
            if entry.name.lower().startswith("bitsandbytes") or entry.name in linked:
                continue
            linked.add(entry.name)
            (target / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return python
