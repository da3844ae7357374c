"""The warm pool and the run API, outside Dask, with real sandboxes."""

from __future__ import annotations

import os
import shutil
import sys
import threading

import pytest
from conftest import bwrap_or_skip

from tangram_dask import SandboxError
from tangram_dask.sandbox import (
    REASONS,
    THREATS,
    Limits,
    PoolOptions,
    RunResult,
    SandboxPool,
    containment,
    run_code,
    run_command,
)
from tangram_dask.sandbox.options import MiB


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(backend=bwrap_or_skip(), size=2, max_uses=5, timeout_s=5, memory_bytes=512 * MiB) as p:
        assert p.wait_ready(30)
        yield p


# -- options: bad values fail at once, naming the option ----------------------------------

@pytest.mark.parametrize("kwargs, names", [
    ({"backend": "docker"}, "backend"),
    ({"size": 0}, "size"),
    ({"max_starting": -1}, "max_starting"),
    ({"max_uses": 1.5}, "max_uses"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"memory_bytes": 1000}, "memory_bytes"),
    ({"output_bytes": True}, "output_bytes"),
    ({"uid": "root"}, "uid"),
    ({"ro_binds": ("relative/path",)}, "ro_binds"),
    ({"trajectory_ttl_s": float("inf")}, "trajectory_ttl_s"),
    ({"colour": "red"}, "colour"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_bad_options_are_rejected_naming_them(kwargs, names):
    with pytest.raises(SandboxError, match=names):
        PoolOptions.from_kwargs(**kwargs)


def test_limits_merge_and_reject_unknown_fields():
    lim = Limits().merged(timeout_s=2, memory_bytes=None)
    assert lim.timeout_s == 2 and lim.memory_bytes == Limits().memory_bytes
    with pytest.raises(SandboxError, match="walltime"):
        Limits().merged(walltime=3)


def test_containment_table_covers_every_threat_for_both_backends():
    for backend in ("bwrap", "process"):
        table = containment(backend)
        assert tuple(table) == THREATS
        assert all(c.level in ("yes", "partial", "no") and c.why for c in table.values())
    assert all(c.contained for c in containment("bwrap").values())


# -- running --------------------------------------------------------------------------------

def test_run_code_returns_output_times_and_reason(pool):
    r = run_code("import sys\nprint(input().upper())\nsys.stderr.write('warn')\n", stdin="hello\n", pool=pool)
    assert isinstance(r, RunResult)
    assert (r.reason, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "HELLO\n", "warn")
    assert r.wall_s > 0 and r.cpu_s >= 0 and r.backend == "bwrap" and not r.truncated
    assert r.reason in REASONS


@pytest.mark.parametrize("code, reason, exit_code", [
    ("raise ValueError('bad')", "error", 1),
    ("import sys; sys.exit(3)", "error", 3),
    ("import sys; sys.exit(0)", "ok", 0),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", "killed", None),
    ("def f(:\n", "error", 1),
], ids=["exception", "exit-3", "exit-0", "sigterm", "syntax-error"])
def test_how_code_ends_is_named(pool, code, reason, exit_code):
    r = run_code(code, pool=pool)
    assert (r.reason, r.exit_code) == (reason, exit_code), r


def test_run_command_with_files_in_the_working_dir(pool):
    files = {"pkg/mod.py": "def double(x):\n    return 2 * x\n",
             "test_mod.py": "from pkg.mod import double\n\ndef test_double():\n    assert double(2) == 4\n"}
    r = run_command(["python", "-c", "import os, pkg.mod; print(pkg.mod.double(21), sorted(os.listdir('.')))"],
                    files=files, pool=pool)
    assert r.reason == "ok" and r.stdout.startswith("42 ['pkg', 'test_mod.py']"), r
    r = run_command(["no-such-program"], pool=pool)
    assert r.reason == "error" and r.exit_code == 127 and "no-such-program" in r.detail
    with pytest.raises(SandboxError, match="relative path"):
        run_code("pass", files={"../escape.py": "x"}, pool=pool)
    with pytest.raises(SandboxError, match="list of arguments"):
        run_command("pytest -x", pool=pool)  # type: ignore[arg-type]


def test_pytest_runs_inside_the_sandbox(pool):
    files = {"test_a.py": "def test_ok():\n    assert 1 + 1 == 2\n\ndef test_bad():\n    assert 1 + 1 == 3\n"}
    r = run_command(["python", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"], files=files, pool=pool,
                    timeout=30)
    assert r.reason == "error" and r.exit_code == 1 and "1 failed" in r.stdout, (r, r.stdout, r.stderr)


def test_working_dir_is_wiped_between_actions(pool):
    # an interpreter that lives under /tmp (a checkout there) is bound in read-only: its mount point stays
    mounts = sorted({p.split("/")[2] for p in (sys.prefix, sys.base_prefix) if p.startswith("/tmp/")})
    for _ in range(4):  # more actions than sandboxes: each sandbox is reused
        r = run_code("import os\nprint(os.listdir('.'), sorted(os.listdir('/tmp')))\n"
                     "open('left.txt', 'w').write('x'); open('/tmp/t', 'w').write('x')", pool=pool)
        assert r.stdout == f"[] {mounts}\n", r.stdout


def test_units_become_cpus_by_affinity(pool):
    n = len(os.sched_getaffinity(0))
    r = run_code("import os\nprint(len(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])", units=n, pool=pool)
    assert r.cpu_mechanism == "affinity" and len(r.cpus) == n and r.stdout == f"{n} {n}\n", r
    r = run_code("import os\nprint(sorted(os.sched_getaffinity(0)))", units=1, pool=pool)
    assert r.stdout == f"{list(r.cpus)}\n" and len(r.cpus) == 1


def test_recycled_after_max_uses_and_on_damage(pool):
    before = pool.statistics()
    for _ in range(12):
        run_code("pass", pool=pool)
    mid = pool.statistics()
    assert mid.recycled > before.recycled  # max_uses=5 with 2 sandboxes: some were replaced
    run_code("while True: pass", timeout=0.5, pool=pool)  # a timeout counts as damage
    after = pool.statistics()
    assert after.recycled == mid.recycled + 1
    assert pool.wait_ready(30) and pool.statistics().ready == 2


def test_concurrent_actions_get_distinct_sandboxes(pool):
    """As many actions at once as the pool has sandboxes (2): each holds a sandbox of its own."""
    barrier = threading.Barrier(2, timeout=30)
    boxes: list = []
    results: list[RunResult] = []
    lock = threading.Lock()

    def one() -> None:
        with pool.acquire(timeout=30) as lease:
            barrier.wait()  # both leases are held at once
            r = lease.run(code="import time\ntime.sleep(0.2)\nprint('ok')")
            with lock:
                boxes.append(lease.sandbox)
                results.append(r)
            barrier.wait()

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.reason for r in results] == ["ok"] * 2, results
    assert boxes[0] is not boxes[1]


def test_lease_released_twice_is_safe_and_unusable_after(pool):
    assert pool.wait_ready(30)
    before = pool.statistics()
    lease = pool.acquire()
    assert lease.run(code="print(1)").stdout == "1\n"
    lease.release()
    lease.release()
    after = pool.statistics()
    assert after.in_use == before.in_use and after.ready + after.starting <= after.size, after  # released once
    with pytest.raises(SandboxError, match="released"):
        lease.run(code="pass")


def test_outside_dask_without_a_pool_the_error_says_what_to_do():
    with pytest.raises(SandboxError, match="pool=SandboxPool"):
        run_code("pass")


def test_closed_pool_refuses_with_a_reason():
    p = SandboxPool(backend=bwrap_or_skip(), size=1).start()
    assert p.wait_ready(30)
    p.close()
    p.close()
    with pytest.raises(SandboxError, match="closed"):
        p.acquire()


def test_a_backend_that_cannot_start_fails_acquire_with_the_cause(tmp_path):
    with SandboxPool(backend=bwrap_or_skip(), size=1, python=str(tmp_path / "no-python")) as p:
        with pytest.raises(SandboxError, match="could not start a sandbox.*no-python"):
            p.acquire(timeout=20)


@pytest.mark.skipif(os.geteuid() != 0, reason="what a root worker refuses")
def test_a_root_worker_never_runs_code_as_root_or_as_a_uid_that_cannot_read_python(tmp_path):
    with pytest.raises(SandboxError, match="uid' = None.*never runs as root"):
        SandboxPool(backend="process", size=1, uid=None).start()
    private = tmp_path / "private"  # pytest's tmp dirs are 0700: uid 65534 cannot pass
    private.mkdir()
    os.chmod(private, 0o700)
    python = private / "python3"  # where it lives is what counts: never started
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    with pytest.raises(SandboxError, match="cannot read the interpreter.*backend='bwrap'"):
        SandboxPool(backend="process", size=1, python=str(python)).start()


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_sandboxes_die_with_their_worker(backend, tmp_path):
    """SIGKILL the process that owns a pool: its sandboxes, and code running in them, go too. The running
    action is found on the host by a token in its command line. Until session 31 the zygote that ran it,
    and the action, outlived the worker: the scratch mount's setfsuid had cleared their parent-death signal."""
    import signal
    import subprocess
    import sys
    import time

    if backend == "bwrap":
        bwrap_or_skip()
    python = "/usr/bin/python3" if backend == "process" and os.geteuid() == 0 else sys.executable
    token = os.urandom(6).hex()
    script = (
        "import sys, threading\n"
        "from tangram_dask.sandbox import SandboxPool, run_command\n"
        f"pool = SandboxPool(backend={backend!r}, size=2, python={python!r}).start()\n"
        "assert pool.wait_ready(30)\n"
        "print(' '.join(str(b._proc.pid) for b in pool._boxes), flush=True)\n"
        "argv = [pool.options.python, '-c', 'import time; time.sleep(60)', 'die-with-worker-' + sys.argv[1]]\n"
        "threading.Thread(target=run_command, args=(argv,),\n"
        "                 kwargs={'timeout': 60, 'pool': pool}, daemon=True).start()\n"
        "time = __import__('time'); time.sleep(60)\n"
    )

    def actions() -> list[int]:
        found = []
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if name.isdigit() and f"die-with-worker-{token}".encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
        return found

    worker = subprocess.Popen([sys.executable, "-c", script, token], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in worker.stdout.readline().split()]
        assert len(pids) == 2
        deadline = time.monotonic() + 30
        while not actions():  # the sleeping action is running
            assert time.monotonic() < deadline, "the action never started"
            time.sleep(0.05)
        pids += actions()
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.05)
        assert not any(os.path.exists(f"/proc/{p}") for p in pids), [p for p in pids if os.path.exists(f"/proc/{p}")]
    finally:
        worker.kill()
        for p in actions():  # what a failure left
            os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_close_lets_every_sandbox_exit_by_itself(backend):
    """close() says goodbye to each sandbox and it exits 0, its own clean-up done. Stopping the
    starter threads first killed every one of them (SIGKILL, by PR_SET_PDEATHSIG) before the
    goodbye, which then met a closed pipe: a runner with SIGPIPE at its default died of it."""
    if backend == "bwrap":
        bwrap_or_skip()
    python = "/usr/bin/python3" if backend == "process" and os.geteuid() == 0 else sys.executable
    pool = SandboxPool(backend=backend, size=3, python=python).start()
    assert pool.wait_ready(30)
    procs = [b._proc for b in pool._boxes]
    assert len(procs) == 3
    pool.close()
    assert [p.returncode for p in procs] == [0, 0, 0]


def test_close_kills_the_sandboxes_that_do_not_answer_its_goodbye():
    """Two of three zygotes are stopped (SIGSTOP: they cannot read the goodbye). close() gives all of
    them one shared grace, kills those two (SIGKILL) and lets the third exit by itself. (The grace is
    shared, not one each: benchmarked, not timed here.)"""
    import signal

    python = "/usr/bin/python3" if os.geteuid() == 0 else sys.executable
    pool = SandboxPool(backend="process", size=3, python=python).start()
    assert pool.wait_ready(30)
    procs = sorted((b._proc for b in pool._boxes), key=lambda p: p.pid)
    for p in procs[:2]:
        os.killpg(p.pid, signal.SIGSTOP)
    pool.close()
    assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGKILL, 0]


@pytest.mark.parametrize("change", [
    "open('/tmp/left', 'w').write('x')",
    "import os; os.chmod('/tmp', 0o700)",
    "import os; os.setxattr('/dev/shm', 'user.note', b'left')",
    "import os; os.mkdir('d'); os.chmod('.', 0o500)",
], ids=["file", "chmod", "xattr", "workdir"])
def test_an_action_that_changes_its_writable_places_leaves_nothing_to_the_next(pool, change):
    """A tmpfs an action left as it got it is passed on (no remount); any change drops it."""
    look = ("import os\n"
            "print([(d, oct(os.stat(d).st_mode & 0o7777), sorted(os.listdir(d)), os.listxattr(d))"
            " for d in ('/tmp', '/dev/shm', '.')])\n")
    fresh = run_code(look, pool=pool)
    assert fresh.ok, fresh
    for _ in range(2):  # both sandboxes of the pool
        assert run_code(change, pool=pool).ok
    for _ in range(4):
        r = run_code(look, pool=pool)
        assert r.stdout == fresh.stdout, (change, r.stdout, fresh.stdout)


def test_a_pool_removes_the_roots_of_pools_whose_worker_died_and_no_other():
    """A pool that makes its own root holds an owner lock in it (``flock``, as distributed's ``WorkSpace`` does
    for worker directories) and, on start, removes the roots of pools whose lock is free: their worker was killed
    before ``close()`` (the tests that kill workers left about four a run in /tmp). A root whose lock a live pool
    holds, one with no lock file, and one whose lock is younger than ``STALE_AFTER_S`` are left."""
    import fcntl
    import tempfile
    import time
    from pathlib import Path

    from tangram_dask.sandbox.pool import OWNER_LOCK, STALE_AFTER_S

    def root(lock: bool, age_s: float) -> Path:
        d = Path(tempfile.mkdtemp(prefix=SandboxPool.root_prefix + "test-", dir="/tmp"))
        (d / "boxes" / "b1").mkdir(parents=True)
        if lock:
            f = d / OWNER_LOCK
            f.touch()
            t = time.time() - age_s
            os.utime(f, (t, t))
        return d

    dead, alive, unlocked, young = (root(True, 3600), root(True, 3600), root(False, 3600),
                                    root(True, STALE_AFTER_S / 2))
    held = os.open(alive / OWNER_LOCK, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # a live pool's lock (another open file: flock conflicts across them)
    try:
        with SandboxPool(backend="process", size=1) as p:
            mine = p.root
            assert (mine / OWNER_LOCK).is_file()
            assert not dead.exists()
            assert alive.exists() and unlocked.exists() and young.exists()
            assert mine.exists()
        assert not mine.exists()
    finally:
        os.close(held)
        for d in (dead, alive, unlocked, young):
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("parent_alive", [True, False], ids=["parent-alive", "parent-gone"])
def test_an_action_child_whose_zygote_died_before_it_was_confined_exits_at_once(parent_alive):
    """The zygote forks each action's child, which sets its parent-death signal first thing. A zygote that died
    between the fork and that line sent no signal, and the child, re-parented, would run on: it checks that its
    parent is still the zygote and exits if not (before session 32 it ran the action, unconfined by any death
    signal). The child here is a real fork of this process; "gone" is a zygote pid that is not its parent."""
    from tangram_dask.sandbox import _zygote

    fds = [os.pipe() for _ in range(4)]  # in, out, err, status
    me = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: _child exits the process one way or another
        try:
            _zygote._child({"cwd": "/nonexistent"}, (fds[0][0], fds[1][1], fds[2][1], fds[3][1]),
                           me if parent_alive else me + 10**6)
        finally:
            os._exit(99)
    for r, w in fds:
        os.close(w)
    _, status = os.waitpid(pid, 0)
    said = os.read(fds[3][0], 4096)
    for r, _ in fds:
        os.close(r)
    if parent_alive:  # it went on to confine itself and wrote its first status line (then failed on the cwd)
        assert said.startswith(b"cpu=")
    else:
        assert os.waitstatus_to_exitcode(status) == 1 and said == b""
