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
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option, value):
    return _libc.prctl(option, value, 0, 0, 0) == 0


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


def _child(req, fds):
    """In the forked child: confine, then run the code or exec the command."""
    in_r, out_w, err_w, st_w = fds
    try:
        os.setsid()
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(st_w, 3)
        os.closerange(4, 1 << 16)
        os.set_inheritable(3, False)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
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
        uid = CONFIG.get("uid")
        if uid is not None:
            gid = CONFIG.get("gid", uid)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        os.chdir(req["cwd"])
        env = dict(CONFIG["env"])
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
            os.write(3, f"end=setup\nmsg={type(e).__name__}: {e}\n".encode())
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
        end, rc = ("file_limit" if e.errno == errno.EFBIG else ""), 1
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

def do_run(req):
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    stdin = base64.b64decode(req.get("stdin") or "")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(req, (in_r, out_w, err_w, st_w))
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
    chan = Channel(os.dup(0), os.dup(1))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    os.chdir("/")
    parent = CONFIG.get("parent_pid")
    if parent is not None:  # die with the worker (bwrap does this itself with --die-with-parent)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the worker died before we got here
            os._exit(1)
    subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    net = "namespace" if CONFIG.get("net_isolated") else "none"
    if CONFIG.get("unshare_net"):
        net = "namespace" if _libc.unshare(CLONE_NEWNET) == 0 else "none"
    for name in CONFIG.get("preload", ()):
        __import__(name)
    chan.send({"op": "ready", "pid": os.getpid(), "net": net, "subreaper": subreaper, "uid": os.getuid()})
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
            chan.send(do_run(req))
        else:
            chan.send({"op": "error", "msg": f"unknown op {req['op']!r}"})


if __name__ == "__main__":
    main()
