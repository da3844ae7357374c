"""Hostile programs against a sandbox pool, and what each one got: the containment matrix.

    python -m tangram_dask.sandbox.hostile --backend bwrap [--python PY] [--json]

Each case in :data:`CASES` runs real hostile code in a real pool and returns what
it observed; :func:`judge` turns that into ``yes`` (contained), ``partial`` or
``no``. ``tests/test_sandbox_hostile.py`` runs this module as a root worker and as
an unprivileged one (a subprocess under a test user), under both backends, and
asserts that every case's verdict is what :func:`~tangram_dask.sandbox.containment`
(and docs/sandbox.md) promises for that configuration.

The run as a whole is the *worker*: this process. It holds a secret in its command
line and its environment (``--secret``), a 0600 file and a world-readable one, so
the cases can look for them from inside. Stdlib only (besides the sandbox package),
so it runs under any interpreter the test user can read.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import SandboxError
from .backends import THREATS, gpu_device_nodes
from .options import MiB
from .pool import SandboxPool

#: Small limits, so the matrix is quick: every limit is reached in well under a second.
LIMITS = dict(timeout_s=1.0, memory_bytes=256 * MiB, output_bytes=64 * 1024, file_bytes=1 * MiB, procs=32,
              open_files=64, work_bytes=16 * MiB, work_files=2000)

Obs = dict[str, Any]


class Context:
    """What the worker holds that the code must not reach, and the pool under attack."""

    def __init__(self, pool: SandboxPool, secret: str, base: Path):
        self.pool = pool
        self.secret = secret
        self.worker_pid = os.getpid()
        self.base = base
        self.secret_file = base / "private" / "secret"          # 0600, in a 0700 dir of the worker's
        self.public_file = base / "public" / "readme"           # 0644, in a 0755 dir
        self.outside = base / "public" / "writable"             # the worker's own dir, 0755
        for d, mode in ((self.secret_file.parent, 0o700), (self.public_file.parent, 0o755), (self.outside, 0o755)):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, mode)
        self.secret_file.write_text(secret)
        os.chmod(self.secret_file, 0o600)
        self.public_file.write_text("public " + secret)
        os.chmod(self.public_file, 0o644)

    def run(self, code: str, trajectory: str | None = None, **limits: Any) -> Any:
        lim = self.pool.options.limits.merged(**limits)
        with self.pool.acquire(1, trajectory) as lease:
            return lease.run(code=code, limits=lim)


def _res(r: Any) -> Obs:
    return {"reason": r.reason, "exit_code": r.exit_code, "stdout": r.stdout[-2000:], "stderr": r.stderr[-600:],
            "detail": r.detail, "leftovers": r.leftovers_killed, "stdout_len": len(r.stdout)}


def _lines(r: Any) -> dict[str, str]:
    return dict(line.rsplit(" ", 1) for line in r.stdout.splitlines() if " " in line)


_PROBE = (
    "import os\n"
    "def probe(path, mode='r'):\n"
    "    try:\n"
    "        with open(path, mode) as f:\n"
    "            f.read(64) if mode == 'r' else f.write('x')\n"
    "        return 'OK'\n"
    "    except OSError as e:\n"
    "        return type(e).__name__\n"
)

# -- the cases: each returns observations --------------------------------------------------


def c_infinite_loop(cx: Context) -> Obs:
    return _res(cx.run("while True:\n    pass\n"))


def c_ignore_sigterm(cx: Context) -> Obs:
    code = ("import os, signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "if os.fork() == 0:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    time.sleep(60)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "while True:\n    time.sleep(0.01)\n")
    return _res(cx.run(code))


def _fork_bomb(cx: Context, fork: str) -> Obs:
    code = (f"import os, time, ctypes\nfork = {fork}\nn = 0\n"
            "for _ in range(100000):\n"
            "    try:\n        pid = fork()\n    except OSError:\n        break\n"
            "    if pid < 0:\n        break\n"
            "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
            "    n += 1\n"
            "print('forked', n, flush=True)\n")
    obs = _res(cx.run(code))
    obs["forked"] = int(_lines_of(obs).get("forked", "-1"))
    return obs


def _lines_of(obs: Obs) -> dict[str, str]:
    return dict(line.rsplit(" ", 1) for line in obs["stdout"].splitlines() if " " in line)


def c_fork_bomb(cx: Context) -> Obs:
    return _fork_bomb(cx, "os.fork")


def c_fork_bomb_libc(cx: Context) -> Obs:
    return _fork_bomb(cx, "ctypes.CDLL(None, use_errno=True).fork")


def c_memory(cx: Context) -> Obs:
    return _res(cx.run(f"x = bytearray({10 * LIMITS['memory_bytes']})"))


def c_file_size(cx: Context) -> Obs:
    return _res(cx.run(f"open('big', 'wb').write(b'x' * {2 * LIMITS['file_bytes']})"))


def c_file_flood(cx: Context) -> Obs:
    code = ("import os\nn = 0\n"
            "try:\n"
            "    while True:\n        open(f'f{n}', 'w').close()\n        n += 1\n"
            "finally:\n    print('files', n, flush=True)\n")
    obs = _res(cx.run(code, timeout_s=2.0))
    obs["files"] = int(_lines_of(obs).get("files", "-1"))
    return obs


def c_disk_fill(cx: Context) -> Obs:
    chunk = LIMITS["file_bytes"] // 2  # each file under the per-file limit
    code = ("import os\nn = 0\n"
            "try:\n"
            f"    for d in ('.', '/tmp', '/dev/shm'):\n"
            f"        for i in range(10 ** 6):\n"
            f"            open(f'{{d}}/blob{{i}}', 'wb').write(b'x' * {chunk})\n            n += 1\n"
            "finally:\n    print('bytes', n * %d, flush=True)\n" % chunk)
    obs = _res(cx.run(code, timeout_s=2.0))
    obs["bytes"] = int(_lines_of(obs).get("bytes", "-1"))
    return obs


def c_fd_flood(cx: Context) -> Obs:
    code = ("import os\nfds = []\n"
            "try:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
            "except OSError as e:\n    print('opened', len(fds))\n")
    obs = _res(cx.run(code))
    obs["opened"] = int(_lines_of(obs).get("opened", "-1"))
    return obs


def c_output_flood(cx: Context) -> Obs:
    return _res(cx.run("import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(block)\n"))


def c_binary_output(cx: Context) -> Obs:
    return _res(cx.run("import sys\nsys.stdout.buffer.write(bytes(range(256)) * 64)\n"
                       "sys.stderr.buffer.write(b'\\xff\\xfe\\x00')\n"))


def c_raise_limits(cx: Context) -> Obs:
    code = ("import resource\n"
            "for name in ('RLIMIT_NPROC', 'RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE', 'RLIMIT_CPU'):\n"
            "    which = getattr(resource, name)\n"
            "    soft, hard = resource.getrlimit(which)\n"
            "    try:\n        resource.setrlimit(which, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
            "        print(name, 'RAISED')\n"
            "    except (ValueError, OSError) as e:\n        print(name, type(e).__name__)\n")
    return _res(cx.run(code))


def c_privileges(cx: Context) -> Obs:
    code = ("import os, ctypes\n"
            "st = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\n"
            "for k in ('CapInh', 'CapPrm', 'CapEff', 'CapAmb', 'NoNewPrivs'):\n    print(k, st[k].strip())\n"
            "print('uid', os.getuid())\nprint('euid', os.geteuid())\n"
            "try:\n    os.setuid(0)\n    print('setuid0 OK')\n"
            "except OSError as e:\n    print('setuid0', type(e).__name__)\n")
    obs = _res(cx.run(code))
    obs.update(_lines_of(obs))
    return obs


def c_read_host_files(cx: Context) -> Obs:
    code = _PROBE + (f"for path in ['/etc/shadow', {str(cx.secret_file)!r}, {str(cx.public_file)!r}]:\n"
                     "    print(path, probe(path))\n")
    r = cx.run(code)
    obs = _res(r)
    seen = _lines(r)
    obs["shadow"], obs["secret"], obs["public"] = (seen.get("/etc/shadow"), seen.get(str(cx.secret_file)),
                                                   seen.get(str(cx.public_file)))
    return obs


def c_proc_worker(cx: Context) -> Obs:
    code = (f"import os\nsecret = {cx.secret!r}\nfound = []\n"
            "for pid in os.listdir('/proc'):\n"
            "    if not pid.isdigit():\n        continue\n"
            "    for what in ('cmdline', 'environ'):\n"
            "        try:\n            data = open(f'/proc/{pid}/{what}', 'rb').read()\n"
            "        except OSError:\n            continue\n"
            "        if secret.encode() in data:\n            found.append(f'{pid}/{what}')\n"
            f"w = '/proc/{cx.worker_pid}/cmdline'\n"
            "print('worker_visible', os.path.exists(w) and b'hostile' in open(w, 'rb').read())\n"
            "print('found', ','.join(found) or '-')\n")
    obs = _res(cx.run(code))
    obs.update(_lines_of(obs))
    return obs


def c_env_leak(cx: Context) -> Obs:
    code = (f"import os\nsecret = {cx.secret!r}\n"
            "print('environ', any(secret in v for v in os.environ.values()))\n"
            "try:\n    print('self', secret.encode() in open('/proc/self/environ', 'rb').read())\n"
            "except OSError as e:\n    print('self', type(e).__name__)\n"
            "print('keys', ','.join(sorted(os.environ)))\n")
    obs = _res(cx.run(code))
    obs.update(_lines_of(obs))
    return obs


def c_fd_leak(cx: Context) -> Obs:
    code = ("import os\nopen_fds = []\n"
            "for fd in range(3, 4096):\n"
            "    try:\n        os.fstat(fd)\n        open_fds.append(str(fd))\n    except OSError:\n        pass\n"
            "print('fds', ','.join(open_fds) or '-')\n")
    obs = _res(cx.run(code))
    obs.update(_lines_of(obs))
    return obs


_PLACES = ["/tmp/x", "/dev/shm/x", "x", "/var/tmp/x", "/run/lock/x", "/sandbox/x"]


def c_persist_writable(cx: Context) -> Obs:
    write = _PROBE + f"import os\nfor p in {_PLACES!r} + [os.environ['HOME'] + '/h']:\n    print(p, probe(p, 'w'))\n"
    read = ("import os\n"
            f"for p in {_PLACES!r} + [os.environ['HOME'] + '/h']:\n    print(p, os.path.exists(p))\n"
            "print('tmp_entries', len(os.listdir('/tmp')))\n")
    obs: Obs = {"wrote": _lines(cx.run(write, trajectory="persist-a"))}
    seen = {}
    for traj in (None, "persist-b", "persist-a"):  # another action; another trajectory; the same one
        r = cx.run(read, trajectory=traj)
        seen[str(traj)] = _lines(r)
    obs["seen"] = seen
    for t in ("persist-a", "persist-b"):
        cx.pool.end_trajectory(t)
    for p in ("/tmp/x", "/dev/shm/x", "/var/tmp/x", "/run/lock/x"):  # the host's, if the code reached them
        try:
            os.unlink(p)
        except OSError:
            pass
    obs["reason"] = "ok"
    return obs


def c_write_outside(cx: Context) -> Obs:
    target = cx.outside / "x"
    code = _PROBE + (f"for p in [{str(target)!r}, '/usr/x', '/etc/x', '/x', '/var/tmp/y']:\n"
                     "    print(p, probe(p, 'w'))\n")
    obs = _res(cx.run(code))
    obs["seen"] = _lines_of(obs)
    obs["on_host"] = [p for p in (str(target), "/usr/x", "/etc/x", "/x", "/var/tmp/y") if os.path.exists(p)]
    for p in obs["on_host"]:
        os.unlink(p)
    return obs


def c_network(cx: Context) -> Obs:
    code = ("import socket\n"
            "print('ifaces', ','.join(sorted(n for _, n in socket.if_nameindex())))\n"
            "for addr in [('1.1.1.1', 53), ('127.0.0.1', 22)]:\n"
            "    try:\n        socket.create_connection(addr, timeout=1)\n        print('connect', 'CONNECTED')\n"
            "    except OSError as e:\n        print('connect', type(e).__name__)\n")
    obs = _res(cx.run(code))
    obs["ifaces"] = _lines_of(obs).get("ifaces")
    obs["connected"] = "CONNECTED" in obs["stdout"]
    return obs


def c_kill_processes(cx: Context) -> Obs:
    """Signal 0 (may I?) to the worker and to everyone, so a sandbox that does not contain it reports
    'SENT' without killing the harness; then SIGKILL to the zygote (its parent, and PID 1)."""
    before = cx.pool.statistics().recycled
    probe = ("import os\n"
             f"for name, pid in [('worker', {cx.worker_pid}), ('everyone', -1)]:\n"
             "    try:\n        os.kill(pid, 0)\n        print(name, 'SENT')\n"
             "    except OSError as e:\n        print(name, type(e).__name__)\n")
    obs = _res(cx.run(probe))
    obs["seen"] = _lines_of(obs)
    kill = ("import os, signal\n"
            "for pid in (os.getppid(), 1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n")
    obs["zygote_kill"] = cx.run(kill).reason
    obs["recycled"] = cx.pool.statistics().recycled - before
    return obs


def c_leftover_process(cx: Context) -> Obs:
    code = ("import os, signal, subprocess, time\n"
            "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "    if os.fork() == 0:\n        time.sleep(300)\n"
            "    os._exit(0)\n"
            "time.sleep(0.1)\nprint('returned')\n")
    return _res(cx.run(code))


def c_close_stdout(cx: Context) -> Obs:
    obs = _res(cx.run("import os, sys\nprint('before', flush=True)\nos.close(1)\nsys.stderr.write('after close')\n"))
    obs["second"] = _res(cx.run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)\n"))["reason"]
    return obs


def c_snapshot_symlink(cx: Context) -> Obs:
    t = "hostile-links"
    r = cx.run("import os\nopen('keep', 'w').write('mine')\nos.symlink('/etc/passwd', 'out')\n", trajectory=t)
    obs = _res(r)
    try:
        cx.pool.snapshot_trajectory(t)
        obs["snapshot"] = "TAKEN"
    except SandboxError as e:
        obs["snapshot"] = f"refused: {e}"
    obs["kept"] = cx.pool.has_trajectory(t) and \
        cx.run("print(open('keep').read())", trajectory=t).stdout == "mine\n"
    refused = []
    for name, member in _evil_members():
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            data = b"pwned"
            info = tarfile.TarInfo("ok.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
        try:
            cx.pool.restore_trajectory(t, buf.getvalue())
            refused.append(f"{name}:RESTORED")
        except SandboxError:
            refused.append(f"{name}:refused")
    obs["restores"] = refused
    obs["kept_after_restores"] = cx.run("print(open('keep').read())", trajectory=t).stdout == "mine\n"
    cx.pool.end_trajectory(t)
    return obs


def _evil_members() -> list[tuple[str, tarfile.TarInfo]]:
    out = []
    m = tarfile.TarInfo("abs-link")
    m.type, m.linkname = tarfile.SYMTYPE, "/etc/passwd"
    out.append(("absolute-symlink", m))
    m = tarfile.TarInfo("up-link")
    m.type, m.linkname = tarfile.SYMTYPE, "../../../../etc"
    out.append(("dotdot-symlink", m))
    m = tarfile.TarInfo("../escape.txt")
    m.size = 5
    out.append(("dotdot-name", m))
    m = tarfile.TarInfo("/abs.txt")
    m.size = 5
    out.append(("absolute-name", m))
    m = tarfile.TarInfo("dev")
    m.type, m.devmajor, m.devminor = tarfile.CHRTYPE, 1, 3
    out.append(("device", m))
    m = tarfile.TarInfo("hard")
    m.type, m.linkname = tarfile.LNKTYPE, "/etc/shadow"
    out.append(("hardlink-out", m))
    return out


def c_sysv_ipc(cx: Context) -> Obs:
    """A System V shared memory segment left by one action, and a POSIX queue, looked for by the next."""
    key = 0x7A6E0000 | (os.getpid() & 0xFFFF)
    make = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print('made', libc.shmget({key}, 4096, 0o1000 | 0o600))\n"
            "rt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
            "q = rt.mq_open(b'/tangram-hostile', os.O_CREAT | os.O_RDWR, 0o600, None)\n"
            "print('mq', 'OK' if q >= 0 else os.strerror(ctypes.get_errno()).replace(' ', '_'))\n")
    find = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print('found', libc.shmget({key}, 0, 0))\n")
    obs = _res(cx.run(make))
    obs["made"] = _lines_of(obs).get("made")
    obs["mq"] = _lines_of(obs).get("mq")
    if obs["mq"] == "OK":
        import ctypes
        ctypes.CDLL("librt.so.1").mq_unlink(b"/tangram-hostile")
    obs["found"] = _lines_of(_res(cx.run(find, trajectory="another"))).get("found")
    cx.pool.end_trajectory("another")
    if obs["found"] not in (None, "-1"):  # clean the host's IPC namespace up
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmctl(int(obs["found"]), 0, None)  # IPC_RMID
    return obs


def c_keyring(cx: Context) -> Obs:
    """A key put in the uid's keyring by one action, looked for by the next."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
            "nr = {'x86_64': (248, 250), 'aarch64': (217, 219)}[os.uname().machine]\n"
            "r = libc.syscall(nr[0], b'user', b'tangram-hostile', b'left', 3, ctypes.c_long(-4))\n"
            "print('add_key', 'OK' if r >= 0 else os.strerror(ctypes.get_errno()).replace(' ', '_'))\n"
            "r = libc.syscall(nr[1], 10, ctypes.c_long(-4), b'user', b'tangram-hostile', 0)\n"
            "print('search', 'FOUND' if r >= 0 else 'none')\n")
    obs = _res(cx.run(code))
    obs.update(_lines_of(obs))
    obs["next_search"] = _lines_of(_res(cx.run(code.replace("b'left', 3", "b'left', 0"))))["search"] \
        if obs.get("add_key") == "OK" else "none"
    return obs


def c_ptrace_zygote(cx: Context) -> Obs:
    """Attach to the zygote (the code's parent) or read its memory, descriptors, environment."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nz = os.getppid()\n"
            "r = libc.ptrace(16, z, None, None)\n"  # PTRACE_ATTACH
            "print('attach', 'OK' if r == 0 else os.strerror(ctypes.get_errno()).replace(' ', '_'))\n"
            "for what in ('mem', 'environ', 'fd'):\n"
            "    try:\n"
            "        (os.listdir if what == 'fd' else lambda p: open(p, 'rb').read(1))(f'/proc/{z}/{what}')\n"
            "        print(what, 'OK')\n"
            "    except OSError as e:\n        print(what, type(e).__name__)\n")
    obs = _res(cx.run(code))
    obs.update(_lines_of(obs))
    return obs


def c_gpu_devices(cx: Context) -> Obs:
    """Every GPU device node the worker sees: can the code open it and reach the device behind it (not
    /dev/null or an empty dir over it)?"""
    code = ("import glob, os, stat\n"
            f"paths = {gpu_device_nodes()!r}\n"
            "null = os.stat('/dev/null').st_rdev\n"
            "reached = []\n"
            "for p in paths:\n"
            "    try:\n"
            "        if os.path.isdir(p):\n"
            "            if os.listdir(p):\n                reached.append(p)\n"
            "            continue\n"
            "        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)\n"
            "    except OSError:\n        continue\n"
            "    st = os.fstat(fd)\n    os.close(fd)\n"
            "    if not (stat.S_ISCHR(st.st_mode) and st.st_rdev == null):\n        reached.append(p)\n"
            "print('reached', ','.join(reached) or '-')\n"
            "print('cuda_visible', repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n")
    obs = _res(cx.run(code))
    obs.update(_lines_of(obs))
    obs["host"] = gpu_device_nodes()
    return obs


CASES: dict[str, Callable[[Context], Obs]] = {name: globals()[f"c_{name}"] for name in THREATS}


# -- verdicts -----------------------------------------------------------------------------------

def judge(case: str, obs: Obs, root: bool) -> str:
    """What a case's observations show: 'yes' (contained), 'partial' or 'no'."""
    ok_after = obs.get("next_ok", True) and obs.get("leftover_procs", 0) == 0
    if not ok_after:
        return "no"
    r = obs.get("reason")
    limit = LIMITS
    if case in ("infinite_loop", "ignore_sigterm"):
        return "yes" if r == "timeout" else "no"
    if case in ("fork_bomb", "fork_bomb_libc"):
        # bounded at the limit (without a user namespace, plus the worker uid's tasks when it started)
        return "yes" if 0 <= obs["forked"] <= 2 * limit["procs"] else "no"
    if case == "memory":
        return "yes" if r == "memory" else "no"
    if case == "file_size":
        return "yes" if r == "file_limit" else "no"
    if case == "file_flood":
        return "yes" if r == "file_limit" and 0 <= obs["files"] <= limit["work_files"] else "no"
    if case == "disk_fill":
        return "yes" if r == "file_limit" and 0 <= obs["bytes"] <= limit["work_bytes"] else "no"
    if case == "fd_flood":
        return "yes" if r == "ok" and 0 <= obs["opened"] <= limit["open_files"] else "no"
    if case == "output_flood":
        return "yes" if r == "output_limit" and obs["stdout_len"] == limit["output_bytes"] else "no"
    if case == "binary_output":
        return "yes" if r == "ok" and obs["stdout_len"] > 0 and "\ufffd" in obs["stdout"] else "no"
    if case == "raise_limits":
        return "no" if "RAISED" in obs["stdout"] or r != "ok" else "yes"
    if case == "privileges":
        zero = all(obs.get(k) == "0000000000000000" for k in ("CapInh", "CapPrm", "CapEff", "CapAmb"))
        uid_ok = obs.get("uid") != "0" and (not root or obs.get("uid") == "65534")
        return "yes" if zero and uid_ok and obs.get("NoNewPrivs") == "1" and obs.get("setuid0") != "OK" else "no"
    if case == "read_host_files":
        if obs["secret"] == "OK" or obs["shadow"] == "OK":
            return "no"
        return "partial" if obs["public"] == "OK" else "yes"
    if case == "proc_worker":
        return "yes" if obs.get("found") == "-" and obs.get("worker_visible") == "False" else "no"
    if case == "env_leak":
        return "yes" if obs.get("environ") == "False" and obs.get("self") != "True" else "no"
    if case == "fd_leak":
        return "yes" if obs.get("fds") == "3" else "no"
    if case == "persist_writable":
        leaked = [f"{t}:{p}" for t, seen in obs["seen"].items() for p, there in seen.items()
                  if there == "True" and not (t == "persist-a" and (p == "x" or p.endswith("/h")))]
        kept = obs["seen"]["persist-a"].get("x") == "True"  # the trajectory's own working dir persists
        return "yes" if not leaked and kept else "no"
    if case == "write_outside":
        return "yes" if not obs["on_host"] and "OK" not in obs["seen"].values() else "no"
    if case == "network":
        return "yes" if obs["ifaces"] == "lo" and not obs["connected"] else "no"
    if case == "kill_processes":
        return "no" if obs["seen"].get("worker") == "SENT" else "yes"
    if case == "leftover_process":
        return "yes" if r == "ok" and obs["leftovers"] >= 2 else "no"
    if case == "close_stdout":
        return "yes" if r == "ok" and obs["stdout"] == "before\n" and obs["second"] == "timeout" else "no"
    if case == "snapshot_symlink":
        restored = [x for x in obs["restores"] if x.endswith("RESTORED")]
        return "yes" if obs["snapshot"].startswith("refused") and obs["kept"] and obs["kept_after_restores"] \
            and not restored else "no"
    if case == "ptrace_zygote":
        return "no" if "OK" in (obs.get("attach"), obs.get("mem"), obs.get("environ"), obs.get("fd")) else "yes"
    if case == "sysv_ipc":
        return "yes" if obs.get("found") == "-1" and obs.get("mq") != "OK" else "no"
    if case == "gpu_devices":
        return "no" if obs.get("reached", "-") != "-" or (obs.get("reason") != "ok" and obs["host"]) else "yes"
    if case == "keyring":
        return "yes" if obs.get("add_key") != "OK" and obs.get("search") == "none" else "no"
    raise ValueError(f"unknown case {case!r}")


# -- running the matrix ---------------------------------------------------------------------------

def _descendants(pid: int) -> int:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                rest = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[-1].split()
            except OSError:
                continue
            kids.setdefault(int(rest[1]), []).append(int(name))
    n, todo = 0, [pid]
    while todo:
        for k in kids.get(todo.pop(), ()):
            n += 1
            todo.append(k)
    return n


def _tree(pool: SandboxPool) -> list[int]:
    """Processes under each sandbox on the host (the zygote and what it holds)."""
    return sorted(_descendants(box._proc.pid) for box in list(pool._boxes) if box._proc is not None)


def run_matrix(backend: str, python: str, secret: str, cases: list[str] | None = None) -> dict[str, Any]:
    """Every case against a fresh pool of this backend; observations and verdicts by case."""
    root = os.geteuid() == 0
    out: dict[str, Any] = {"backend": backend, "root": root, "uid": os.getuid(), "python": python, "cases": {}}
    # the worker's files live outside /tmp (each action's fresh /tmp would hide them from the process
    # backend, which is not what a worker's checkout or home looks like)
    home = "/var/tmp" if os.access("/var/tmp", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="tangram-hostile-") as tmp, \
            tempfile.TemporaryDirectory(prefix="tangram-hostile-worker-", dir=home) as files:
        base = Path(tmp)
        os.chmod(base, 0o711)
        os.chmod(files, 0o755)
        with SandboxPool(backend=backend, size=1, root=str(base / "pool"), python=python, **LIMITS) as pool:
            if not pool.wait_ready(60):
                raise SandboxError("the pool did not start")
            cx = Context(pool, secret, Path(files))
            out["isolated"] = all(b.scratch for b in pool._boxes)
            for name in cases or list(CASES):
                cx.run("pass")
                pool.wait_ready(30)
                before = _tree(pool)
                t0 = time.monotonic()
                try:
                    obs = CASES[name](cx)
                except Exception as e:  # a case that breaks the harness is a finding, not a crash
                    obs = {"reason": "harness", "error": f"{type(e).__name__}: {e}"}
                nxt = cx.run("print('next')")
                obs["next_ok"] = nxt.reason == "ok" and nxt.stdout == "next\n"
                obs["worker_alive"] = True  # we are the worker, still here
                pool.wait_ready(30)
                after = _tree(pool)
                obs["leftover_procs"] = max(0, sum(after) - sum(before)) if len(after) == len(before) else 0
                obs["seconds"] = round(time.monotonic() - t0, 3)
                out["cases"][name] = {"verdict": judge(name, obs, root) if "error" not in obs else "no", "obs": obs}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="bwrap", choices=["bwrap", "process"])
    ap.add_argument("--python", default=sys.executable, help="the sandboxes' interpreter")
    ap.add_argument("--secret", default="hostile-secret-" + os.urandom(6).hex(),
                    help="a value the worker holds in its argv and environment")
    ap.add_argument("--case", action="append", help="only these cases")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ["TANGRAM_HOSTILE_SECRET"] = args.secret  # the worker's own environment (the zygote scrubs it)
    out = run_matrix(args.backend, args.python, args.secret, args.case)
    if args.json:
        print(json.dumps(out))
        return
    print(f"backend={out['backend']} worker uid={out['uid']} isolated={out['isolated']}")
    print(f"{'case':18s} {'contained':9s} how its run ended")
    for name, c in out["cases"].items():
        print(f"{name:18s} {c['verdict']:9s} {c['obs'].get('reason', '')}")


if __name__ == "__main__":
    # SIGPIPE stays ignored, as in any Python process (a Dask worker too): the pool writes to zygotes
    # that hostile code may have killed, and handles the EPIPE. Restoring SIG_DFL here (as this runner
    # once did) made it die with 141 at random: SandboxPool.close then stopped its starter threads
    # first, so their zygotes died (PR_SET_PDEATHSIG) as the goodbye was written to them.
    main()
