"""Stateful working directories for ``affinity='trajectory'`` actions.

A trajectory's directory (a repository checkout, say) lives on the node under
the pool's root, outside every sandbox. For an action of that trajectory it is
*renamed* into the sandbox's working-dir slot (O(1), same filesystem) and renamed
back afterwards, so a sandbox never sees another trajectory's files and the
directory survives the sandbox being recycled.

``snapshot`` packs it (tar.gz bytes) so the scheduler can ``restore`` it on
another node when it moves the trajectory; ``end`` removes it; ``sweep``
removes those unused for longer than the TTL (trajectories never ended).
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import re
import shutil
import tarfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..errors import SandboxError

_SAFE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")


class Workspaces:
    """The trajectory directories of one node (one pool)."""

    def __init__(self, root: str | os.PathLike[str], uid: int | None, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.root = Path(root)
        self.uid = uid
        self.ttl_s = ttl_s
        self.clock = clock
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._last_used: dict[str, float] = {}

    # -- naming ---------------------------------------------------------------
    def path(self, trajectory: str) -> Path:
        if not isinstance(trajectory, str) or not trajectory:
            raise SandboxError(f"trajectory id {trajectory!r}: must be a non-empty string")
        if _SAFE.fullmatch(trajectory):
            return self.root / trajectory
        name = "h-" + hashlib.sha256(trajectory.encode()).hexdigest()[:32]
        return self.root / name

    def _lock(self, trajectory: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(trajectory, threading.Lock())

    def _acquire(self, trajectory: str, timeout_s: float | None) -> threading.Lock | None:
        """The trajectory's lock, acquired (None past ``timeout_s``; None waits for good). The lock waited on may
        have left the books meanwhile (its holder, end() or a sweep, dropped it): then it is the trajectory's lock
        again if nobody made a new one, else that new one is waited on. Before, an action that waited while a sweep
        removed its trajectory held a lock no longer in the books: the next action of it took a new one at once
        (two actions in one dir), and holds() said the node had no dir for it while the action had it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            lock = self._lock(trajectory)
            left = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            if not lock.acquire(timeout=left):
                return None
            with self._guard:
                if self._locks.setdefault(trajectory, lock) is lock:
                    return lock
            lock.release()

    def holds(self, trajectory: str) -> bool:
        """Whether the trajectory's dir is on this node: where it lives, or checked out by a running action."""
        p = self.path(trajectory)
        if p.exists():
            return True
        with self._guard:
            lock = self._locks.get(trajectory)
        # checked out, or checked in between the two looks (checkin renames the dir back, then lets the lock go)
        return lock is not None and lock.locked() or p.exists()

    def trajectories(self) -> list[str]:
        with self._guard:
            return sorted(self._last_used)

    # -- an action's use --------------------------------------------------------
    def checkout(self, trajectory: str, slot: Path, timeout_s: float) -> None:
        """Move the trajectory's dir into ``slot`` (made if new); waits for its previous action."""
        lock = self._acquire(trajectory, timeout_s)
        if lock is None:
            raise SandboxError(f"trajectory {trajectory!r}: its previous action still holds its working dir "
                               f"after {timeout_s:g} s; run one action of a trajectory at a time")
        try:
            src = self.path(trajectory)
            if not src.exists():
                self._make_root()
                src.mkdir(mode=0o700)
                self._chown(src)
            if slot.exists():
                shutil.rmtree(slot)
            os.rename(src, slot)
            with self._guard:
                self._last_used[trajectory] = self.clock()
        except BaseException:
            lock.release()
            raise

    def checkin(self, trajectory: str, slot: Path) -> None:
        """Move the dir back out of ``slot`` after the action; lets the next action of it go."""
        lock = self._lock(trajectory)
        try:
            if slot.is_dir() and not slot.is_symlink():
                os.rename(slot, self.path(trajectory))
            with self._guard:
                self._last_used[trajectory] = self.clock()
        finally:
            if lock.locked():
                lock.release()

    # -- moving and ending ------------------------------------------------------
    def snapshot(self, trajectory: str, timeout_s: float | None = None) -> bytes:
        """The trajectory's dir as tar.gz bytes; :class:`SandboxError` if it has none here.

        The dir stays here. A dir that no restore would accept (a link pointing out of
        it, a device) is refused now, with :class:`SandboxError`, before anyone removes
        anything: the trajectory keeps its files on this node. While an action of the trajectory
        holds the dir, it waits for the action to give it back (at most ``timeout_s``, then
        :class:`SandboxError`).
        """
        lock = self._acquire(trajectory, timeout_s)
        if lock is None:
            raise SandboxError(f"trajectory {trajectory!r}: an action of it still holds its working dir here after "
                               f"{timeout_s:g} s, so it cannot move yet; run one action of a trajectory at a time")
        try:
            src = self.path(trajectory)
            if not src.is_dir():  # an empty snapshot restored elsewhere would wipe the real dir there
                raise SandboxError(f"trajectory {trajectory!r} has no working dir on this node; snapshot it "
                                   "where its actions ran")
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
                tar.add(src, arcname=".", recursive=True)  # symlinks are stored as links, not followed
            data = buf.getvalue()
        finally:
            lock.release()
        try:
            check_snapshot(data)
        except SandboxError as e:
            raise SandboxError(f"trajectory {trajectory!r} cannot move: {e}; its working dir stays on this "
                               "node") from None
        return data

    def restore(self, trajectory: str, data: bytes) -> None:
        """Replace the trajectory's dir with a snapshot (from another node); a bad one changes nothing."""
        try:
            members = check_snapshot(data)
        except SandboxError as e:
            raise SandboxError(f"trajectory {trajectory!r}: the snapshot cannot be restored ({e}); "
                               "pass bytes made by snapshot_trajectory") from None
        lock = self._acquire(trajectory, None)
        with _held(lock):
            dst = self.path(trajectory)
            # a name no trajectory's dir can have (none starts with a dot): "<name>.restore" was trajectory
            # "<name>.restore"'s own dir, removed here without its lock (helper-48's review)
            tmp = dst.with_name("." + dst.name + ".restore")
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                self._make_root()
                tmp.mkdir(mode=0o700)
                _extract(data, members, tmp)
                os.chmod(tmp, 0o700)
                for dirpath, dirnames, filenames in os.walk(tmp):
                    for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                        self._chown(Path(name))
            except (tarfile.TarError, OSError, EOFError) as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise SandboxError(f"trajectory {trajectory!r}: the snapshot could not be restored here ({e}); "
                                   "the worker it came from still holds the dir") from e
            shutil.rmtree(dst, ignore_errors=True)
            os.rename(tmp, dst)
            with self._guard:
                self._last_used[trajectory] = self.clock()

    def end(self, trajectory: str) -> bool:
        """Remove the trajectory's dir; True if it had one here. Safe to call twice."""
        with _held(self._acquire(trajectory, None)):
            p = self.path(trajectory)
            existed = p.exists()
            shutil.rmtree(p, ignore_errors=True)
            with self._guard:
                self._last_used.pop(trajectory, None)
                self._locks.pop(trajectory, None)
            return existed

    def sweep(self) -> list[str]:
        """Remove trajectories unused for longer than the TTL; the ids removed."""
        now = self.clock()
        with self._guard:
            expired = [t for t, last in self._last_used.items() if now - last > self.ttl_s]
        gone = []
        for t in expired:
            with self._guard:
                lock = self._locks.get(t)
            if lock is None or not lock.acquire(blocking=False):  # ended meanwhile, or in use right now
                continue
            with self._guard:
                current = self._locks.get(t) is lock
                # still idle: an action of it may have run (and checked in) since the list above was made, while this
                # sweep removed others; before, the sweep went by its list and removed the dir it had just written to
                last = self._last_used.get(t)
                idle = last is not None and self.clock() - last > self.ttl_s
            if not current or not idle:  # used again, or ended meanwhile (and its id maybe in use under a new lock)
                lock.release()
                continue
            try:
                shutil.rmtree(self.path(t), ignore_errors=True)
                with self._guard:
                    self._last_used.pop(t, None)
                    # its lock goes too, as end() drops it: a trajectory never ended (an abandoned rollout) kept a
                    # lock here for good, one more per such trajectory for as long as the worker ran
                    if self._locks.get(t) is lock:
                        del self._locks[t]
                gone.append(t)
            finally:
                lock.release()
        return gone

    def _make_root(self) -> None:
        """The dir holding the trajectories' dirs: 0700, the worker's own (the code never passes it: a
        trajectory's dir is moved into its sandbox for its action)."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(mode=0o700, exist_ok=True)

    def _chown(self, p: Path) -> None:
        if self.uid is not None:
            os.lchown(p, self.uid, self.uid)


def check_snapshot(data: bytes) -> list[tarfile.TarInfo]:
    """The members of a snapshot, if every one stays inside it; else :class:`SandboxError` naming it.

    Allowed: dirs, regular files, hard links to earlier files, symlinks whose target
    (relative) stays inside. Refused: absolute or ``..`` names, members under a
    symlink, links out, devices, fifos. Works on every Python 3.11 (no
    ``extractall(filter=...)``, which 3.11.2 lacks).
    """
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise SandboxError(f"not a snapshot: {e}") from None
    links: set[str] = set()
    files: set[str] = set()
    out = []
    for m in members:
        name = _inside(m.name)
        if name is None:
            raise SandboxError(f"member {m.name!r} is outside the dir")
        if any("/".join(name.split("/")[:i]) in links for i in range(1, name.count("/") + 1)):
            raise SandboxError(f"member {m.name!r} lies under a symlink")
        if m.issym():
            target = m.linkname
            if target.startswith("/") or _inside(posixpath.join(posixpath.dirname(name), target)) is None:
                raise SandboxError(f"symlink {m.name!r} -> {target!r} points out of the dir")
            links.add(name)
        elif m.islnk():
            if _inside(m.linkname) not in files:
                raise SandboxError(f"hard link {m.name!r} -> {m.linkname!r} does not name a file of the dir")
        elif m.isreg():
            files.add(name)
        elif not m.isdir():
            raise SandboxError(f"member {m.name!r} is a device, fifo or other special file")
        out.append(m)
    return out


def _inside(name: str) -> str | None:
    """``name`` normalised relative to the dir ('' for the dir itself), or None if it leaves it."""
    if name.startswith("/"):
        return None
    norm = posixpath.normpath(name)
    if norm == ".":
        return ""
    if norm == ".." or norm.startswith("../"):
        return None
    return norm


def _extract(data: bytes, members: list[tarfile.TarInfo], root: Path) -> None:
    """Write checked members under ``root``: never following a link, modes without setuid bits."""
    dirs = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in members:
            name = _inside(m.name)
            assert name is not None
            path = root / name if name else root
            if m.isdir():
                path.mkdir(parents=True, exist_ok=True)
                dirs.append((path, m.mode & 0o777))
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            if m.issym():
                os.symlink(m.linkname, path)
            elif m.islnk():
                os.link(root / _inside(m.linkname), path, follow_symlinks=False)  # type: ignore[operator]
            else:
                src = tar.extractfile(m)
                assert src is not None
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with src, os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(src, out)
                os.chmod(path, m.mode & 0o777)
                os.utime(path, (m.mtime, m.mtime))
    for path, mode in reversed(dirs):
        os.chmod(path, mode | 0o700)


@contextmanager
def _held(lock: threading.Lock):
    """A lock already acquired (:meth:`Workspaces._acquire`), released at the block's end."""
    try:
        yield lock
    finally:
        lock.release()
