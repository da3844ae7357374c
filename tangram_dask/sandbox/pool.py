"""A worker's warm pool of sandboxes.

The pool keeps ``size`` sandboxes started; background *starter* threads (at most
``max_starting``, so at most that many start at once) fill it, replace the ones
recycled, and sweep expired trajectory dirs. :meth:`SandboxPool.acquire` hands
out a ready one (microseconds when warm; a cold start when none is) with the
CPUs granted to the action; :meth:`Lease.release` resets it for the next
action (its zygote already dropped the action's tmpfs), or recycles it after ``max_uses`` actions
or on any sign of damage. A sandbox never goes from one trajectory to another
with state in it: a trajectory's dir is moved in and out around its action.

All methods are blocking and thread-safe; call them from worker threads, never
from the event loop. The starter threads live as long as the pool: a sandbox
dies with the thread that started it (``PR_SET_PDEATHSIG``), so no short-lived
thread ever starts one.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import queue
import shutil
import stat
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from ..errors import SandboxError
from .backends import (Sandbox, _unreadable_by, choose_backend, code_uid, containment, namespaces_available,
                       resolve_python)
from .options import Limits, PoolOptions
from .result import RunResult
from .workspace import Workspaces

logger = logging.getLogger("tangram_dask.sandbox")


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool, for dashboards and tests."""

    backend: str
    size: int
    ready: int
    in_use: int
    starting: int
    started: int
    recycled: int
    failed_starts: int
    trajectories: int
    network: str


class Lease:
    """One sandbox lent to one action, with its CPUs. Release it exactly once (twice is safe)."""

    def __init__(self, pool: "SandboxPool", box: Sandbox, cpus: tuple[int, ...], trajectory: str | None,
                 acquire_s: float):
        self.pool = pool
        self.sandbox = box
        self.cpus = cpus
        self.trajectory = trajectory
        self.acquire_s = acquire_s
        self._released = False

    @property
    def units(self) -> int:
        return len(self.cpus)

    @staticmethod
    def _checked_files(files: Mapping[str, str | bytes]) -> dict[str, bytes]:
        """Files for the working dir (paths relative to it), checked here, written by the sandbox."""
        out = {}
        for rel, content in files.items():
            p = PurePosixPath(rel)
            if p.is_absolute() or not p.parts or ".." in p.parts:
                raise SandboxError(f"file name {rel!r}: must be a relative path inside the working dir "
                                   "(no leading '/', no '..')")
            out[str(p)] = content.encode() if isinstance(content, str) else bytes(content)
        return out

    def run(self, *, code: str | None = None, argv: list[str] | None = None, stdin: str | bytes | None = None,
            files: Mapping[str, str | bytes] | None = None, env: Mapping[str, str] | None = None,
            limits: Limits | None = None) -> RunResult:
        """Run code (Python source) or a command (argv) in this lease's sandbox."""
        if self._released:
            raise SandboxError("this sandbox lease was released; acquire a new one from the pool")
        if (code is None) == (argv is None):
            raise SandboxError("pass exactly one of code= (Python source) or argv= (a command)")
        if argv is not None and (not isinstance(argv, (list, tuple)) or not argv
                                 or not all(isinstance(a, str) for a in argv)):
            raise SandboxError(f"command {argv!r}: must be a non-empty list of strings, e.g. ['pytest', '-x']")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        req = {"code": code, "argv": list(argv) if argv is not None else None, "stdin": data,
               "env": dict(env or {}), "files": self._checked_files(files or {})}
        return self.sandbox.run(req, limits or self.pool.options.limits, self.cpus,
                                stateful=self.trajectory is not None)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool._release(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class SandboxPool:
    """Warm sandboxes for one worker. ``SandboxPool(size=2).start()``, or a ``with`` block."""

    #: the name of the root dir made when the options name none (the worker plugin adds the worker's name)
    root_prefix = "tangram-sandbox-"

    def __init__(self, options: PoolOptions | None = None, **kwargs: Any):
        if options is not None and kwargs:
            raise SandboxError("pass either options= or keyword options, not both")
        self.options = options if options is not None else PoolOptions.from_kwargs(**kwargs)
        self.size = self.options.size or 1
        self.backend: type[Sandbox] | None = None
        self.root: Path | None = None
        self.workspaces: Workspaces | None = None
        self._own_root = False
        self._lock_fd: int | None = None  # the root's owner lock (lock_root), held while the pool lives
        self._cond = threading.Condition()
        self._ready: deque[Sandbox] = deque()
        self._boxes: set[Sandbox] = set()
        self._in_use = 0
        self._starting = 0
        self._waiters = 0
        self._started = 0
        self._recycled = 0
        self._failed = 0
        self._failing = 0  # consecutive failed starts
        self._last_error: BaseException | None = None
        self._closed = False
        self._jobs: queue.Queue[tuple[str, Sandbox | None] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count(1)
        self._cpu_load = {c: 0 for c in sorted(os.sched_getaffinity(0))} if hasattr(os, "sched_getaffinity") else {}
        self._network = "unknown"

    # -- life -------------------------------------------------------------------
    def start(self) -> "SandboxPool":
        """Pick the backend, make the root dir, start filling in the background; returns at once."""
        if self.backend is not None:
            return self
        backend = choose_backend(self.options.backend)
        uid = code_uid(self.options, backend.name)  # raises now, naming the fix, rather than on every start
        if self.options.strict and not namespaces_available(backend.name):
            raise SandboxError(f"sandbox option strict=True: the {backend.name} backend has no mount "
                               "namespace here, so actions could leave files in /tmp or /dev/shm for the next; "
                               "allow unprivileged user namespaces, run the worker as root, or install bubblewrap")
        # the interpreter, chosen once here (not by every sandbox): one the code's uid can run
        self.options = replace(self.options, python=resolve_python(self.options, backend.name))
        if self.options.root is None:
            self.root = default_root(uid, self.root_prefix, process=backend.name == "process")
            self._own_root = True
            self._lock_fd = lock_root(self.root)
            gone = purge_stale_roots(self.root.parent, keep=self.root)
            if gone:
                logger.info("tangram sandbox pool: removed %d root(s) left by pools whose worker died: %s",
                            len(gone), ", ".join(map(str, gone)))
        else:
            self.root = Path(self.options.root)
            self.root.mkdir(parents=True, exist_ok=True)
        try:
            os.chmod(self.root, 0o711)
            (self.root / "boxes").mkdir(exist_ok=True, mode=0o711)
        except BaseException:
            if self._own_root:
                shutil.rmtree(self.root, ignore_errors=True)
            self._release_lock()
            raise
        self.backend = backend
        self.workspaces = Workspaces(self.root / "trajectories", uid, self.options.trajectory_ttl_s)
        self._uid = uid
        threats = containment(self.backend.name, self.options, isolated=namespaces_available(self.backend.name))
        weak = [f"{c.threat} ({c.level}: {c.why})" for c in threats.values() if not c.contained]
        logger.info("tangram sandbox pool: backend=%s size=%d max_starting=%d code uid=%s root=%s",
                    self.backend.name, self.size, self.options.max_starting,
                    "worker's own" if uid is None else uid, self.root)
        if weak:
            logger.warning("tangram sandbox backend %r does not fully contain: %s", self.backend.name, "; ".join(weak))
        for i in range(self.options.max_starting):
            t = threading.Thread(target=self._starter, name=f"tangram-sandbox-starter-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        with self._cond:
            self._plan()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until ``size`` sandboxes are ready (or the timeout passes); True if they are."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.options.start_timeout_s)
        with self._cond:
            failed_before = self._failed
            while len(self._ready) < self.size:
                self._check_open()
                self._raise_if_failing(failed_before)
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """Stop every sandbox (running ones too) and the threads; remove the root if the pool made it."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            boxes = list(self._boxes)
            self._ready.clear()
            self._cond.notify_all()
        # The sandboxes first, while the starter threads live: a sandbox dies with the thread that
        # started it (PR_SET_PDEATHSIG), so stopping the threads first SIGKILLed every zygote before
        # its goodbye (no clean-up of its own), and the goodbye met a closed pipe (EPIPE). A box a
        # starter finishes after this point is closed by that starter (``_start_one`` sees ``_closed``).
        # Every zygote is asked first, then each is waited for: they exit together, within one 2 s grace
        # shared by all (one that does not answer is killed then; a grace each made N hung ones N x 2 s).
        for box in boxes:
            box.goodbye()
        grace = time.monotonic() + 2.0
        for box in boxes:
            box.close(wait_s=max(0.0, grace - time.monotonic()))
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=10)
        if self._own_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self._release_lock()

    def _release_lock(self) -> None:
        """Let the root's owner lock go (``lock_root``): after the root is removed, or where it could not be set up."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "SandboxPool":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- lending ------------------------------------------------------------------
    def acquire(self, units: int = 1, trajectory: str | None = None, timeout: float | None = None) -> Lease:
        """A ready sandbox with ``units`` CPUs; with ``trajectory``, its working dir is that trajectory's."""
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise SandboxError(f"units = {units!r}: must be a whole number >= 1")
        if self.backend is None:
            self.start()
        t0 = time.perf_counter()
        deadline = time.monotonic() + (timeout if timeout is not None else self.options.start_timeout_s)
        with self._cond:
            self._check_open()
            self._waiters += 1
            failed_before = self._failed
            try:
                while not self._ready:
                    self._plan()
                    self._raise_if_failing(failed_before)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SandboxError(f"no sandbox became ready within {deadline - t0:.1f} s "
                                           f"({self._starting} starting, {self._in_use} in use); raise "
                                           "max_starting or size, or check the worker's load")
                    self._cond.wait(left)
                    self._check_open()
                box = self._ready.popleft()
            finally:
                self._waiters -= 1
            self._in_use += 1
            cpus = self._take_cpus(units)
            self._plan()
        acquire_s = time.perf_counter() - t0
        lease = Lease(self, box, cpus, trajectory, acquire_s)
        if trajectory is not None:
            try:
                assert self.workspaces is not None
                self.workspaces.checkout(trajectory, box.work, timeout_s=self.options.start_timeout_s)
            except BaseException:
                lease.trajectory = None
                lease.release()
                raise
        return lease

    def run(self, *, units: int = 1, trajectory: str | None = None, **kwargs: Any) -> RunResult:
        """Acquire, run once, release."""
        with self.acquire(units, trajectory) as lease:
            return lease.run(**kwargs)

    def _release(self, lease: Lease) -> None:
        box = lease.sandbox
        if lease.trajectory is not None and self.workspaces is not None:
            try:
                self.workspaces.checkin(lease.trajectory, box.work)
            except OSError as e:
                box.damaged = f"the trajectory dir could not be moved back: {e}"
        keep = not self._closed and box.reset()
        with self._cond:
            self._in_use -= 1
            for c in lease.cpus:
                if c in self._cpu_load:
                    self._cpu_load[c] -= 1
            total = len(self._ready) + self._in_use + self._starting
            if keep and not self._closed and total < self.size:
                self._ready.append(box)
            else:
                self._recycled += 1
                self._boxes.discard(box)
                if self._closed:
                    box.close()
                else:
                    self._jobs.put(("close", box))
            self._plan()
            self._cond.notify_all()

    # -- trajectories -------------------------------------------------------------
    def end_trajectory(self, trajectory: str) -> bool:
        """Remove a trajectory's working dir on this node; True if there was one."""
        return self._ws().end(trajectory)

    def has_trajectory(self, trajectory: str) -> bool:
        """Whether this node holds the trajectory's working dir."""
        return self._ws().path(trajectory).exists()

    def holds_trajectory(self, trajectory: str) -> bool:
        """Whether this node holds the trajectory's working dir, or a running action of it has it checked out."""
        return self._ws().holds(trajectory)

    def snapshot_trajectory(self, trajectory: str, timeout_s: float | None = None) -> bytes:
        """Its dir as tar.gz bytes, once no action of it holds the dir (waits up to ``timeout_s``)."""
        return self._ws().snapshot(trajectory, timeout_s)

    def restore_trajectory(self, trajectory: str, data: bytes) -> None:
        self._ws().restore(trajectory, data)

    def sweep(self) -> list[str]:
        """Remove trajectory dirs idle past the TTL now (the starters also do it periodically)."""
        return self._ws().sweep()

    def _ws(self) -> Workspaces:
        if self.workspaces is None:
            self.start()
        assert self.workspaces is not None
        return self.workspaces

    # -- statistics -----------------------------------------------------------------
    def statistics(self) -> PoolStats:
        with self._cond:
            return PoolStats(
                backend=self.backend.name if self.backend else "", size=self.size, ready=len(self._ready),
                in_use=self._in_use, starting=self._starting, started=self._started, recycled=self._recycled,
                failed_starts=self._failed,
                trajectories=len(self.workspaces.trajectories()) if self.workspaces else 0,
                network=self._network,
            )

    def resize(self, size: int) -> None:
        """Keep ``size`` sandboxes from now on (extra ones are closed as they come back)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise SandboxError(f"size = {size!r}: must be a whole number >= 1")
        with self._cond:
            self.size = size
            while len(self._ready) + self._in_use + self._starting > size and self._ready:
                box = self._ready.pop()
                self._boxes.discard(box)
                self._recycled += 1
                self._jobs.put(("close", box))
            self._plan()

    # -- internals --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox pool is closed (the worker is shutting down); retry the action")

    def _raise_if_failing(self, failed_before: int) -> None:
        """Give up waiting once two starts in a row failed while we waited (the cause is not transient)."""
        if self._failed - failed_before >= 2 and self._failing >= 2 and self._last_error is not None:
            err = self._last_error
            raise SandboxError(f"could not start a sandbox: {err}") from err

    def _plan(self) -> None:
        """Under the lock: queue the starts needed to keep ``size`` and to serve the waiters."""
        if self._closed:
            return
        total = len(self._ready) + self._in_use + self._starting
        want = max(self.size - total, self._waiters - len(self._ready) - self._starting, 0)
        for _ in range(want):
            self._starting += 1
            self._jobs.put(("start", None))

    def _take_cpus(self, units: int) -> tuple[int, ...]:
        if not self._cpu_load:
            return ()
        chosen = sorted(self._cpu_load, key=lambda c: (self._cpu_load[c], c))[:units]
        for c in chosen:
            self._cpu_load[c] += 1
        return tuple(sorted(chosen))

    def _starter(self) -> None:
        interval = min(60.0, self.options.trajectory_ttl_s / 4)
        next_sweep = time.monotonic() + interval
        while True:
            try:
                job = self._jobs.get(timeout=max(0.05, next_sweep - time.monotonic()))
            except queue.Empty:
                job = ("sweep", None)
            if job is None:
                return
            what, box = job
            if what == "close" and box is not None:
                box.close()
            elif what == "start":
                self._start_one()
            if time.monotonic() >= next_sweep and self.workspaces is not None:
                next_sweep = time.monotonic() + interval
                gone = self.workspaces.sweep()
                if gone:
                    logger.info("tangram sandbox: removed %d trajectory dirs idle past the TTL", len(gone))

    def _start_one(self) -> None:
        assert self.backend is not None and self.root is not None
        if self._failing:
            time.sleep(min(0.1 * 2 ** self._failing, 30.0))  # a backend that fails: do not spin
        box = self.backend(self.root / "boxes" / f"b{next(self._ids)}", self.options)
        try:
            if self._closed:
                raise SandboxError("pool closed")
            box.start()
        except BaseException as e:
            box.close()
            with self._cond:
                self._starting -= 1
                if not self._closed:
                    self._failed += 1
                    self._failing += 1
                    self._last_error = e
                    if self._failing == 1 or self._failing % 10 == 0:
                        logger.warning("tangram sandbox: a %s sandbox failed to start (%d in a row): %s",
                                       self.backend.name, self._failing, e)
                    self._plan()  # try again, after a back-off (see above)
                self._cond.notify_all()
            return
        with self._cond:
            self._starting -= 1
            if self._closed:
                box.close()
                return
            self._started += 1
            self._failing = 0
            self._network = str(box.info.get("net", "unknown"))
            self._boxes.add(box)
            self._ready.append(box)
            self._cond.notify_all()


def default_root(uid: int | None, prefix: str = SandboxPool.root_prefix, *, process: bool = True) -> Path:
    """A new, empty root for a pool whose options name none: 0711, under /tmp, owned by this process.

    Under /tmp because a sandbox with a mount namespace gets a fresh /tmp per action, so
    no sandbox's code ever sees this dir (nor, through it, another sandbox's files);
    0711 so the code's uid (65534 for a root worker's process backend) can pass through
    to its own working dir, but not list the others. The parent must be a directory
    only root can replace: root-owned and sticky where anyone may write in it (a
    stranger could otherwise move the new dir away and put a link in its place).
    ``mkdtemp`` makes the dir (exclusive create, 0700), checked to be ours before
    ``chmod``. Falls back to ``tempfile.gettempdir()`` where /tmp does not pass.
    """
    reasons = []
    for base in dict.fromkeys(["/tmp", tempfile.gettempdir()]):
        why = _unsafe_parent(base, uid)
        if why:
            reasons.append(f"{base}: {why}")
            continue
        root = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        st = os.lstat(root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            raise SandboxError(f"the sandbox root {root} just made is not a 0700 dir owned by uid {os.geteuid()}; "
                               "pass root= a directory of your own")
        os.chmod(root, 0o711)
        if base != "/tmp" and process:
            logger.warning("tangram sandbox: root %s is not under /tmp (%s): the process backend's code could "
                           "reach it; pass root= a dir under /tmp", root, "; ".join(reasons))
        return root
    raise SandboxError(f"no safe directory for the sandbox root ({'; '.join(reasons)}); pass root= a directory "
                       "only this worker's user may write, which the code's uid may traverse (chmod 0711)")


#: in a root the pool made: the file whose flock the pool holds for its life (lock_root)
OWNER_LOCK = ".owner.lock"
#: a root's lock younger than this is never taken as stale (its pool may be between making it and locking it)
STALE_AFTER_S = 60.0


def lock_root(root: Path) -> int | None:
    """Hold an exclusive ``flock`` on ``root/.owner.lock`` for the pool's life; the fd, or None where the file system
    has no flock. The lock ends with the process: a root whose lock can be taken belongs to no live pool (as
    distributed's ``WorkSpace`` tells its stale worker directories)."""
    fd = None
    try:
        fd = os.open(root / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as e:
        if fd is not None:
            os.close(fd)
        logger.debug("tangram sandbox pool: no owner lock in %s (%s)", root, e)
        return None


def purge_stale_roots(base: Path, keep: Path, prefix: str = SandboxPool.root_prefix) -> list[Path]:
    """Remove the roots under ``base`` that pools made (``prefix``, owned by this uid, with an owner lock older than
    ``STALE_AFTER_S``) whose lock can be taken: their worker died without closing them (SIGKILL, OOM). A root with
    no lock file (made by another program, or before the lock existed), of another uid, or whose lock is held, is
    left. Returns those removed; never raises."""
    removed: list[Path] = []
    me, now = os.geteuid(), time.time()
    try:
        candidates = [d for d in base.iterdir() if d.name.startswith(prefix) and d != keep]
    except OSError:
        return removed
    for d in candidates:
        fd = None
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
                continue
            lst = os.lstat(d / OWNER_LOCK)
            if not stat.S_ISREG(lst.st_mode) or lst.st_uid != me or now - lst.st_mtime < STALE_AFTER_S:
                continue
            fd = os.open(d / OWNER_LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live pool: BlockingIOError, left
            shutil.rmtree(d, ignore_errors=True)  # under the lock: another pool purging too skips it
            removed.append(d)
        except OSError:
            continue
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _unsafe_parent(base: str, uid: int | None) -> str:
    """Why ``base`` may not hold a pool's root; '' if it may."""
    try:
        st = os.stat(base)
    except OSError as e:
        return str(e)
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid not in (0, os.geteuid(), _unmapped_uid()):
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return "writable by others and not sticky"
    if not os.access(base, os.W_OK | os.X_OK):
        return "not writable by this worker"
    if uid is not None:
        blocked = _unreadable_by(base, uid, final=0o1)
        if blocked:
            return f"uid {uid} (the code's) cannot pass {blocked}"
    return ""


def _unmapped_uid() -> int:
    """How a uid outside this user namespace's map shows (root's /tmp, seen from a user namespace); -1
    in the initial namespace, where every uid is itself."""
    try:
        with open("/proc/self/uid_map") as f:
            if f.read().split() == ["0", "0", "4294967295"]:
                return -1
        with open("/proc/sys/kernel/overflowuid") as f:
            return int(f.read())
    except (OSError, ValueError):
        return -1
