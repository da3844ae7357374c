"""Hostile code: every case of :mod:`tangram_dask.sandbox.hostile`, under each backend, as a root
worker and as an unprivileged one, each asserting what docs/sandbox.md promises for that configuration.

One subprocess per configuration plays the worker: it holds a secret in its command line and
environment, starts a real pool and runs all the cases against it (a real sandboxed process
each), then prints what it saw. As root the tests also run it under a test user made for the
purpose (``tangram-sbx-test``, created here with ``useradd`` when missing), with
``/usr/bin/python3`` and a copy of the package in a directory that user can read: so this works
from a checkout under a 0700 directory too. Every case's verdict (yes / partial / no) must equal
:func:`tangram_dask.sandbox.containment` for the configuration: a case that is documented as not
contained asserts that documented behaviour, never passing vacuously.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tangram_dask.sandbox import THREATS, bwrap_available, containment
from tangram_dask.sandbox.hostile import CASES, judge

ROOT = os.geteuid() == 0
TEST_USER = "tangram-sbx-test"
CONFIGS = [("bwrap", "root"), ("process", "root"), ("bwrap", "unprivileged"), ("process", "unprivileged")]


def _test_user() -> tuple[int, int]:
    """The unprivileged test user's uid and gid, made if missing (root only)."""
    try:
        pw = pwd.getpwnam(TEST_USER)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            pytest.skip("no useradd here to make the unprivileged test user")
        subprocess.run([useradd, "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin",
                        TEST_USER], check=True, capture_output=True)
        pw = pwd.getpwnam(TEST_USER)
    return pw.pw_uid, pw.pw_gid


def _staged_package(tmp: Path) -> Path:
    """A copy of the package that any user can read (the checkout may sit under a 0700 dir)."""
    src = Path(__file__).resolve().parents[1] / "tangram_dask"
    dst = tmp / "src" / "tangram_dask"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for d in [tmp, tmp / "src", *[p for p in dst.rglob("*") if p.is_dir()], dst]:
        os.chmod(d, 0o755)
    for f in dst.rglob("*"):
        if f.is_file():
            os.chmod(f, 0o644)
    return tmp / "src"


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{b}-{w}" for b, w in CONFIGS])
def matrix(request: pytest.FixtureRequest) -> dict:
    backend, worker = request.param
    if backend == "bwrap":
        ok, why = bwrap_available()
        if not ok:
            pytest.skip(f"bubblewrap unusable here: {why}")
    if worker == "root" and not ROOT:
        pytest.skip("the root-worker configuration needs the tests to run as root")
    secret = "hostile-secret-" + os.urandom(6).hex()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TANGRAM_HOSTILE_SECRET": secret}
    tmp = Path(tempfile.mkdtemp(prefix="tangram-hostile-stage-"))
    try:
        kwargs: dict = {}
        if worker == "unprivileged" and ROOT:
            uid, gid = _test_user()
            python = "/usr/bin/python3"
            if not os.access(python, os.X_OK):
                pytest.skip("no /usr/bin/python3 for the unprivileged test user")
            env["PYTHONPATH"] = str(_staged_package(tmp))
            env["HOME"] = str(tmp)
            kwargs = dict(user=uid, group=gid, extra_groups=[])
        else:
            # root: the process backend runs code as uid 65534, which must read the interpreter
            python = "/usr/bin/python3" if ROOT and backend == "process" else sys.executable
            env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
            if python != sys.executable:
                env["PYTHONPATH"] = str(_staged_package(tmp))
        cmd = [python, "-m", "tangram_dask.sandbox.hostile", "--backend", backend, "--python", python,
               "--secret", secret, "--json"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=300, **kwargs)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout)
        out["worker"] = worker
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_every_case_is_in_the_table():
    assert tuple(CASES) == THREATS and len(THREATS) >= 20
    for root in (True, False):
        for backend in ("bwrap", "process"):
            table = containment(backend, root=root, isolated=True)
            assert tuple(table) == THREATS and all(c.why for c in table.values())


@pytest.mark.parametrize("case", THREATS)
def test_hostile_case(matrix: dict, case: str):
    got = matrix["cases"][case]
    promised = containment(matrix["backend"], root=matrix["worker"] == "root", isolated=matrix["isolated"])[case]
    assert got["obs"].get("next_ok"), f"the next action failed after {case}: {got['obs']}"
    assert got["obs"].get("leftover_procs") == 0, f"processes left after {case}: {got['obs']}"
    assert got["verdict"] == promised.level, (f"{matrix['backend']}/{matrix['worker']}: {case} observed "
                                              f"{got['verdict']}, documented {promised.level} ({promised.why}); "
                                              f"{got['obs']}")


def test_the_judge_can_say_no():
    """The verdicts are not constant: the same judge calls what got out 'no'."""
    leak = {"reason": "ok", "found": "12/environ", "worker_visible": "True", "next_ok": True, "leftover_procs": 0}
    assert judge("proc_worker", leak, root=True) == "no"
    assert judge("persist_writable", {"seen": {"None": {"/tmp/x": "True"}, "persist-a": {"x": "True"}},
                                      "next_ok": True, "leftover_procs": 0}, root=True) == "no"
    assert judge("privileges", {"reason": "ok", "uid": "0", "CapInh": "0" * 16, "CapPrm": "0" * 16,
                                "CapEff": "0" * 16, "CapAmb": "0" * 16, "NoNewPrivs": "1"}, root=True) == "no"
    assert judge("fork_bomb", {"forked": 300, "next_ok": True, "leftover_procs": 0}, root=True) == "no"
    assert judge("infinite_loop", {"reason": "timeout", "next_ok": True, "leftover_procs": 3}, root=True) == "no"
