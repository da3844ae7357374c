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
from tangram_dask.sandbox.backends import gpu_device_nodes
from tangram_dask.sandbox.hostile import CASES, judge

ROOT = os.geteuid() == 0
TEST_USER = "tangram-sbx-test"
CONFIGS = [("bwrap", "root"), ("process", "root"), ("bwrap", "unprivileged"), ("process", "unprivileged"),
           ("process", "no-namespaces")]
# An unprivileged worker where the kernel refuses user namespaces: made real (no fake) by running it
# under bubblewrap's --disable-userns, which forbids new user namespaces to everything inside.
NO_USERNS = ["--dev-bind", "/", "/", "--unshare-user", "--disable-userns", "--"]


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


def _launch(backend: str, worker: str, tmp: Path) -> subprocess.Popen | str:
    """Start the worker subprocess of one configuration; a string says why it cannot run here."""
    if backend == "bwrap" or worker == "no-namespaces":
        ok, why = bwrap_available()
        if not ok:
            return f"bubblewrap unusable here: {why}"
    if worker == "root" and not ROOT:
        return "the root-worker configuration needs the tests to run as root"
    secret = "hostile-secret-" + os.urandom(6).hex()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TANGRAM_HOSTILE_SECRET": secret}
    kwargs: dict = {}
    if worker != "root" and ROOT:
        try:
            uid, gid = _test_user()
        except pytest.skip.Exception as e:  # only this configuration skips
            return str(e)
        python = "/usr/bin/python3"
        if not os.access(python, os.X_OK):
            return "no /usr/bin/python3 for the unprivileged test user"
        env["PYTHONPATH"] = str(_staged_package(tmp))
        env["HOME"] = str(tmp)
        kwargs = dict(user=uid, group=gid, extra_groups=[])
    else:
        # root: the process backend runs code as uid 65534, which must read the interpreter
        python = "/usr/bin/python3" if ROOT and backend == "process" else sys.executable
        if not os.access(python, os.X_OK):
            return f"no {python}: a root worker's process backend needs an interpreter uid 65534 can read"
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        if python != sys.executable:
            env["PYTHONPATH"] = str(_staged_package(tmp))
    cmd = [python, "-m", "tangram_dask.sandbox.hostile", "--backend", backend, "--python", python,
           "--secret", secret, "--json"]
    if worker == "no-namespaces":
        cmd = [shutil.which("bwrap") or "bwrap", *NO_USERNS, *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp,
                            **kwargs)


#: A stand-in GPU device node (a 0666 file in /dev, as the NVIDIA driver makes its nodes): this machine has no
#: GPU, and ``gpu_devices`` must be able to fail. Made by root where no real GPU node exists, removed after.
STAND_IN = Path("/dev/nvidia-tangram-stand-in")


def _make_stand_in() -> bool:
    if not ROOT or gpu_device_nodes():
        return False
    try:
        STAND_IN.write_text("a stand-in for a GPU device node (tests/test_sandbox_hostile.py)\n")
        os.chmod(STAND_IN, 0o666)
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def runs():
    """All configurations at once, one worker subprocess each (most of their time is timeouts)."""
    tmp = Path(tempfile.mkdtemp(prefix="tangram-hostile-stage-"))
    started = {}
    made = _make_stand_in()
    try:
        for backend, worker in CONFIGS:
            d = tmp / f"{backend}-{worker}"
            d.mkdir()
            os.chmod(tmp, 0o755)
            os.chmod(d, 0o755)
            started[backend, worker] = _launch(backend, worker, d)
        yield started
    finally:
        for p in started.values():
            if isinstance(p, subprocess.Popen) and p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if made:
            STAND_IN.unlink(missing_ok=True)


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{b}-{w}" for b, w in CONFIGS])
def matrix(request: pytest.FixtureRequest, runs: dict) -> dict:
    backend, worker = request.param
    p = runs[backend, worker]
    if isinstance(p, str):
        pytest.skip(p)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    result = json.loads(out)
    result["worker"] = worker
    if ROOT:  # root made the stand-in (or the host has real GPU nodes): gpu_devices had something to reach
        assert result["cases"]["gpu_devices"]["obs"]["host"], "no GPU device node to reach"
    return result


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
    if matrix["worker"] == "no-namespaces":
        assert not matrix["isolated"]
    elif not (matrix["backend"] == "process" and matrix["worker"] == "unprivileged"):
        assert matrix["isolated"]  # root workers and bwrap always have their namespaces
    # (an unprivileged process backend is isolated where the kernel allows user namespaces; where it does
    # not, it must show what the table says for "no user ns")
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
    assert judge("gpu_devices", {"reason": "ok", "reached": "/dev/nvidia0", "host": ["/dev/nvidia0"],
                                 "next_ok": True, "leftover_procs": 0}, root=True) == "no"


def test_strict_refuses_a_process_backend_without_namespaces(tmp_path):
    """Where the kernel refuses user namespaces, the process backend says so at start, and strict=True
    refuses to run (real refusal: under bubblewrap's --disable-userns, as the unprivileged test user)."""
    if not bwrap_available()[0]:
        pytest.skip("bubblewrap unusable here")
    stage = Path(tempfile.mkdtemp(prefix="tangram-strict-"))
    try:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(_staged_package(stage)), "HOME": str(stage)}
        kwargs: dict = {}
        if ROOT:
            uid, gid = _test_user()
            kwargs = dict(user=uid, group=gid, extra_groups=[])
        script = ("from tangram_dask import SandboxError\n"
                  "from tangram_dask.sandbox import SandboxPool\n"
                  "from tangram_dask.sandbox.backends import namespace_probe\n"
                  "print('probe', namespace_probe())\n"
                  "try:\n    SandboxPool(backend='process', size=1, strict=True).start()\n    print('STARTED')\n"
                  "except SandboxError as e:\n    print('refused', e)\n")
        p = subprocess.run([shutil.which("bwrap") or "bwrap", *NO_USERNS, "/usr/bin/python3", "-c", script],
                           capture_output=True, text=True, env=env, cwd=stage, timeout=60, **kwargs)
        assert p.returncode == 0, p.stderr
        assert "probe (False" in p.stdout and "refused sandbox option strict=True" in p.stdout, p.stdout
        assert "/dev/shm" in p.stdout and "user namespaces" in p.stdout
    finally:
        shutil.rmtree(stage, ignore_errors=True)
