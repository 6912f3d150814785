"""The torch-release matrix, one nox session per supported release.

    nox -s tests-2.11                            the whole suite on torch 2.11
    nox -s tests-2.11 -- --version-sensitive     only the tests that touch torch internals which move
                                                 between releases
    nox -s compatibility                         docs/compatibility.md from the sessions' results
    nox -s docs                                  the documentation site, built in strict mode
    nox                                          what CI runs: the whole suite on the newest release,
                                                 the version-sensitive tests on every older one, the
                                                 documentation site, then the compatibility table

The supported releases are ``TESTED`` in ``src/mixprec/_compat.py``; this file reads that table
without importing mixprec, so nox itself never needs torch.
"""

from __future__ import annotations

import ast
import pathlib

import nox

ROOT = pathlib.Path(__file__).parent
RESULTS = ROOT / ".compat"
TABLE, DOCUMENT = ROOT / "tools" / "compat_table.py", ROOT / "docs" / "compatibility.md"
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["ci"]


def _tested() -> dict[str, str]:
    """``TESTED`` from ``_compat.py``: minor release -> the exact release the matrix installs."""
    tree = ast.parse((ROOT / "src" / "mixprec" / "_compat.py").read_text())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "TESTED" and node.value is not None:
            return dict(ast.literal_eval(node.value))
    raise RuntimeError("src/mixprec/_compat.py defines no TESTED table")


TESTED = _tested()
ORDER = sorted(TESTED, key=lambda release: tuple(int(part) for part in release.split(".")))
OLDEST, NEWEST = ORDER[0], ORDER[-1]
# Transformers 5 on the newest release, 4 on the others: both majors are exercised every run.
TRANSFORMERS = {NEWEST: "transformers>=5"}
BUILD_THE_KERNELS = """
from mixprec.engine import _fastpath
if _fastpath.extension() is None and _fastpath.disabled_reason() != "MIXPREC_CPP=0":
    raise SystemExit(f"mixprec's C++ kernels did not build: {_fastpath.disabled_reason()}")
"""
MATRIX_GB = 36  # the disk the matrix's venvs need, with room for pytest's temporary files


def _tests(release: str):
    def tests(session: nox.Session) -> None:
        venv = pathlib.Path(session.virtualenv.location)
        # The machine's pip configuration may cap torch below the release asked for; a constraints
        # file of this venv's own takes that cap's place for this venv only.
        constraint = venv / "constraints.txt"
        constraint.write_text(f"torch=={TESTED[release]}\n")
        env = {"PIP_CONSTRAINT": str(constraint)}
        # pip byte-compiles what it installs, and must: where PYTHONDONTWRITEBYTECODE is set (on our machines it
        # is) nothing else writes the .pyc files, and every process would compile torch from source (installed
        # with --no-compile, CI's version-sensitive runs took 5.5 min instead of 2.5).
        session.install("--upgrade", "pip", env=env)
        session.install(f"torch=={TESTED[release]}", env=env)
        session.install("-e", ".[test]", TRANSFORMERS.get(release, "transformers<5"), env=env)
        # mixprec's C++ kernels, built as part of the install (in CI, the older releases' while the newest one's
        # tests run): built by the first test that needs them, one xdist worker sat waiting on the other's build.
        session.run_install("python", "-c", BUILD_THE_KERNELS)
        RESULTS.mkdir(exist_ok=True)
        run = {"MIXPREC_COMPAT_RESULTS": str(RESULTS / f"{release}.json"), "MIXPREC_EXPECT_TORCH": TESTED[release]}
        # Two workers: the suite is mostly single-threaded Python (7.5 min instead of about 12 on 2 cores); each takes
        # its share of the cores for torch's threads (tests/conftest.py). worksteal: an idle worker takes tests
        # queued for the other (the longest run first: tests/conftest.py).
        session.run("python", "-m", "pytest", "-n", "auto", "--dist", "worksteal", *session.posargs, env=run)

    tests.__doc__ = f"The suite on torch {TESTED[release]} (pass -- --version-sensitive for the compat subset)."
    return tests


for _release in ORDER:
    nox.session(name=f"tests-{_release}")(_tests(_release))


@nox.session(venv_backend="none")
def ci(session: nox.Session) -> None:
    """The whole suite on the newest release, the version-sensitive tests on every older one (CI's time limit),
    then the compatibility table; fails if any release failed. The other releases' venvs install in the background
    while the newest one's tests run (downloads and unpacking against a CPU-bound suite)."""
    import shutil
    import subprocess
    import sys
    import time

    shutil.rmtree(RESULTS, ignore_errors=True)  # this run's results only
    (ROOT / ".nox").mkdir(exist_ok=True)
    # Every release's venv holds a CUDA-bundled torch from PyPI: about 32 GB in all, measured. Say so up front,
    # as the installs' own failure ("No space left on device" in the background log) comes minutes later.
    free = shutil.disk_usage(ROOT / ".nox").free / 2**30
    if free < MATRIX_GB and not all((ROOT / ".nox" / f"tests-{r.replace('.', '-')}").exists() for r in ORDER):
        session.warn(f"{free:.0f} GB free beside .nox/; the release matrix's venvs take about {MATRIX_GB} GB")
    nox_cmd = [sys.executable, "-m", "nox"]
    later = [OLDEST, *ORDER[1:-1]]
    log_path = ROOT / ".nox" / "background-installs.log"
    with log_path.open("w") as log:
        background = subprocess.Popen(
            [*nox_cmd, "--install-only", "-s", *(f"tests-{r}" for r in later), "docs"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
        runs = [(NEWEST, [], [])]
        runs += [(r, ["--reuse-existing-virtualenvs", "--no-install"], ["--version-sensitive"]) for r in ORDER[:-1]]
        failed, took = [], {}
        for release, options, pytest_args in runs:
            if options and background.poll() is None:
                session.log("waiting for the background installs")
                background.wait()
            if options and background.returncode != 0:
                session.error(f"installing the other releases failed: see {log_path}")
            start = time.monotonic()
            done = subprocess.run(
                [*nox_cmd, *options, "-s", f"tests-{release}", "--", *pytest_args, *session.posargs], cwd=ROOT
            )
            took[release] = time.monotonic() - start
            if done.returncode != 0:
                failed.append(f"torch {release}")
    if subprocess.run([*nox_cmd, "--reuse-existing-virtualenvs", "--no-install", "-s", "docs"], cwd=ROOT).returncode:
        failed.append("the documentation build")
    session.run("python3", str(TABLE), str(RESULTS), str(DOCUMENT), success_codes=[0, 1])
    session.log("minutes per release: " + ", ".join(f"{r} {t / 60:.1f}" for r, t in took.items()))
    if failed:
        session.error(f"failed: {', '.join(failed)}")


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml) in strict mode: a broken link, anchor or API reference fails.
    mkdocstrings reads the docstrings from src/ without importing mixprec, so this venv needs no torch."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    session.install(*extras["docs"])  # pyproject's docs extra, without mixprec itself (and so without torch)
    site = str(ROOT / ".nox" / "site")
    session.run("mkdocs", "build", "--strict", "--site-dir", site, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(venv_backend="none")
def compatibility(session: nox.Session) -> None:
    """docs/compatibility.md from the results the test sessions left in .compat/."""
    session.run("python3", str(TABLE), str(RESULTS), str(DOCUMENT))
