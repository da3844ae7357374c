"""The warm process inside a sandbox: it runs each action in a fresh child.

This file is a standalone program (stdlib only, no tangram import): the host
starts it as ``python -I -c <this source> <config json>`` inside the isolation
backend, and it stays up between actions, so an action pays a ``fork`` of an
interpreter that has already started, not a new sandbox and a new Python.

Protocol, on the zygote's stdin/stdout: frames of a 4-byte big-endian length
and a JSON object. The host sends ``{"op": "run", ...}``, ``{"op": "ping"}`` or
``{"op": "exit"}``; the zygote answers each with one frame. It says
``{"op": "ready", ...}`` once at start. Bytes travel base64-encoded.

The untrusted code never sees these pipes: each child closes every descriptor
but its own stdin/stdout/stderr (and a status pipe that is close-on-exec).

Isolation (``CONFIG["ns"]``): once, the zygote gets a mount namespace (the
process backend: user, mount, PID, network, IPC, UTS namespaces, then it forks
and goes on as PID 1), hides the host's sandbox dir and makes every mount
read-only. Per action it mounts one tmpfs for /tmp, /dev/shm and the working
dir, and unmounts it after the run: nothing the action wrote survives it but a
stateful working dir, which is copied in before and back out after.
"""

import base64
import ctypes
import errno
import json
import os
import resource
import select
import signal
import struct
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 1
SYS_MOUNT_SETATTR = 442   # the same number on every architecture (new-style syscall table)
SYS_CLOSE_RANGE = 436
SYS_OPEN_TREE = 428
OPEN_TREE_CLONE = 1
SYS_CAPSET = 126 if os.uname().machine == "x86_64" else 91

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


def _prctl(option, value, arg3=0):
    return _libc.prctl(option, value, arg3, 0, 0) == 0


def _check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src, target, fstype, flags, data=None):
    _check(_libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), flags,
                       data and data.encode()), f"mount {fstype or src} on {target}")


def _umount(target):
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _read_only_everywhere():
    """Every mount of this namespace read-only, recursively (mount_setattr, Linux >= 5.12)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                         ctypes.sizeof(attr)), "mount_setattr / read-only")


def _close_from(lo):
    if _libc.syscall(SYS_CLOSE_RANGE, lo, 0xFFFFFFFF, 0) != 0:
        os.closerange(lo, 1 << 20)


def _drop_caps():
    """No capability left, in any set (the code of an unprivileged worker runs as the zygote's uid)."""
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    for cap in range(64):  # needs CAP_SETPCAP: refused after a uid switch (no_new_privs covers that)
        if not _prctl(PR_CAPBSET_DROP, cap) and ctypes.get_errno() in (errno.EINVAL, errno.EPERM):
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.syscall(SYS_CAPSET, header, data), "capset")


# seccomp: the kernel keyrings are per uid, shared by every action (and, as a root worker's uid 65534,
# every sandbox of the node): a key added by one action would be read by the next. POSIX message
# queues live in the sandbox's IPC namespace, which outlives an action. The code gets EPERM from
# add_key, request_key, keyctl and mq_open. (System V objects are looked for after each action.)
_KEY_SYSCALLS = {"x86_64": (0xC000003E, (248, 249, 250, 240)), "aarch64": (0xC00000B7, (217, 218, 219, 180))}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _keyring_filter():
    """The seccomp program (built once, in the zygote: building it costs ~0.6 ms); None: unknown arch."""
    arch = _KEY_SYSCALLS.get(os.uname().machine)
    if arch is None:
        return None
    audit_arch, calls = arch
    LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
    ALLOW, ERRNO_EPERM = 0x7FFF0000, 0x00050000 | errno.EPERM
    prog = [(LD_W_ABS, 0, 0, 4),                               # seccomp_data.arch
            (JEQ_K, 1, 0, audit_arch),                         # our arch: go on; else allow
            (RET_K, 0, 0, ALLOW),
            (LD_W_ABS, 0, 0, 0)]                               # seccomp_data.nr
    for i, nr in enumerate(calls):
        prog.append((JEQ_K, len(calls) - i, 0, nr))            # match: jump to the EPERM return
    prog += [(RET_K, 0, 0, ALLOW), (RET_K, 0, 0, ERRNO_EPERM)]
    filters = (_SockFilter * len(prog))(*[_SockFilter(*f) for f in prog])
    return filters, _SockFprog(len(prog), filters)


_FILTER = _keyring_filter()


def _deny_keyrings():
    if _FILTER is None:
        return False
    PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(_FILTER[1]), 0, 0), "seccomp")
    return True


def _pdeathsig():
    """The signal this process gets when its parent dies (0: none)."""
    sig = ctypes.c_int(0)
    _libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    return sig.value


class _fsid:
    """Create files as another uid (setfsuid), then back.

    A change of the fsuid or fsgid clears the parent-death signal (prctl(2)), so it is set again on the way
    out: without that, a zygote that had run one action (its scratch is mounted under ``_fsid``) no longer
    died with its worker, and nor did the action it was running (found by a test audit, session 31)."""

    def __init__(self, uid, gid):
        self.uid, self.gid = uid, gid
        self.sig = 0

    def __enter__(self):
        if self.uid is not None:
            self.sig = _pdeathsig()
            _libc.setfsgid(self.gid)
            _libc.setfsuid(self.uid)

    def __exit__(self, *exc):
        if self.uid is not None:
            _libc.setfsuid(os.geteuid())
            _libc.setfsgid(os.getegid())
            if self.sig:
                _prctl(PR_SET_PDEATHSIG, self.sig)


# -- framing -----------------------------------------------------------------

class Channel:
    def __init__(self, rfd, wfd):
        self.rfd = rfd
        self.wfd = wfd

    def recv(self):
        head = self._read_exact(4)
        if head is None:
            return None
        (n,) = struct.unpack(">I", head)
        body = self._read_exact(n)
        if body is None:
            return None
        return json.loads(body)

    def send(self, obj):
        body = json.dumps(obj).encode()
        data = struct.pack(">I", len(body)) + body
        view = memoryview(data)
        while view:
            k = os.write(self.wfd, view)
            view = view[k:]

    def _read_exact(self, n):
        parts = []
        while n:
            chunk = os.read(self.rfd, n)
            if not chunk:
                return None
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)


# -- processes ---------------------------------------------------------------

def _ppid_map():
    """pid -> parent pid, from /proc (used only when leftovers exist)."""
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat.rsplit(b")", 1)[-1].split()
        if len(rest) >= 2:
            parents[int(name)] = int(rest[1])
    return parents


def _descendants(root):
    children = {}
    for pid, ppid in _ppid_map().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for kid in children.get(todo.pop(), ()):
            out.append(kid)
            todo.append(kid)
    return out


def _reap():
    """Reap zombies; True when the zygote has no child at all left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return False


def kill_leftovers(deadline_s=3.0):
    """Kill every descendant of the zygote; return (how many, all gone?).

    The zygote is a child subreaper, so a process that the code left behind
    (a daemon that double-forked, a ``nohup``) is re-parented here, not to the
    host's init: while it lives, the zygote has a child. No child: nothing left.
    """
    if _reap():
        return 0, True
    me = os.getpid()
    seen = set()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = _descendants(me)
        if not pids:
            if _reap():
                return len(seen), True
            time.sleep(0.001)
            continue
        for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped processes cannot fork
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        seen.update(pids)
        _reap()
    return len(seen), _reap()


# -- namespaces and the per-action scratch -------------------------------------

ISO = {"scratch": False, "proc": False, "why": ""}
AREA_FD = -1      # the host's sandbox dir (its "state" slot), hidden from the code, reached by this fd
TMP_FDS = {}      # paths under /tmp that must stay visible (an interpreter there) -> O_PATH fd


def _unshare_process():
    """process backend: own user (unprivileged), mount, PID, network, IPC, UTS namespaces.

    The zygote then forks once: the child is PID 1 of the new namespace (so the code
    cannot signal it, and kill(-1) reaches only the sandbox) and goes on as the zygote;
    this process waits for it and exits with it.
    """
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if os.geteuid() != 0:
        flags |= CLONE_NEWUSER
    if _libc.unshare(flags) != 0:
        e = ctypes.get_errno()
        return f"unshare(user, mount, pid, net) refused: {os.strerror(e)}"
    if flags & CLONE_NEWUSER:
        # RLIMIT_NPROC now counts this uid's processes in the new user namespace: this one and the
        # zygote forked below, not the worker's threads
        CONFIG["nproc_base"] = 2
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    pid = os.fork()
    if pid:
        for fd in range(3, 1024):
            try:
                os.close(fd)
            except OSError:
                pass
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    ISO["proc"] = True
    return ""


def _prepare():
    """Hide the host's sandbox dir, make everything read-only; each action then mounts its scratch."""
    global AREA_FD
    area = CONFIG["area"]
    if CONFIG["ns"] == "bwrap":
        _check(_libc.unshare(CLONE_NEWNS), "unshare(mount)")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        ISO["proc"] = True  # bwrap's own PID namespace and /proc
    for p in CONFIG.get("keep_under_tmp", ()):
        TMP_FDS[p] = os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    # a detached copy of the host dir's mount: not in the tree (so never made read-only, never seen by
    # the code), reached only through this fd, where a trajectory's dir is saved after its action
    AREA_FD = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, area.encode(), OPEN_TREE_CLONE | os.O_CLOEXEC)
    if AREA_FD < 0:
        _check(-1, f"open_tree {area}")
    _mount("tmpfs", area, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=64,mode=0755")
    os.mkdir(os.path.join(area, "work"), 0o755)
    if area.startswith("/tmp/"):  # each action's fresh /tmp would hide it: bound again there
        TMP_FDS[area] = os.open(area, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    _hide_gpu_devices()
    _read_only_everywhere()
    ISO["scratch"] = True


def _hide_gpu_devices():
    """The host's /dev (the process backend's; bwrap's own /dev has none): /dev/null over each GPU device
    node (``gpu_globs``: backends.GPU_DEVICE_GLOBS), an empty read-only tmpfs over a directory of them
    (/dev/dri), so the code cannot reach a GPU that the worker's reward models use (the nodes are usually
    mode 0666)."""
    import glob

    for pattern in CONFIG.get("gpu_globs", ()):
        for path in sorted(glob.glob(pattern)):
            if os.path.isdir(path) and not os.path.islink(path):
                _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                       "size=4k,nr_inodes=4,mode=0755")
            elif not os.path.islink(path):
                _mount("/dev/null", path, None, MS_BIND)


def _mount_scratch(req):
    """A fresh tmpfs (one size and file quota) for /tmp, /dev/shm and the working dir.

    The tmpfs is mounted at /dev/shm, its parts are bound at the working dir and
    /tmp, and its ``shm`` part is bound over it at /dev/shm. Paths under /tmp that
    must stay visible (an interpreter there; the sandbox's own dir, for the process
    backend) are bound again inside the fresh /tmp.
    """
    area = CONFIG["area"]
    st = "/dev/shm"
    size = int(req.get("work_bytes") or 256 << 20)
    # exactly work_files for the code: plus the root, the three parts and the keep paths' mount points
    files = int(req.get("work_files") or 20000) + 4 + len(_keep_dirs())
    # the root is covered at once (by the shm part): its mode only lets the code's uid make the parts
    _mount("tmpfs", st, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes={files},mode=0777")
    uid = CONFIG.get("uid")
    with _fsid(uid, CONFIG.get("gid", uid)):
        for name, mode in (("tmp", 0o1777), ("shm", 0o1777), ("work", 0o700)):
            os.mkdir(os.path.join(st, name))
            os.chmod(os.path.join(st, name), mode)
        for p in TMP_FDS:  # their mount points inside the fresh /tmp
            os.makedirs(os.path.join(st, "tmp", p[len("/tmp/"):]), mode=0o755, exist_ok=True)
    _mount(os.path.join(st, "work"), os.path.join(area, "work"), None, MS_BIND)
    _mount(os.path.join(st, "tmp"), "/tmp", None, MS_BIND)
    _mount(os.path.join(st, "shm"), "/dev/shm", None, MS_BIND)
    for p, fd in TMP_FDS.items():
        _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)


def _keep_dirs():
    return {p[:i] for p in TMP_FDS for i in range(len("/tmp/"), len(p) + 1) if i == len(p) or p[i] == "/"}


def _unmount_scratch():
    """Drop the action's tmpfs: whatever it held is gone. Returns '' or why it failed."""
    errors = []
    for t in [*TMP_FDS, "/tmp", "/dev/shm", "/dev/shm", os.path.join(CONFIG["area"], "work")]:
        try:
            _umount(t)
        except OSError as e:
            errors.append(str(e))
    return "; ".join(errors)


def _scratch_full():
    try:
        st = os.statvfs(os.path.join(CONFIG["area"], "work"))
    except OSError:
        return False
    return st.f_bavail == 0 or st.f_favail == 0


def copy_tree(src, dst):
    """Copy dirs, regular files and symlinks (as links, never followed) from ``src`` into ``dst``.

    Runs as the code's uid: what it cannot read it makes readable first (it owns it).
    Fifos, sockets and devices are skipped.
    """
    os.makedirs(dst, mode=0o700, exist_ok=True)
    try:
        entries = list(os.scandir(src))
    except PermissionError:
        os.chmod(src, 0o700)
        entries = list(os.scandir(src))
    for e in entries:
        target = os.path.join(dst, e.name)
        st = e.stat(follow_symlinks=False)
        if e.is_symlink():
            os.symlink(os.readlink(e.path), target)
        elif e.is_dir(follow_symlinks=False):
            copy_tree(e.path, target)
            os.chmod(target, (st.st_mode & 0o777) | 0o700)
        elif e.is_file(follow_symlinks=False):
            try:
                fin = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW)
            except PermissionError:
                os.chmod(e.path, st.st_mode | 0o600)
                fin = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                fout = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    while True:
                        chunk = os.read(fin, 1 << 20)
                        if not chunk:
                            break
                        os.write(fout, chunk)
                finally:
                    os.close(fout)
            finally:
                os.close(fin)
            os.chmod(target, st.st_mode & 0o777)
        else:
            continue
        try:
            os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
        except OSError:
            pass


def _become_code_user():
    """Drop to the code's uid (worker root), or drop every capability (worker unprivileged)."""
    uid = CONFIG.get("uid")
    if uid is not None:
        gid = CONFIG.get("gid", uid)
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    if uid is not None or CONFIG.get("ns"):
        _drop_caps()  # the inheritable set too (setresuid clears only the others)
    _prctl(PR_SET_DUMPABLE, 1)  # its own /proc/self again (the zygote's is closed)


def _save_state():
    """After a stateful action: its working dir replaces the trajectory's state (as the code's uid).

    Returns '' or why it failed.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            _become_code_user()
            base = f"/proc/self/fd/{AREA_FD}/slot"
            new, old = f"{base}/state.new", f"{base}/state.old"
            copy_tree(os.path.join(CONFIG["area"], "work"), new)
            os.rename(f"{base}/state", old)
            os.rename(new, f"{base}/state")
            _rm(old)
            code = 0
        except BaseException as e:
            os.write(w, f"{type(e).__name__}: {e}".encode()[:2000])
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        why = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return ""
    return why or f"the copy ended with status {status}"


def _rm(path):
    """Remove a tree the code made (it may have chmod-ed dirs to 000: it owns them, so undo that)."""
    os.chmod(path, 0o700)
    for e in os.scandir(path):
        if e.is_dir(follow_symlinks=False):
            _rm(e.path)
        else:
            os.unlink(e.path)
    os.rmdir(path)


# -- the child ---------------------------------------------------------------

def _set_limits(req):
    def lim(which, soft, hard=None):
        if soft is None:
            return
        resource.setrlimit(which, (int(soft), int(hard if hard is not None else soft)))

    lim(resource.RLIMIT_CORE, 0)
    cpu = req.get("cpu_s")
    if cpu is not None:
        cpu = max(1, int(cpu + 0.999))
        lim(resource.RLIMIT_CPU, cpu, cpu + 1)
    lim(resource.RLIMIT_AS, req.get("memory_bytes"))
    lim(resource.RLIMIT_FSIZE, req.get("file_bytes"))
    lim(resource.RLIMIT_NOFILE, req.get("open_files"))
    nproc = req.get("procs")
    if nproc is not None:
        lim(resource.RLIMIT_NPROC, nproc + CONFIG.get("nproc_base", 0))


def _die_with(parent):
    """Get SIGKILL when ``parent`` dies; exit now if it died already (before the signal was set, its death
    sent nothing, and this process was re-parented)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _child(req, fds, zygote):
    """In the forked child: confine, then run the code or exec the command. ``zygote``: the parent's pid."""
    in_r, out_w, err_w, st_w = fds
    try:
        _die_with(zygote)
        os.setsid()
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(st_w, 3)
        os.set_inheritable(3, False)
        cpus = req.get("cpus")
        affinity = "none"
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
                affinity = "affinity"
            except OSError:
                affinity = "none"
        os.write(3, f"cpu={affinity}\n".encode())
        _set_limits(req)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid binary, no file capability can raise it again
        _deny_keyrings()
        _become_code_user()
        _die_with(zygote)  # setresuid cleared it (prctl(2)): where no PID namespace ends with the zygote, the code
        #                    still dies with it
        work = req["cwd"]
        if req.get("stateful") and ISO["scratch"]:
            copy_tree(f"/proc/self/fd/{AREA_FD}/slot/state", work)
        for rel, data in (req.get("files") or {}).items():
            path = os.path.join(work, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, base64.b64decode(data))
            finally:
                os.close(fd)
        _close_from(4)  # nothing of the zygote's (its channel, the host dir's fd) reaches the code
        os.chdir(work)
        env = dict(CONFIG["env"])
        if ISO["scratch"]:
            env["TMPDIR"] = "/tmp"
        env.update(req.get("env") or {})
        os.environ.clear()
        os.environ.update(env)
        if req.get("argv"):
            for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            try:
                os.execvpe(req["argv"][0], req["argv"], env)
            except OSError as e:
                os.write(3, f"end=exec\nmsg=cannot run {req['argv'][0]!r}: {e.strerror}\n".encode())
                os._exit(127)
        _run_python(req["code"])
    except BaseException as e:  # setup failed: say so, never run the code
        try:
            end = "file_limit" if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) \
                else "setup"
            os.write(3, f"end={end}\nmsg={type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(126)


def _run_python(code):
    import builtins

    # sys.stdin/stdout/stderr already wrap fds 0, 1, 2 (the zygote never used them: empty
    # buffers), which now are this run's pipes: no new text streams to build
    sys.argv = ["<sandbox>"]
    sys.path[0:0] = [os.getcwd()]
    end, rc = "", 0
    try:
        exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        c = e.code
        rc = 0 if c is None else c if isinstance(c, int) else 1
        if not isinstance(c, (int, type(None))):
            try:
                print(c, file=sys.stderr)
            except BaseException:
                pass
    except MemoryError:
        end, rc = "memory", 1
        _print_exc()
    except OSError as e:
        end, rc = ("file_limit" if e.errno in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT) else ""), 1
        _print_exc()
    except BaseException:
        rc = 1
        _print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    try:
        os.write(3, f"end={end}\n".encode())
    except OSError:
        pass
    os._exit(rc & 0xFF)


def _print_exc():
    try:
        traceback.print_exc()
    except BaseException:
        try:
            os.write(2, b"(traceback lost: out of memory)\n")
        except OSError:
            pass


# -- one run -----------------------------------------------------------------

MOUNTED = {"quota": None}  # the quota of the tmpfs mounted now (None: none is)


def do_run(req):
    reused = False
    if ISO["scratch"]:
        quota = (req.get("work_bytes"), req.get("work_files"))
        if MOUNTED["quota"] is not None and MOUNTED["quota"] != quota:
            _drop_scratch()
        reused = MOUNTED["quota"] is not None
        if not reused:
            _mount_scratch(req)
            MOUNTED["quota"] = quota
    try:
        res = _do_run(req)
    except BaseException:
        if ISO["scratch"]:
            kill_leftovers()
            _drop_scratch()
        raise
    res["full"] = ISO["scratch"] and _scratch_full()
    res["scratch_reused"] = reused
    # System V shared memory, semaphores and queues outlive their processes, in the sandbox's own IPC
    # namespace: a sandbox where the action left any is replaced (a new unshare per action costs ~2 ms)
    res["ipc_left"] = _ipc_objects() if ISO["scratch"] else 0
    res["saved"] = ""
    res["wipe"] = ""
    if ISO["scratch"]:
        if req.get("stateful") and res["clean"]:
            res["saved"] = _save_state()
        # an action that left its tmpfs exactly as it got it (most do: nothing written) passes it on;
        # any other is unmounted, and the next action gets a new one
        if req.get("stateful") or not res["clean"] or not _scratch_pristine():
            res["wipe"] = _drop_scratch()
    return res


def _ipc_objects():
    n = 0
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}", "rb") as f:
                n += max(0, len(f.read().splitlines()) - 1)
        except OSError:
            pass
    return n


def _drop_scratch():
    MOUNTED["quota"] = None
    return _unmount_scratch()


def _expected_scratch():
    """Each dir of a fresh scratch, with the names it holds, its mode and its owner."""
    uid = CONFIG["uid"] if CONFIG.get("uid") is not None else os.getuid()
    want = {"/tmp": (set(), 0o1777), "/dev/shm": (set(), 0o1777), os.path.join(CONFIG["area"], "work"): (set(), 0o700)}
    for p in TMP_FDS:  # the mount points of the paths kept under /tmp, and the dirs leading to them
        parent = "/tmp"
        for name in p[len("/tmp/"):].split("/"):
            want[parent][0].add(name)
            parent = f"{parent}/{name}"
            if parent != p:
                want.setdefault(parent, (set(), 0o755))
    return uid, want


def _scratch_pristine():
    """Whether the action's tmpfs is as it was mounted: no entry, mode, owner or xattr changed."""
    uid, want = _expected_scratch()
    try:
        with _fsid(CONFIG.get("uid"), CONFIG.get("gid", CONFIG.get("uid"))):  # the zygote may lack DAC caps
            return _matches(uid, want)
    except OSError:
        return False


def _matches(uid, want):
    for d, (names, mode) in want.items():
        st = os.lstat(d)
        if not stat_isdir(st.st_mode) or st.st_uid != uid or (st.st_mode & 0o7777) != mode:
            return False
        if set(os.listdir(d)) != names or os.listxattr(d, follow_symlinks=False):
            return False
    st = os.statvfs("/tmp")
    return st.f_files - st.f_ffree == 4 + len(_keep_dirs())  # no inode held elsewhere (e.g. an open fd)


def stat_isdir(mode):
    return (mode & 0o170000) == 0o040000


def _do_run(req):
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    stdin = base64.b64decode(req.get("stdin") or "")
    t0 = time.monotonic()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        _child(req, (in_r, out_w, err_w, st_w), zygote)
    for fd in (in_r, out_w, err_w, st_w):
        os.close(fd)
    limit = int(req.get("output_bytes") or 1 << 20)
    timeout = float(req.get("timeout_s") or 10.0)
    bufs = {out_r: bytearray(), err_r: bytearray(), st_r: bytearray()}
    truncated = {out_r: False, err_r: False}
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    for fd in (out_r, err_r, st_r):
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    os.set_blocking(in_w, False)
    if stdin:
        poller.register(in_w, select.POLLOUT)
    else:
        os.close(in_w)
        in_w = -1
    sent = 0
    ours = ""  # why the zygote killed the child, if it did
    exited = False
    open_fds = {out_r, err_r, st_r}

    def kill(why):
        nonlocal ours
        if not ours:
            ours = why
        for target in (-pid, pid):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass

    def pump(fd):
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            poller.unregister(fd)
            open_fds.discard(fd)
            return
        buf = bufs[fd]
        room = (limit if fd != st_r else 4096) - len(buf)
        buf += chunk[:max(room, 0)]
        if fd != st_r and len(chunk) > room:
            truncated[fd] = True
            kill("output_limit")

    while not exited:
        left = t0 + timeout - time.monotonic()
        if left <= 0:
            kill("timeout")
            break
        for fd, _ in poller.poll(left * 1000):
            if fd == pidfd:
                exited = True
            elif fd == in_w:
                try:
                    sent += os.write(in_w, stdin[sent:sent + 65536])
                except BlockingIOError:
                    pass
                except OSError:  # the code closed its stdin
                    sent = len(stdin)
                if sent >= len(stdin):
                    poller.unregister(in_w)
                    os.close(in_w)
                    in_w = -1
            else:
                pump(fd)
        if ours:
            break
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    if in_w >= 0:
        os.close(in_w)
    # what the child wrote before it ended; a leftover may still hold the pipes
    for fd in list(open_fds):
        pump(fd)
    leftovers, clean = kill_leftovers()
    drain_end = time.monotonic() + 1.0
    while open_fds and time.monotonic() < drain_end:
        for fd, _ in poller.poll(50):
            if fd in open_fds:
                pump(fd)
    for fd in (out_r, err_r, st_r, pidfd):
        os.close(fd)
    status_lines = dict(
        line.split("=", 1) for line in bufs[st_r].decode("utf-8", "replace").splitlines() if "=" in line
    )
    return {
        "op": "result",
        "ours": ours,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "end": status_lines.get("end", ""),
        "msg": status_lines.get("msg", ""),
        "cpu_mechanism": status_lines.get("cpu", "none"),
        "stdout": base64.b64encode(bytes(bufs[out_r])).decode(),
        "stderr": base64.b64encode(bytes(bufs[err_r])).decode(),
        "stdout_truncated": truncated[out_r],
        "stderr_truncated": truncated[err_r],
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "leftovers": leftovers,
        "clean": clean,
    }


# -- main --------------------------------------------------------------------

CONFIG = {}


def main():
    CONFIG.update(json.loads(sys.argv[1]))
    os.umask(0o022)  # the modes of each action's fresh dirs do not depend on the worker's umask
    cg = CONFIG.get("cgroup_fd")
    if cg is not None:  # join the sandbox's cgroup before anything is forked ("0": this process)
        try:
            os.write(cg, b"0")
        finally:
            os.close(cg)
    chan = Channel(os.dup(0), os.dup(1))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    parent = CONFIG.get("parent_pid")
    if parent is not None:  # die with the worker (bwrap does this itself with --die-with-parent)
        _die_with(parent)
    net = "namespace" if CONFIG.get("net_isolated") else "none"
    if CONFIG.get("ns") == "process":
        ISO["why"] = _unshare_process()
        if not ISO["why"]:
            net = "namespace"
    elif CONFIG.get("unshare_net"):
        net = "namespace" if _libc.unshare(CLONE_NEWNET) == 0 else "none"
    if CONFIG.get("ns") and not ISO["why"]:
        try:
            _prepare()
        except OSError as e:
            ISO["why"] = str(e)
    os.chdir("/")
    _prctl(PR_SET_DUMPABLE, 0)  # code of the same uid cannot ptrace or read /proc of the zygote
    subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    for name in CONFIG.get("preload", ()):
        __import__(name)
    chan.send({"op": "ready", "pid": os.getpid(), "net": net, "subreaper": subreaper, "uid": os.getuid(),
               "scratch": ISO["scratch"], "proc": ISO["proc"], "why": ISO["why"]})
    null = os.open(os.devnull, os.O_RDWR)  # the host stops reading our stderr once we are ready
    os.dup2(null, 2)
    os.close(null)
    while True:
        req = chan.recv()
        if req is None or req.get("op") == "exit":
            kill_leftovers()
            chan.send({"op": "bye"}) if req is not None else None
            return
        if req["op"] == "ping":
            n, clean = kill_leftovers()
            chan.send({"op": "pong", "leftovers": n, "clean": clean})
        elif req["op"] == "run":
            try:
                chan.send(do_run(req))
            except OSError as e:
                chan.send({"op": "error", "msg": f"the sandbox could not prepare or clean up the run: {e}"})
        else:
            chan.send({"op": "error", "msg": f"unknown op {req['op']!r}"})


if __name__ == "__main__":
    main()
