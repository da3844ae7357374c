"""Isolation backends: one small interface, ``start``, ``run``, ``reset``, ``close``.

A :class:`Sandbox` is a warm *zygote* (``_zygote.py``): a Python process that has
already started inside its isolation and runs each action in a fresh forked
child (so Python is already imported) under per-action limits. Each action gets
a fresh tmpfs for /tmp, /dev/shm and its working dir (one size and file quota)
in a mount namespace where everything else is read-only; after the run the
zygote kills whatever the code left behind and unmounts the tmpfs.

Backends differ only in how the zygote is confined:

``bwrap``   bubblewrap: own mount, PID, network, IPC and UTS namespaces (plus a
            user namespace when unprivileged); only /usr, the Python prefix and
            named paths are visible; dies with the worker.
``process`` the host's filesystem (read-only), for where bubblewrap cannot run:
            the zygote makes its own user (unprivileged), mount, PID, network,
            IPC and UTS namespaces where the kernel allows; rlimits, own
            session, scrubbed environment. Without namespaces it is a plain
            child with rlimits, says so, and ``strict=True`` refuses it.

A root worker never runs code as root or as itself (:func:`code_uid`).
:func:`containment` says, per backend, worker and case, what is contained.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import select
import shutil
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Mapping

from ..errors import SandboxError
from .options import Limits, PoolOptions
from .result import RunResult

logger = logging.getLogger("tangram_dask.sandbox")

_ZYGOTE_SRC = (Path(__file__).with_name("_zygote.py")).read_text()

#: The hostile cases the tests run (tests/test_sandbox_hostile.py), every one under each backend and
#: as a root and an unprivileged worker.
THREATS = (
    "infinite_loop", "ignore_sigterm", "fork_bomb", "fork_bomb_libc", "memory", "file_size", "file_flood",
    "disk_fill", "fd_flood", "output_flood", "binary_output", "raise_limits", "privileges",
    "read_host_files", "proc_worker", "env_leak", "fd_leak", "persist_writable", "write_outside",
    "network", "kill_processes", "leftover_process", "close_stdout", "snapshot_symlink", "sysv_ipc", "keyring",
    "ptrace_zygote", "gpu_devices",
)

#: The device nodes a GPU is reached through (NVIDIA's, and its caps dir; the DRM dir; AMD's KFD): the zygote
#: hides them in its mount namespace (its config's ``gpu_globs``).
GPU_DEVICE_GLOBS = ("/dev/nvidia*", "/dev/dri", "/dev/kfd")


def gpu_device_nodes() -> list[str]:
    """The GPU device nodes on this host (:data:`GPU_DEVICE_GLOBS`), sorted."""
    import glob

    return sorted({p for g in GPU_DEVICE_GLOBS for p in glob.glob(g)})


@dataclass(frozen=True, slots=True)
class Containment:
    """Whether a backend contains one threat here: ``level`` is yes / partial / no."""

    threat: str
    level: str
    why: str

    @property
    def contained(self) -> bool:
        return self.level == "yes"


# -- running as whom ----------------------------------------------------------

def code_uid(options: PoolOptions, backend: str = "process") -> int | None:
    """The uid untrusted code runs as (None: the worker's own, which only an unprivileged worker may keep).

    A root worker never runs untrusted code as root: ``uid=None`` is refused, and
    under ``process`` (which runs the host's interpreter directly) so is an
    interpreter the code's uid cannot read, naming the fix. (Under ``bwrap`` the
    interpreter's directories are mounted readable.) An unprivileged worker runs
    the code as its own uid, inside a user namespace where the kernel allows one.
    """
    if os.geteuid() != 0:
        if options.uid is None or options.uid == "auto":
            return None
        raise SandboxError(f"sandbox option 'uid' = {options.uid!r}: switching user needs the worker to run "
                           "as root; run the worker as root or pass uid='auto' (the worker's own uid)")
    if options.uid is None:
        raise SandboxError("sandbox option 'uid' = None: the worker runs as root and untrusted code never "
                           "runs as root; pass uid='auto' (65534) or another unprivileged uid")
    uid = 65534 if options.uid == "auto" else int(options.uid)
    if backend == "process" and options.python is not None:  # None: resolve_python picks one it can run
        blocked = _unreadable_by(options.python, uid)
        if blocked:
            raise SandboxError(f"sandbox option 'python' = {options.python!r}: the code would run as uid {uid}, "
                               f"which cannot read the interpreter ({blocked} is closed to it); pass python= an "
                               "interpreter outside private dirs (e.g. '/usr/bin/python3') or use "
                               "backend='bwrap', which mounts the interpreter's dirs readable")
    return uid


#: Interpreters a root worker's process backend falls back to when the code's uid cannot run the worker's.
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")

_CHECK_PYTHON = "import sys\ncompile(sys.stdin.read(), '<tangram zygote>', 'exec')\n"
_resolved: dict[tuple[Any, ...], str] = {}


def resolve_python(options: PoolOptions, backend: str = "process") -> str:
    """The sandboxes' interpreter: ``options.python`` if given, else one the code's uid can run.

    Under ``bwrap``, or where the code keeps the worker's uid, that is the worker's own
    interpreter. A root worker's ``process`` backend runs the host's interpreter as the
    code's uid (65534): the worker's is kept if that uid can run it (every directory on
    its real path passable, and a trial run as that uid compiles the zygote and imports
    ``preload``), else the first of :data:`SYSTEM_PYTHONS` that passes the same checks.
    None passing raises :class:`SandboxError` naming each reason and the fixes.
    """
    if options.python is not None:
        return options.python
    uid = code_uid(options, backend)
    if backend != "process" or uid is None:
        return sys.executable
    key = (sys.executable, uid, options.preload)
    with _probe_lock:
        if key in _resolved:
            return _resolved[key]
    reasons: list[str] = []
    seen: set[str] = set()
    for python in (sys.executable, *SYSTEM_PYTHONS):
        real = os.path.realpath(python)
        if real in seen or not os.path.isfile(real):
            continue
        seen.add(real)
        blocked = _unreadable_by(python, uid)
        why = f"{blocked} is closed to it" if blocked else _fails_as(python, uid, options.preload)
        if why:
            reasons.append(f"{python}: {why}")
            continue
        if python != sys.executable:
            logger.info("tangram sandbox: the code runs as uid %d, which cannot run the worker's interpreter "
                        "(%s); the process backend's sandboxes run %s", uid, reasons[0] if reasons else "", python)
        with _probe_lock:
            _resolved[key] = python
        return python
    raise SandboxError(f"no Python interpreter that uid {uid} (the code's: the worker runs as root) can run for "
                       f"the process backend: {'; '.join(reasons) or 'none found'}. Install a system Python "
                       f"(apt-get install -y python3{', with the preload modules' if options.preload else ''}), "
                       "pass python= an interpreter outside private dirs such as /root, or use backend='bwrap' "
                       "(which mounts the worker's interpreter readable)")


def _fails_as(python: str, uid: int, preload: tuple[str, ...]) -> str:
    """Why ``python``, run as ``uid`` (no groups), cannot serve as a zygote; '' if it can."""
    code = _CHECK_PYTHON + "".join(f"import {m}\n" for m in preload)
    try:
        p = subprocess.run([python, "-I", "-c", code], input=_ZYGOTE_SRC.encode(), capture_output=True,
                           timeout=30, cwd="/", env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                           user=uid, group=uid, extra_groups=[])
    except (OSError, subprocess.SubprocessError) as e:
        return f"a trial run as uid {uid} failed: {e}"
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace").strip().splitlines()
        return f"a trial run as uid {uid} failed: {err[-1] if err else f'exit {p.returncode}'}"
    return ""


def _unreadable_by(path: str, uid: int, final: int = 0o5) -> str:
    """The first directory or file on ``path`` that ``uid`` (no groups) cannot use; '' if none."""
    real = os.path.realpath(path)
    parts = real.split("/")
    for i in range(2, len(parts) + 1):
        p = "/".join(parts[:i]) or "/"
        try:
            st = os.stat(p)
        except OSError:
            return p
        need = final if i == len(parts) else 0o1
        bits = (st.st_mode >> 6) & 7 if st.st_uid == uid else st.st_mode & 7
        if bits & need != need:
            return p
    return ""


def _count_tasks(uid: int) -> int:
    """Threads that ``uid`` owns now in this user namespace (what RLIMIT_NPROC counts)."""
    try:
        mine = os.stat("/proc/self/ns/user").st_ino
    except OSError:
        mine = None
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:
                    continue
                if mine is not None and os.stat(f"/proc/{name}/ns/user").st_ino != mine:
                    continue  # counted in its own user namespace, not in ours
                n += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return n


def _bwrap_path() -> str | None:
    return shutil.which("bwrap")


_bwrap_probe: tuple[bool, str] | None = None
_probe_lock = threading.Lock()


def bwrap_available() -> tuple[bool, str]:
    """Whether bubblewrap can create its namespaces here, and why not."""
    global _bwrap_probe
    with _probe_lock:
        if _bwrap_probe is None:
            exe = _bwrap_path()
            if exe is None:
                _bwrap_probe = (False, "bwrap is not installed (apt-get install -y bubblewrap)")
            else:
                args = [exe, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "--die-with-parent"]
                if os.geteuid() != 0:
                    args.append("--unshare-user")
                try:
                    p = subprocess.run([*args, "--", "/bin/true"], capture_output=True, timeout=10)
                    ok = p.returncode == 0
                    err = p.stderr.decode(errors="replace").strip()
                    why = "" if ok else f"bwrap cannot create namespaces here: {err}"
                except (OSError, subprocess.SubprocessError) as e:
                    ok, why = False, f"bwrap failed to run: {e}"
                _bwrap_probe = (ok, why)
        return _bwrap_probe


def choose_backend(name: str) -> type["Sandbox"]:
    """The backend class for an option value; 'auto' is bwrap where it works."""
    if name == "process":
        return ProcessSandbox
    ok, why = bwrap_available()
    if name == "bwrap":
        if not ok:
            raise SandboxError(f"sandbox backend 'bwrap' cannot run: {why}; install bubblewrap, allow "
                               "unprivileged user namespaces, or pass backend='process' (weaker isolation)")
        return BwrapSandbox
    if ok:
        return BwrapSandbox
    logger.warning("tangram sandbox: bubblewrap unusable (%s); falling back to the 'process' backend: "
                   "rlimits, own process group, scrubbed env; NOT hidden: world-readable host files, "
                   "world-writable dirs. See docs/sandbox.md", why)
    return ProcessSandbox


# -- the host side of one sandbox ---------------------------------------------

class Sandbox:
    """One warm sandbox. Subclasses say how the zygote is confined (:meth:`_command`)."""

    name: ClassVar[str] = ""
    #: where the host's sandbox dir is, as the zygote sees it (None: the host path)
    inner_area: ClassVar[str | None] = None

    def __init__(self, box_dir: str | os.PathLike[str], options: PoolOptions, sandbox_id: str = ""):
        self.options = options
        self.id = sandbox_id or Path(box_dir).name
        self.box = Path(box_dir)
        if options.python is None:
            options = self.options = replace(options, python=resolve_python(options, self.name))
        self.mnt = self.box / "mnt"          # the zygote's area: hidden from the code once it is ready
        self.tmp = self.box / "tmp"          # the code's /tmp where there is no mount namespace
        self.uid = code_uid(options, self.name)
        self.uses = 0
        self.damaged = ""                    # why it must not be reused, if it must not
        self.info: dict[str, Any] = {}       # the zygote's "ready" message
        self.cgroup: "SandboxCgroup | None" = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._lock = threading.Lock()
        self._bye = False                    # the zygote was asked to exit (``goodbye``)

    # -- paths -----------------------------------------------------------------
    @property
    def scratch(self) -> bool:
        """Whether each action gets fresh tmpfs /tmp, /dev/shm and working dir (mount namespace)."""
        return bool(self.info.get("scratch"))

    @property
    def work(self) -> Path:
        """Where a trajectory's dir is moved in for its action (host path)."""
        return self.mnt / "slot" / "state" if self.scratch else self.mnt / "work"

    @property
    def work_path(self) -> str:
        """The code's working dir, as the code sees it."""
        return f"{self.inner_area or self.mnt}/work"

    @property
    def tmp_path(self) -> str:
        return "/tmp" if self.scratch or self.inner_area else str(self.tmp)

    # -- the interface ---------------------------------------------------------
    def start(self) -> None:
        """Start the zygote and wait until it says it is ready."""
        for d in (self.box, self.mnt, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        for d in (self.box, self.mnt):
            os.chmod(d, 0o711)
        if self.uid is not None and self.inner_area is None:
            blocked = _unreadable_by(str(self.mnt), self.uid, final=0o1)
            if blocked:
                raise SandboxError(f"the sandbox directory {self.box} is not reachable by uid {self.uid} "
                                   f"({blocked} is closed to it); put the pool's root under a directory "
                                   "others may traverse (chmod o+x), or use backend='bwrap'")
        for d in (self.mnt / "work", self.mnt / "slot"):  # without scratch / with: a trajectory's dir goes there
            d.mkdir(mode=0o700, exist_ok=True)
            self._own(d)
        os.chmod(self.tmp, 0o700)
        self._own(self.tmp)
        config = {
            "uid": self.uid,
            "env": self._env(),
            "preload": list(self.options.preload),
            "area": self.inner_area or str(self.mnt),
            "gpu_globs": list(GPU_DEVICE_GLOBS),  # hidden in the zygote's mount namespace (gpu_devices)
            **self._config(),
        }
        pass_fds: tuple[int, ...] = ()
        if self.options.cgroup is not None:
            self.cgroup = SandboxCgroup.create(self.options.cgroup, self.id, self.options.limits)
            if self.cgroup is not None:
                config["cgroup_fd"] = self.cgroup.procs_fd
                pass_fds = (self.cgroup.procs_fd,)
        cmd = self._command(config)
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, cwd=self.box, env=self._host_env(),
                                          start_new_session=True, close_fds=True, pass_fds=pass_fds)
        except OSError as e:
            raise SandboxError(f"cannot start a {self.name} sandbox ({cmd[0]}): {e}; check that it is "
                               "installed and executable") from e
        finally:
            if self.cgroup is not None:
                self.cgroup.close_fd()
        os.set_blocking(self._proc.stdout.fileno(), False)  # type: ignore[union-attr]
        msg = self._recv(time.monotonic() + self.options.start_timeout_s)
        if msg is None or msg.get("op") != "ready":
            err = self._stderr_tail()
            self.close()
            raise SandboxError(f"a {self.name} sandbox did not start: {err or 'no message'}; "
                               + self._start_fix())
        self.info = msg
        # the zygote's stderr is not read again: it says nothing after start
        self._proc.stderr.close()  # type: ignore[union-attr]
        if not msg.get("scratch") and (self.name == "bwrap" or self.options.strict):
            why = msg.get("why") or "unknown"
            self.close()
            raise SandboxError(f"a {self.name} sandbox got no private mount namespace ({why}): actions could "
                               "leave files in /tmp or /dev/shm for the next; "
                               + ("strict=True refuses to run without one; allow unprivileged user "
                                  "namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                                  "user.max_user_namespaces > 0) or run the worker as root"
                                  if self.options.strict else self._start_fix()))

    def run(self, request: Mapping[str, Any], limits: Limits, cpus: tuple[int, ...] = (),
            stateful: bool = False) -> RunResult:
        """Run one action (``code`` or ``argv``) with these limits; never raises for the code's faults."""
        units = max(1, len(cpus))
        cpu_s = limits.cpu_s if limits.cpu_s is not None else limits.timeout_s * units + 1
        files = {rel: base64.b64encode(data).decode() for rel, data in (request.get("files") or {}).items()}
        req = {
            "op": "run",
            "code": request.get("code"),
            "argv": request.get("argv"),
            "stdin": base64.b64encode(request.get("stdin") or b"").decode(),
            "env": {**(request.get("env") or {}), "OMP_NUM_THREADS": str(units), "TANGRAM_CPUS": str(units)},
            "cwd": self.work_path,
            "files": files,
            "stateful": stateful,
            "cpus": list(cpus),
            "timeout_s": limits.timeout_s,
            "cpu_s": cpu_s,
            "memory_bytes": limits.memory_bytes,
            "output_bytes": limits.output_bytes,
            "file_bytes": limits.file_bytes,
            "work_bytes": limits.work_bytes,
            "work_files": limits.work_files,
            "procs": limits.procs,
            "open_files": limits.open_files,
        }
        if self.cgroup is not None:
            self.cgroup.set_cpus(units)
        self.uses += 1
        t0 = time.monotonic()
        with self._lock:
            try:
                self._send(req)
                msg = self._recv(t0 + limits.timeout_s + 10.0 + _copy_allowance(stateful))
            except OSError:
                msg = None
        if msg is None or msg.get("op") != "result":
            why = msg.get("msg") if msg is not None and msg.get("op") == "error" else ""
            self.damaged = why or "the sandbox died or stopped answering during the run"
            return RunResult(reason="killed", exit_code=None, stdout="", stderr="",
                             wall_s=time.monotonic() - t0, cpu_s=0.0, backend=self.name, cpus=tuple(cpus),
                             detail=self.damaged + ("" if why else " (did the code kill its parent?)")
                             + "; it was replaced")
        res = _result(msg, self.name, tuple(cpus), limits, command=bool(request.get("argv")))
        if not msg.get("clean", True):
            self.damaged = "processes left by the code could not all be killed"
        elif msg.get("wipe"):
            self.damaged = f"its scratch could not be unmounted: {msg['wipe']}"
        elif msg.get("ipc_left"):
            self.damaged = f"the code left {msg['ipc_left']} System V IPC object(s) in the sandbox's namespace"
        elif msg.get("saved"):
            self.damaged = f"the trajectory's working dir could not be saved after the action: {msg['saved']}"
            res = replace(res, detail="; ".join(filter(None, [res.detail, self.damaged])))
        elif res.reason not in ("ok", "error") or res.leftovers_killed:
            self.damaged = f"the last run ended with {res.reason}" + (
                f" and {res.leftovers_killed} leftover processes" if res.leftovers_killed else "")
        return res

    def reset(self) -> bool:
        """Make the sandbox ready for another action; False: it must be recycled instead.

        With a mount namespace the zygote already dropped the action's tmpfs: nothing
        to wipe. Without one (process backend, no user namespaces) the working dir
        and the private TMPDIR are wiped here; /tmp and /dev/shm are not private then.
        """
        if self.damaged or not self.alive():
            return False
        if self.uses >= self.options.max_uses:
            return False
        if self.scratch:
            return True
        try:
            self.new_workdir()
            _empty_dir(self.tmp)
        except OSError as e:
            self.damaged = f"its directories could not be wiped: {e}"
            return False
        return True

    def goodbye(self) -> None:
        """Ask the zygote to exit (it cleans up after itself) without waiting for it: a pool that closes
        many sandboxes asks them all, then :meth:`close` waits for each, so they exit together."""
        proc = self._proc
        if proc is None or self._bye or not self._lock.acquire(blocking=False):
            return  # (a run in progress: close() kills it)
        try:
            if proc.poll() is None:
                self._send_to(proc, {"op": "exit"})
                self._bye = True
        except OSError:
            pass
        finally:
            self._lock.release()

    def close(self, wait_s: float = 2.0) -> None:
        """Stop the zygote and everything under it; remove its directories. Safe to call twice. The
        zygote gets ``wait_s`` seconds to exit by itself (its own clean-up), then it is killed."""
        self.goodbye()  # (none while a run is in progress: the worker is shutting down, the kill below ends it)
        proc, self._proc = self._proc, None
        if proc is not None:
            if self._bye:
                try:
                    proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except OSError:
                    pass
                proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
        if self.cgroup is not None:
            self.cgroup.remove()
        shutil.rmtree(self.box, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def new_workdir(self) -> None:
        """A fresh, empty working dir owned by the code's uid (wiping the old one), without scratch."""
        work = self.mnt / "work"
        if work.is_symlink() or work.exists():
            if work.is_dir() and not work.is_symlink() and not any(os.scandir(work)):
                return
            _rmtree(work)
        work.mkdir(mode=0o700)
        self._own(work)

    def _own(self, p: Path) -> None:
        if self.uid is not None:
            os.chown(p, self.uid, self.uid)

    def _env(self) -> dict[str, str]:
        bindir = os.path.dirname(self.options.python)
        return {
            "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": self.work_path,
            "TMPDIR": str(self.tmp) if self.inner_area is None else "/tmp",  # the zygote says /tmp with scratch
            "LANG": "C.UTF-8",
            "USER": "sandbox",
            "PYTHONDONTWRITEBYTECODE": "1",
            "CUDA_VISIBLE_DEVICES": "",  # no GPU for CUDA (the device nodes themselves: gpu_devices)
        }

    def _host_env(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

    def _config(self) -> dict[str, Any]:
        return {}

    def _command(self, config: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def _start_fix(self) -> str:
        return "check the worker's Python and the sandbox root directory"

    def _stderr_tail(self) -> str:
        proc = self._proc
        if proc is None or proc.stderr is None:
            return ""
        try:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            return proc.stderr.read()[-2000:].decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def _send(self, obj: Mapping[str, Any]) -> None:
        if self._proc is None:
            raise OSError("sandbox closed")
        self._send_to(self._proc, obj)

    @staticmethod
    def _send_to(proc: subprocess.Popen[bytes], obj: Mapping[str, Any]) -> None:
        body = json.dumps(obj).encode()
        data = memoryview(struct.pack(">I", len(body)) + body)
        fd = proc.stdin.fileno()  # type: ignore[union-attr]
        while data:
            data = data[os.write(fd, data):]

    def _recv(self, deadline: float) -> dict[str, Any] | None:
        """One frame from the zygote, or None if it died or the deadline passed."""
        proc = self._proc
        if proc is None:
            return None
        fd = proc.stdout.fileno()  # type: ignore[union-attr]
        poller = select.poll()  # not select.select: a worker may hold more than 1024 fds
        poller.register(fd, select.POLLIN)
        while True:
            if len(self._buf) >= 4:
                (n,) = struct.unpack(">I", self._buf[:4])
                if len(self._buf) >= 4 + n:
                    body, self._buf = self._buf[4:4 + n], self._buf[4 + n:]
                    return json.loads(body)
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                return None
            self._buf += chunk


def _result(msg: Mapping[str, Any], backend: str, cpus: tuple[int, ...], limits: Limits,
            command: bool) -> RunResult:
    stdout = base64.b64decode(msg["stdout"]).decode("utf-8", "replace")
    stderr = base64.b64decode(msg["stderr"]).decode("utf-8", "replace")
    sig, code, ours, end = msg["signal"], msg["exit_code"], msg["ours"], msg["end"]
    detail = ""
    if ours == "timeout":
        reason, detail = "timeout", f"wall time limit of {limits.timeout_s:g} s reached; killed"
    elif ours == "output_limit":
        which = "stdout" if msg["stdout_truncated"] else "stderr"
        reason, detail = "output_limit", f"{which} passed the {limits.output_bytes} byte limit; killed and cut"
    elif end == "memory":
        reason, detail = "memory", f"MemoryError at the {limits.memory_bytes} byte address-space limit"
    elif msg.get("full") and (code != 0 or end == "file_limit"):
        reason, detail = "file_limit", (f"the working dir, /tmp and /dev/shm (one tmpfs) are full: "
                                        f"{limits.work_bytes} bytes or {limits.work_files} files")
    elif end == "file_limit" or sig == 25:  # SIGXFSZ
        reason, detail = "file_limit", f"a file passed the {limits.file_bytes} byte limit"
    elif sig == 24:  # SIGXCPU
        reason, detail = "timeout", "CPU time limit reached"
    elif end in ("setup", "exec"):
        reason, detail = "error", msg.get("msg", "")
    elif sig is not None:
        import signal as _signal
        try:
            name = _signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        reason, detail = "killed", f"ended by signal {name}"
    elif code == 0:
        reason = "ok"
    else:
        reason = "error"
        if command and "MemoryError" in stderr[-4000:] and code == 1:
            reason, detail = "memory", "MemoryError (the command hit the address-space limit)"
    if msg["leftovers"]:
        extra = f"killed {msg['leftovers']} process(es) the code left behind"
        detail = f"{detail}; {extra}" if detail else extra
    return RunResult(
        reason=reason, exit_code=code, stdout=stdout, stderr=stderr, wall_s=float(msg["wall_s"]),
        cpu_s=float(msg["cpu_s"]), stdout_truncated=bool(msg["stdout_truncated"]),
        stderr_truncated=bool(msg["stderr_truncated"]), signal=sig, detail=detail, backend=backend,
        cpus=cpus, cpu_mechanism=msg.get("cpu_mechanism", "none"), leftovers_killed=int(msg["leftovers"]),
    )


def _rmtree(path: Path) -> None:
    """Remove a tree the code may have made hard to remove (chmod 000 dirs)."""
    def fix(func: Any, p: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=fix)
        if path.exists():
            raise OSError(f"could not remove {path}")


def _empty_dir(path: Path, keep: set[str] = frozenset()) -> None:
    for entry in os.scandir(path):
        if entry.name in keep:
            continue
        p = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            _rmtree(p)
        else:
            p.unlink()


# -- the backends -------------------------------------------------------------

class BwrapSandbox(Sandbox):
    """Bubblewrap: namespaces, read-only system, a fresh tmpfs per action for every writable place."""

    name = "bwrap"
    inner_area = "/sandbox"

    def _config(self) -> dict[str, Any]:
        return {"net_isolated": True, "ns": "bwrap", "keep_under_tmp": self._under_tmp()}

    def _under_tmp(self) -> list[str]:
        return [p for p in self._binds() if p.startswith("/tmp/")]

    def _binds(self) -> list[str]:
        return [p for p in _python_paths(self.options.python) + list(self.options.ro_binds)
                if not p.startswith("/usr/")]

    def _command(self, config: dict[str, Any]) -> list[str]:
        exe = _bwrap_path()
        if exe is None:
            raise SandboxError("bwrap is not installed: apt-get install -y bubblewrap, or use backend='process'")
        args = [exe, "--die-with-parent", "--new-session", "--clearenv", "--as-pid-1",
                "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox"]
        if "cgroup_fd" not in config:  # with its own cgroup, the zygote joins it from the host's cgroup view
            args.append("--unshare-cgroup-try")
        # the zygote keeps only what it needs: mount each action's tmpfs (SYS_ADMIN), and as root drop
        # to the code's uid (SETUID, SETGID) and kill what the code left (KILL); the code keeps nothing
        if os.geteuid() == 0:
            args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                     "--cap-add", "CAP_KILL", "--cap-add", "CAP_SYS_ADMIN"]
        else:
            args += ["--unshare-user", "--cap-add", "CAP_SYS_ADMIN"]
        args += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        args += ["--perms", "0755", "--dir", "/etc"]  # made by bwrap, it would be 0700
        for etc in ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives"):
            args += ["--ro-bind-try", etc, etc]
        binds = self._binds()
        # an interpreter under /tmp (a checkout there) is bound after /tmp, over it; the zygote binds it
        # again into each action's fresh /tmp
        under_tmp = [p for p in binds if p.startswith("/tmp/")]
        args += _ro_binds([p for p in binds if p not in under_tmp])
        args += ["--dev", "/dev", "--proc", "/proc", "--perms", "0755", "--tmpfs", "/tmp",
                 "--bind", str(self.mnt), "/sandbox"]
        args += _ro_binds(under_tmp)
        args += ["--chdir", "/"]
        return [*args, "--", self.options.python, "-I", "-c", _ZYGOTE_SRC, json.dumps(config)]

    def _start_fix(self) -> str:
        return "run `bwrap --ro-bind / / true` to see why, or use backend='process'"


class ProcessSandbox(Sandbox):
    """A child process in its own namespaces where allowed; rlimits, own session, scrubbed environment."""

    name = "process"

    def _config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"ns": "process", "parent_pid": os.getpid(),
                               "keep_under_tmp": [p for p in _python_paths(self.options.python)
                                                  if p.startswith("/tmp/")]}
        if self.uid is None and os.geteuid() != 0:
            cfg["nproc_base"] = _count_tasks(os.geteuid())
        return cfg

    def _command(self, config: dict[str, Any]) -> list[str]:
        return [self.options.python, "-I", "-c", _ZYGOTE_SRC, json.dumps(config)]


def _copy_allowance(stateful: bool) -> float:
    """Extra seconds a stateful action may take to copy its dir in and out of its tmpfs."""
    return 30.0 if stateful else 0.0


class SandboxCgroup:
    """A sandbox's own cgroup (v2) under a delegated one: ``memory.max``, ``pids.max``, ``cpu.max``.

    The host makes ``<root>/tangram-<id>``, writes the limits, and hands the zygote an
    open ``cgroup.procs`` into which it writes ``0`` (itself) before it forks anything,
    so every action's processes are in it. ``cpu.max`` follows each action's units.
    """

    PERIOD = 100_000

    def __init__(self, path: Path, procs_fd: int):
        self.path = path
        self.procs_fd = procs_fd
        self._cpus = 0

    @classmethod
    def create(cls, root: str, sandbox_id: str, limits: Limits) -> "SandboxCgroup | None":
        base = Path(root)
        controllers = set((base / "cgroup.controllers").read_text().split()) if (base / "cgroup.controllers").exists() \
            else set()
        missing = {"memory", "pids", "cpu"} - controllers
        if missing:
            raise SandboxError(f"sandbox option 'cgroup' = {root!r}: {base} does not offer the "
                               f"{', '.join(sorted(missing))} controller(s); delegate them (cgroup.subtree_control "
                               "of its parent) or pass cgroup=None")
        wanted = " ".join(f"+{c}" for c in ("cpu", "memory", "pids"))
        try:
            (base / "cgroup.subtree_control").write_text(wanted)
        except OSError as e:
            raise SandboxError(f"sandbox option 'cgroup' = {root!r}: cannot enable controllers in {base} ({e}); "
                               "the worker needs a delegated cgroup v2 subtree") from e
        path = base / f"tangram-{sandbox_id}-{os.getpid()}"
        path.mkdir(exist_ok=True)
        (path / "memory.max").write_text(str(limits.memory_bytes + limits.work_bytes))
        (path / "pids.max").write_text(str(limits.procs + 8))
        fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CREAT, 0o644)  # O_CREAT: a fake tree in tests
        cg = cls(path, fd)
        cg.set_cpus(1)
        return cg

    def set_cpus(self, units: int) -> None:
        if units != self._cpus:
            (self.path / "cpu.max").write_text(f"{units * self.PERIOD} {self.PERIOD}")
            self._cpus = units

    def close_fd(self) -> None:
        if self.procs_fd >= 0:
            os.close(self.procs_fd)
            self.procs_fd = -1

    def remove(self) -> None:
        self.close_fd()
        try:
            self.path.rmdir()
        except OSError:
            shutil.rmtree(self.path, ignore_errors=True)  # a fake cgroup tree (plain dirs) in tests


def _ro_binds(paths: list[str]) -> list[str]:
    """bwrap arguments binding ``paths`` read-only, their parents made 0755 (bwrap's own are 0700,
    which the code's uid could not pass through)."""
    args: list[str] = []
    parents = sorted({"/".join(p.split("/")[:i]) for p in paths for i in range(2, p.count("/") + 1)})
    for d in parents:
        args += ["--perms", "0755", "--dir", d]
    for path in paths:
        args += ["--ro-bind", path, path]
    return args


def _python_paths(python: str) -> list[str]:
    """The directories the interpreter needs: its prefix, the venv's, the real binary's."""
    paths = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    if python != sys.executable:
        paths.add(os.path.dirname(os.path.dirname(os.path.abspath(python))))
    out: list[str] = []
    for p in sorted(paths):
        if p in ("/", "/usr") or not os.path.isdir(p):
            continue
        if not any(p.startswith(q + "/") for q in paths if q not in ("/", "/usr")):
            out.append(p)
    return out


BACKEND_CLASSES: dict[str, type[Sandbox]] = {"bwrap": BwrapSandbox, "process": ProcessSandbox}


_ns_probe: dict[str, tuple[bool, str]] = {}

_NS_PROBE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
flags = 0x00020000 | 0x20000000 | 0x40000000 | (0 if os.geteuid() == 0 else 0x10000000)
if libc.unshare(flags) != 0:
    sys.exit(os.strerror(ctypes.get_errno()))
"""


def namespaces_available(backend: str) -> bool:
    """Whether this backend's zygote gets its mount, PID and network namespaces here (probed once)."""
    if backend == "bwrap":
        return bwrap_available()[0]
    return namespace_probe()[0]


def namespace_probe() -> tuple[bool, str]:
    """Whether this process may unshare user (if unprivileged), mount, PID and network namespaces."""
    with _probe_lock:
        if "process" not in _ns_probe:
            try:
                p = subprocess.run([sys.executable, "-I", "-c", _NS_PROBE], capture_output=True, timeout=10)
                ok, why = p.returncode == 0, p.stderr.decode(errors="replace").strip()
            except (OSError, subprocess.SubprocessError) as e:
                ok, why = False, str(e)
            _ns_probe["process"] = (ok, "" if ok else f"unshare refused: {why}")
        return _ns_probe["process"]


def containment(backend: str, options: PoolOptions | None = None, *, root: bool | None = None,
                isolated: bool | None = None) -> dict[str, Containment]:
    """What ``backend`` contains, case by case (:data:`THREATS`), and why.

    ``root``: whether the worker runs as root (None: this process). ``isolated``:
    whether the sandbox gets its namespaces (None: probed here; bwrap always has them).
    This is what docs/sandbox.md's table says and what the hostile tests assert.
    """
    options = options or PoolOptions()
    root = os.geteuid() == 0 if root is None else root
    if backend == "bwrap":
        isolated = True
    elif isolated is None:
        isolated = namespaces_available(backend)
    Y, P, N = "yes", "partial", "no"
    c: dict[str, tuple[str, str]] = {
        "infinite_loop": (Y, "wall-clock timeout and RLIMIT_CPU; the zygote kills the process group"),
        "ignore_sigterm": (Y, "the zygote sends SIGKILL, which cannot be ignored"),
        "memory": (Y, "RLIMIT_AS on each run"),
        "file_size": (Y, "RLIMIT_FSIZE on each run"),
        "fd_flood": (Y, "RLIMIT_NOFILE on each run; every descriptor dies with the run"),
        "output_flood": (Y, "the zygote stops reading at the output limit and kills the run"),
        "binary_output": (Y, "output travels as bytes (base64) and is decoded with replacement"),
        "raise_limits": (Y, "hard rlimits cannot be raised without CAP_SYS_RESOURCE, which the code lacks"),
        "privileges": (Y, "no capabilities, no_new_privs (setuid binaries do not elevate)"
                       + (", uid 65534, never root" if root else ", the worker's uid in a user namespace")),
        "leftover_process": (Y, "every descendant of the zygote is killed after the run"),
        "close_stdout": (Y, "the zygote waits for the process, not for end of file"),
        "fd_leak": (Y, "the child closes every descriptor but 0-2 and its status pipe (3)"),
        "env_leak": (Y, "the code's environment is built from scratch; the zygote started with PATH and LANG only"),
        "snapshot_symlink": (Y, "a snapshot with a link out is refused before the source removes anything"),
        "ptrace_zygote": (Y, "the zygote is not dumpable (and holds capabilities the code lacks): no ptrace, "
                             "no /proc/<zygote>/mem, fd or environ"),
        "keyring": (Y, "seccomp: add_key, request_key and keyctl fail with EPERM (keyrings are per uid, "
                       "shared by every action); so does mq_open"),
    }
    nproc = "RLIMIT_NPROC" + (" (uid 65534: shared by all sandboxes of the node)" if root else
                              " (counted in the sandbox's user namespace)" if isolated else
                              " over the worker uid's own tasks")
    c["fork_bomb"] = (Y, f"{nproc} and the leftover kill")
    c["fork_bomb_libc"] = (Y, f"{nproc}: the kernel counts libc's fork too")
    if isolated:
        c["file_flood"] = (Y, "the working dir, /tmp and /dev/shm are one tmpfs with work_files inodes: file_limit")
        c["disk_fill"] = (Y, "one tmpfs of work_bytes for all writable places: file_limit")
        c["persist_writable"] = (Y, "each action gets a fresh tmpfs for /tmp, /dev/shm and the working dir; "
                                 "everything else is read-only")
        c["write_outside"] = (Y, "every mount but the action's tmpfs is read-only")
        c["network"] = (Y, "own network namespace: only a down loopback")
        c["kill_processes"] = (Y, "own PID namespace, the zygote is its PID 1: nothing else is visible")
        c["proc_worker"] = (Y, "own PID namespace and /proc: the worker's command line and environment "
                            "are not there")
        c["sysv_ipc"] = (Y, "own IPC namespace per sandbox; one an action left System V objects in is replaced, "
                            "POSIX queues are refused (seccomp)")
    else:
        c["file_flood"] = (N, "no mount namespace: the working dir is a host dir without an inode quota")
        c["disk_fill"] = (N, "no mount namespace: only RLIMIT_FSIZE per file")
        c["persist_writable"] = (N, "no mount namespace: /tmp and /dev/shm are the host's")
        c["write_outside"] = (N, "no mount namespace: the code can write whatever the worker's uid can")
        c["network"] = (N, "no network namespace: the code can connect")
        c["kill_processes"] = (N, "no PID namespace: the code can signal the worker (same uid)")
        c["proc_worker"] = (N, "no PID namespace: the worker's /proc (command line, environment) is readable")
        c["sysv_ipc"] = (N, "no IPC namespace: System V shared memory outlives the action")
    gpus = gpu_device_nodes()
    if not gpus:
        c["gpu_devices"] = (Y, "no GPU device node on this host")
    elif backend == "bwrap":
        c["gpu_devices"] = (Y, "bwrap's own /dev holds no GPU device node")
    elif isolated:
        c["gpu_devices"] = (Y, "own mount namespace: /dev/null is bound over each GPU device node "
                               "(/dev/nvidia*, /dev/kfd), an empty tmpfs over /dev/dri")
    else:
        c["gpu_devices"] = (N, "no mount namespace: the host's GPU device nodes are there (the driver makes them "
                               "0666), so the code can use the reward models' GPUs; CUDA_VISIBLE_DEVICES is empty "
                               "in its environment, which only a cooperating program honours")
    if backend == "bwrap":
        c["read_host_files"] = (Y, "only /usr, the Python prefix and named ro_binds are mounted")
    elif root:
        c["read_host_files"] = (P, "the code runs as uid 65534: files the permissions deny to it "
                                "(/etc/shadow, 0600 files) are closed, world-readable files are not")
    else:
        c["read_host_files"] = (N, "the code runs as the worker's uid and sees the host's files: it can "
                                "read what the worker can")
    return {t: Containment(t, *c[t]) for t in THREATS}
