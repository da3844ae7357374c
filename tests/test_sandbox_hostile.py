"""Hostile code, one case per test, under each backend.

Each case runs in a real sandbox (bubblewrap, and the process backend) with small
limits, and checks three things: the result names what happened, the sandbox's
host process tree holds nothing the code left, and the next action on the same
pool is unaffected. Where a backend does not contain a threat here
(:func:`tangram_dask.sandbox.containment`), the test asserts that documented
behaviour instead, never passing vacuously.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tangram_dask.sandbox import SandboxPool, bwrap_available, containment, run_code
from tangram_dask.sandbox.options import MiB

LIMITS = dict(timeout_s=1.5, memory_bytes=256 * MiB, output_bytes=1 * MiB, file_bytes=1 * MiB, procs=32)


def _python_for_process() -> str:
    """An interpreter the unprivileged code uid can read, so the process backend can drop root."""
    if os.geteuid() == 0 and os.access("/usr/bin/python3", os.X_OK) and not sys.executable.startswith("/usr/"):
        return "/usr/bin/python3"
    return sys.executable


@pytest.fixture(scope="module", params=["bwrap", "process"])
def pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    backend = request.param
    if backend == "bwrap":
        ok, why = bwrap_available()
        if not ok:
            pytest.skip(f"bubblewrap unusable here: {why}")
    # the code's unprivileged uid must reach the process backend's dirs: not under pytest's 0700 tmp
    root = Path(tempfile.mkdtemp(prefix=f"tangram-test-{backend}-"))
    os.chmod(root, 0o711)
    python = _python_for_process() if backend == "process" else sys.executable
    try:
        with SandboxPool(backend=backend, size=1, root=str(root / "r"), python=python, **LIMITS) as p:
            assert p.wait_ready(30)
            yield p
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                rest = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[-1].split()
            except OSError:
                continue
            kids.setdefault(int(rest[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), ()):
            out.append(k)
            todo.append(k)
    return out


def _tree_sizes(pool: SandboxPool) -> list[int]:
    """How many processes each sandbox holds on the host (bwrap: its init + zygote; process: 0)."""
    return sorted(len(_descendants(box._proc.pid)) for box in pool._boxes if box._proc is not None)


def _held(pool: SandboxPool, threat: str) -> str:
    net = pool.statistics().network == "namespace"
    return containment(pool.backend.name, pool.options, net_isolated=net)[threat].level


def _after(pool: SandboxPool, before: list[int]) -> None:
    """Nothing left behind, and the next action on this pool is unaffected."""
    r = run_code("print('next')", pool=pool)
    assert r.reason == "ok" and r.stdout == "next\n", r
    assert _tree_sizes(pool) == before


@pytest.fixture
def baseline(pool: SandboxPool) -> list[int]:
    run_code("pass", pool=pool)  # the sandbox that serves the case is up
    return _tree_sizes(pool)


def test_infinite_loop(pool, baseline):
    r = run_code("while True:\n    pass\n", pool=pool)
    assert r.reason == "timeout" and "wall time" in r.detail, r
    _after(pool, baseline)


def test_fork_bomb(pool, baseline):
    assert _held(pool, "fork_bomb") == "yes"
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_code(code, pool=pool)
    # RLIMIT_NPROC makes os.fork fail; the wall timeout ends the loop; every process is killed
    assert r.reason == "timeout", r
    _after(pool, baseline)


def test_allocate_ten_times_the_memory_limit(pool, baseline):
    r = run_code(f"x = bytearray({10 * LIMITS['memory_bytes']})", pool=pool)
    assert r.reason == "memory" and "MemoryError" in r.stderr, r
    r = run_code("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))\n", pool=pool)
    assert r.reason == "memory", r
    _after(pool, baseline)


def test_write_a_file_larger_than_the_limit(pool, baseline):
    code = f"with open('big', 'wb') as f:\n    f.write(b'x' * {2 * LIMITS['file_bytes']})\n"
    r = run_code(code, pool=pool)
    assert r.reason == "file_limit", r
    _after(pool, baseline)


def test_print_a_gigabyte(pool, baseline):
    code = "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(block)\n"
    r = run_code(code, pool=pool)
    assert r.reason == "output_limit" and r.stdout_truncated and r.truncated, r
    assert len(r.stdout) == LIMITS["output_bytes"]
    _after(pool, baseline)


def test_read_files_outside_the_sandbox(pool, baseline, tmp_path):
    secret = tmp_path / "worker-secret"
    secret.write_text("s3cret")
    os.chmod(secret, 0o600)
    public = Path(__file__).resolve()  # a world-readable file of the worker's
    code = (
        "import sys\n"
        f"for path in ['/etc/shadow', {str(secret)!r}, {str(public)!r}]:\n"
        "    try:\n        open(path).read(1)\n        print(path, 'READ')\n"
        "    except OSError as e:\n        print(path, type(e).__name__)\n"
    )
    r = run_code(code, pool=pool)
    assert r.reason == "ok", r
    seen = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines())
    held = _held(pool, "read_host_files")
    if held == "yes":  # bwrap: none of them is even there
        assert set(seen.values()) == {"FileNotFoundError"}, seen
    elif held == "partial":  # process, code as an unprivileged uid: permissions hide only private files
        assert seen["/etc/shadow"] == "PermissionError" and seen[str(secret)] == "PermissionError", seen
        assert seen[str(public)] == "READ", "documented: world-readable files are visible to the process backend"
    else:
        pytest.skip(f"{pool.backend.name} runs code as the worker's uid here: it can read the worker's files")
    _after(pool, baseline)


def test_write_outside_the_working_dir(pool, baseline, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.chmod(outside, 0o755)
    shared = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
    marker = shared / f"tangram-sandbox-escape-{os.getpid()}-{pool.backend.name}"
    code = (
        f"for path in [{str(outside / 'x')!r}, '/usr/x', {str(marker)!r}]:\n"
        "    try:\n        open(path, 'w').write('x')\n        print(path, 'WROTE')\n"
        "    except OSError as e:\n        print(path, type(e).__name__)\n"
        "open('inside', 'w').write('fine')\n"
    )
    try:
        r = run_code(code, pool=pool)
        assert r.reason == "ok", r
        seen = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines())
        assert not (outside / "x").exists() and not Path("/usr/x").exists()
        assert seen["/usr/x"] != "WROTE" and seen[str(outside / "x")] != "WROTE", seen
        held = _held(pool, "write_outside")
        if held == "yes":  # bwrap: /dev/shm and /tmp are the sandbox's own
            assert not marker.exists()
        elif held == "partial":
            assert seen[str(marker)] == "WROTE" and marker.exists(), \
                "documented: the process backend cannot keep code out of world-writable dirs"
        else:
            pytest.skip(f"{pool.backend.name} runs code as the worker's uid here: it can write the worker's files")
    finally:
        marker.unlink(missing_ok=True)
    _after(pool, baseline)


def test_open_a_network_connection(pool, baseline):
    if _held(pool, "network") != "yes":
        pytest.skip(f"{pool.backend.name} has no network namespace here: the code can connect (documented)")
    code = (
        "import socket\n"
        "print(sorted(name for _, name in socket.if_nameindex()))\n"
        "for addr in [('1.1.1.1', 53), ('127.0.0.1', 22)]:\n"
        "    try:\n        socket.create_connection(addr, timeout=1)\n        print('CONNECTED')\n"
        "    except OSError as e:\n        print(type(e).__name__, e.errno)\n"
    )
    r = run_code(code, pool=pool)
    assert r.reason == "ok", r
    lines = r.stdout.splitlines()
    assert lines[0] == "['lo']", lines
    assert "CONNECTED" not in r.stdout
    _after(pool, baseline)


def test_kill_parent_and_other_processes(pool, baseline):
    worker = os.getpid()
    targets = f"[('parent', os.getppid()), ('worker', {worker})]"
    if pool.backend.name == "bwrap":
        # kill(-1) reaches only what the code can see: inside bwrap, its own PID namespace
        targets = targets[:-1] + ", ('everyone', -1)]"
    code = (
        "import os, signal\n"
        f"for name, pid in {targets}:\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n        print(name, 'SENT')\n"
        "    except OSError as e:\n        print(name, type(e).__name__)\n"
    )
    r = run_code(code, pool=pool)
    held = _held(pool, "kill_processes")
    if held == "no":
        pytest.skip(f"{pool.backend.name} runs code as the worker's uid here: it could kill the worker")
    # this process (the worker) is alive; the zygote either refused the signal or was replaced
    assert r.reason in ("ok", "killed"), r
    if r.reason == "ok":
        seen = dict(line.split(" ", 1) for line in r.stdout.splitlines())
        assert seen["parent"] == "PermissionError" and seen["worker"] != "SENT", seen
    run_code("pass", pool=pool)
    _after(pool, _tree_sizes(pool) if r.reason == "killed" else baseline)


def test_leave_a_background_process_behind(pool, baseline):
    code = (
        "import os, subprocess, sys\n"
        "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "if os.fork() == 0:\n"                      # a daemon: double fork, new session
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        import time\n        time.sleep(300)\n"
        "    os._exit(0)\n"
        "print('returned')\n"
    )
    r = run_code(code, pool=pool)
    assert r.reason == "ok" and r.stdout == "returned\n", r
    assert r.leftovers_killed >= 2 and "left behind" in r.detail, r
    _after(pool, baseline)


def test_close_stdout_early(pool, baseline):
    code = "import os, sys\nprint('before', flush=True)\nos.close(1)\nsys.stderr.write('after close')\n"
    r = run_code(code, pool=pool)
    assert r.reason == "ok" and r.stdout == "before\n" and r.stderr == "after close", r
    r = run_code("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)\n", pool=pool)
    assert r.reason == "timeout", r
    _after(pool, baseline)
