"""Isolation backends: one small interface, ``start``, ``run``, ``reset``, ``close``.

A :class:`Sandbox` is a warm *zygote* (``_zygote.py``): a Python process that has
already started inside its isolation, with a private working directory and
/tmp, and that runs each action in a fresh forked child (so Python is already
imported) under per-action limits. After a run it kills whatever the code left
behind; :meth:`Sandbox.reset` wipes the directories for the next action.

Backends differ only in how the zygote is confined:

``bwrap``   bubblewrap: own mount, PID, network, IPC and UTS namespaces; the
            system read-only (only /usr, the Python prefix and named paths are
            visible), private /tmp and working dir, dies with the worker.
``process`` a plain child process, for where bubblewrap cannot run (an
            unprivileged pod): rlimits on CPU time, address space, processes,
            file size and open files, own session and process group, scrubbed
            environment; it runs the code as an unprivileged uid when the worker
            is root and puts itself in a new network namespace where allowed.

:func:`containment` says, per backend and per threat, what is contained here.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

from ..errors import SandboxError
from .options import Limits, PoolOptions
from .result import RunResult

logger = logging.getLogger("tangram_dask.sandbox")

_ZYGOTE_SRC = (Path(__file__).with_name("_zygote.py")).read_text()

#: The threats the hostile-code tests exercise, in the issue's order.
THREATS = ("infinite_loop", "fork_bomb", "memory", "file_size", "output_flood", "read_host_files",
           "write_outside", "network", "kill_processes", "leftover_process", "close_stdout")


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
    """The uid untrusted code runs as (None: the worker's own).

    Under ``process`` the code runs the host's interpreter directly, so a uid it
    cannot read the interpreter as is no use: ``uid='auto'`` then keeps the
    worker's uid (weaker: see :func:`containment`), an explicit uid is an error.
    (Under ``bwrap`` the interpreter's directories are mounted readable.)
    """
    if options.uid is None:
        return None
    if os.geteuid() != 0:
        if options.uid == "auto":
            return None
        raise SandboxError(f"sandbox option 'uid' = {options.uid!r}: switching user needs the worker to run "
                           "as root; run the worker as root or pass uid=None")
    uid = 65534 if options.uid == "auto" else int(options.uid)
    if backend == "process":
        blocked = _unreadable_by(options.python, uid)
        if blocked:
            if options.uid == "auto":
                return None
            raise SandboxError(f"sandbox option 'uid' = {uid}: the interpreter {options.python} is not "
                               f"readable by uid {uid} ({blocked} is closed to it); pass python= an "
                               "interpreter outside private dirs (e.g. /usr/bin/python3) or uid=None")
    return uid


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
    """Threads that ``uid`` owns now (RLIMIT_NPROC counts them all)."""
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
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
    #: where the working dir and /tmp are, as the code sees them (None: the host paths)
    inner_work: ClassVar[str | None] = None
    inner_tmp: ClassVar[str | None] = None

    def __init__(self, box_dir: str | os.PathLike[str], options: PoolOptions, sandbox_id: str = ""):
        self.options = options
        self.id = sandbox_id or Path(box_dir).name
        self.box = Path(box_dir)
        self.mnt = self.box / "mnt"          # bound at the working dir's parent
        self.work = self.mnt / "work"        # the code's working dir (swapped for a trajectory's)
        self.tmp = self.box / "tmp"          # the code's /tmp
        self.tmp_keep: set[str] = set()     # entries of /tmp that are mount points (kept by reset)
        self.uid = code_uid(options, self.name)
        self.uses = 0
        self.damaged = ""                    # why it must not be reused, if it must not
        self.info: dict[str, Any] = {}       # the zygote's "ready" message
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._lock = threading.Lock()

    # -- paths as the code sees them -----------------------------------------
    @property
    def work_path(self) -> str:
        return self.inner_work or str(self.work)

    @property
    def tmp_path(self) -> str:
        return self.inner_tmp or str(self.tmp)

    # -- the interface ---------------------------------------------------------
    def start(self) -> None:
        """Start the zygote and wait until it says it is ready."""
        for d in (self.box, self.mnt, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        for d in (self.box, self.mnt):
            os.chmod(d, 0o711)
        if self.uid is not None and self.inner_work is None:
            blocked = _unreadable_by(str(self.mnt), self.uid, final=0o1)
            if blocked:
                raise SandboxError(f"the sandbox directory {self.box} is not reachable by uid {self.uid} "
                                   f"({blocked} is closed to it); put the pool's root under a directory "
                                   "others may traverse (chmod o+x), or pass uid=None")
        self.new_workdir()
        os.chmod(self.tmp, 0o700)
        if self.uid is not None:
            os.chown(self.tmp, self.uid, self.uid)
        config = {
            "uid": self.uid,
            "env": self._env(),
            "preload": list(self.options.preload),
            **self._config(),
        }
        cmd = self._command(config)
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, cwd=self.box, env=self._host_env(),
                                          start_new_session=True, close_fds=True)
        except OSError as e:
            raise SandboxError(f"cannot start a {self.name} sandbox ({cmd[0]}): {e}; check that it is "
                               "installed and executable") from e
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

    def run(self, request: Mapping[str, Any], limits: Limits, cpus: tuple[int, ...] = ()) -> RunResult:
        """Run one action (``code`` or ``argv``) with these limits; never raises for the code's faults."""
        units = max(1, len(cpus))
        cpu_s = limits.cpu_s if limits.cpu_s is not None else limits.timeout_s * units + 1
        req = {
            "op": "run",
            "code": request.get("code"),
            "argv": request.get("argv"),
            "stdin": base64.b64encode(request.get("stdin") or b"").decode(),
            "env": {**(request.get("env") or {}), "OMP_NUM_THREADS": str(units), "TANGRAM_CPUS": str(units)},
            "cwd": self.work_path,
            "cpus": list(cpus),
            "timeout_s": limits.timeout_s,
            "cpu_s": cpu_s,
            "memory_bytes": limits.memory_bytes,
            "output_bytes": limits.output_bytes,
            "file_bytes": limits.file_bytes,
            "procs": limits.procs,
            "open_files": limits.open_files,
        }
        self.uses += 1
        t0 = time.monotonic()
        with self._lock:
            try:
                self._send(req)
                msg = self._recv(t0 + limits.timeout_s + 10.0)
            except OSError:
                msg = None
        if msg is None or msg.get("op") != "result":
            self.damaged = "the sandbox died or stopped answering during the run"
            return RunResult(reason="killed", exit_code=None, stdout="", stderr="",
                             wall_s=time.monotonic() - t0, cpu_s=0.0, backend=self.name, cpus=tuple(cpus),
                             detail=self.damaged + " (did the code kill its parent?); it was replaced")
        res = _result(msg, self.name, tuple(cpus), limits, command=bool(request.get("argv")))
        if not msg.get("clean", True):
            self.damaged = "processes left by the code could not all be killed"
        elif res.reason not in ("ok", "error") or res.leftovers_killed:
            self.damaged = f"the last run ended with {res.reason}" + (
                f" and {res.leftovers_killed} leftover processes" if res.leftovers_killed else "")
        return res

    def reset(self) -> bool:
        """Make the sandbox ready for another action; False: it must be recycled instead."""
        if self.damaged or not self.alive():
            return False
        if self.uses >= self.options.max_uses:
            return False
        try:
            self.new_workdir()
            _empty_dir(self.tmp, keep=self.tmp_keep)
        except OSError as e:
            self.damaged = f"its directories could not be wiped: {e}"
            return False
        return True

    def close(self) -> None:
        """Stop the zygote and everything under it; remove its directories. Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None:
            # a run in progress (the worker is shutting down): no goodbye, the kill below ends it
            if self._lock.acquire(blocking=False):
                try:
                    if proc.poll() is None:
                        self._send_to(proc, {"op": "exit"})
                    proc.wait(timeout=2)
                except (OSError, subprocess.TimeoutExpired):
                    pass
                finally:
                    self._lock.release()
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
        shutil.rmtree(self.box, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def new_workdir(self) -> None:
        """A fresh, empty working dir owned by the code's uid (wiping the old one)."""
        if self.work.is_symlink() or self.work.exists():
            if self.work.is_dir() and not self.work.is_symlink() and not any(os.scandir(self.work)):
                return
            _rmtree(self.work)
        self.work.mkdir(mode=0o700)
        if self.uid is not None:
            os.chown(self.work, self.uid, self.uid)

    def _env(self) -> dict[str, str]:
        bindir = os.path.dirname(self.options.python)
        return {
            "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": self.work_path,
            "TMPDIR": self.tmp_path,
            "LANG": "C.UTF-8",
            "USER": "sandbox",
            "PYTHONDONTWRITEBYTECODE": "1",
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
    """Bubblewrap: namespaces, read-only system, private /tmp and working dir."""

    name = "bwrap"
    inner_work = "/sandbox/work"
    inner_tmp = "/tmp"

    def _config(self) -> dict[str, Any]:
        return {"net_isolated": True}

    def _command(self, config: dict[str, Any]) -> list[str]:
        exe = _bwrap_path()
        if exe is None:
            raise SandboxError("bwrap is not installed: apt-get install -y bubblewrap, or use backend='process'")
        args = [exe, "--die-with-parent", "--new-session", "--clearenv",
                "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--hostname", "sandbox"]
        if os.geteuid() == 0:
            # the zygote keeps only what it needs to drop to the code's uid and kill leftovers
            args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                     "--cap-add", "CAP_KILL"]
        else:
            args += ["--unshare-user"]
        args += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        args += ["--perms", "0755", "--dir", "/etc"]  # made by bwrap, it would be 0700
        for etc in ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives"):
            args += ["--ro-bind-try", etc, etc]
        binds = [p for p in _python_paths(self.options.python) + list(self.options.ro_binds)
                 if not p.startswith("/usr/")]
        # an interpreter under /tmp (a checkout there) is bound after the private /tmp, over it
        under_tmp = [p for p in binds if p.startswith("/tmp/")]
        args += _ro_binds([p for p in binds if p not in under_tmp])
        args += ["--dev", "/dev", "--proc", "/proc",
                 "--bind", str(self.tmp), "/tmp", "--bind", str(self.mnt), "/sandbox"]
        args += _ro_binds(under_tmp)
        self.tmp_keep = {p.split("/")[2] for p in under_tmp}  # their mount points survive a reset
        if under_tmp:  # bwrap (root without CAP_DAC_OVERRIDE) must pass through it: a /tmp's usual mode
            os.chmod(self.tmp, 0o1777)
        args += ["--chdir", "/"]
        return [*args, "--", self.options.python, "-I", "-c", _ZYGOTE_SRC, json.dumps(config)]

    def _start_fix(self) -> str:
        return "run `bwrap --ro-bind / / true` to see why, or use backend='process'"


class ProcessSandbox(Sandbox):
    """A plain child process with rlimits, its own session, a scrubbed environment."""

    name = "process"

    def _config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"unshare_net": True, "parent_pid": os.getpid()}
        if self.uid is None and os.geteuid() != 0:
            cfg["nproc_base"] = _count_tasks(os.geteuid())
        return cfg

    def _command(self, config: dict[str, Any]) -> list[str]:
        return [self.options.python, "-I", "-c", _ZYGOTE_SRC, json.dumps(config)]


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


def containment(backend: str, options: PoolOptions | None = None, net_isolated: bool | None = None,
                ) -> dict[str, Containment]:
    """What ``backend`` contains on this machine, threat by threat, and why.

    ``net_isolated``: whether the process backend's zygote got its own network
    namespace (its "ready" message says; None: assume it did if root).
    """
    options = options or PoolOptions()
    uid = code_uid(options, backend)
    root = os.geteuid() == 0
    drop = uid is not None
    c: dict[str, tuple[str, str]] = {
        "infinite_loop": ("yes", "wall-clock timeout and RLIMIT_CPU; the zygote kills the process group"),
        "memory": ("yes", "RLIMIT_AS on each run"),
        "file_size": ("yes", "RLIMIT_FSIZE on each run"),
        "output_flood": ("yes", "the zygote stops reading at the output limit and kills the run"),
        "leftover_process": ("yes", "the zygote is a child subreaper: every descendant is killed after the run"),
        "close_stdout": ("yes", "the zygote waits for the process, not for end of file"),
    }
    nproc_ok = drop or not root
    c["fork_bomb"] = ("yes", "RLIMIT_NPROC (the code runs as a non-root uid) and the leftover kill") if nproc_ok \
        else ("no", "code running as root is exempt from RLIMIT_NPROC; only the timeout stops it")
    if backend == "bwrap":
        c["read_host_files"] = ("yes", "only /usr, the Python prefix and named ro_binds are mounted")
        c["write_outside"] = ("yes", "everything but the working dir and a private /tmp is read-only")
        c["network"] = ("yes", "own network namespace (--unshare-net): no interfaces but a down loopback")
        c["kill_processes"] = ("yes", "own PID namespace: nothing outside the sandbox is visible"
                               + ("; the zygote is root, the code is not" if drop else ""))
    else:
        if drop:
            c["read_host_files"] = ("partial", f"the code runs as uid {uid}: files the permissions deny to it "
                                    "(/etc/shadow, 0600 files) are hidden, world-readable files are not")
            c["write_outside"] = ("partial", f"uid {uid} cannot write the worker's files, but can write "
                                  "world-writable dirs such as /tmp and /dev/shm")
            c["kill_processes"] = ("partial", f"uid {uid} cannot signal the worker or the zygote, but can "
                                   "signal other sandboxes' code running as the same uid")
        else:
            c["read_host_files"] = ("no", "the code runs as the worker's uid and can read what the worker can")
            c["write_outside"] = ("no", "the code runs as the worker's uid and can write what the worker can")
            c["kill_processes"] = ("no", "the code runs as the worker's uid and can signal the worker")
        if net_isolated is None:
            net_isolated = root
        c["network"] = ("yes", "the zygote made its own network namespace (unshare(CLONE_NEWNET))") \
            if net_isolated else ("no", "no network namespace (unshare not permitted): the code can connect")
    return {t: Containment(t, *c[t]) for t in THREATS}
