"""The worker's ledger of resident reward-model replicas. No Dask import: threads and callables only.

One :class:`Residency` per GPU worker. Replicas are named by the policy's
replica id (the grant's ``replica``) and live on policy GPU indices (the
grant's ``gpus``). What it guarantees:

- **Never over-committed.** Each GPU's used bytes (loaded replicas, plus the
  estimate of a load in progress) stay within its capacity. A load whose
  estimate does not fit, or whose measured size does not fit, fails with a
  :class:`~tangram_dask.errors.ModelError` and holds nothing.
- **Never evicts under an action.** An action pins its replica from the moment
  its task reaches the worker until the task ends; evicting a pinned replica
  waits until its last pin is gone.
- **Loads in the background.** Loads run on their own threads; replicas on
  other GPUs keep serving, and the action that needs the new replica blocks
  only in :meth:`Residency.get`.
- **Measured, not declared.** After a load, the replica's bytes per GPU are
  what the probe measured (CUDA's allocated memory where the model went to a
  CUDA device, else the model's parameter bytes), and its load time is the
  wall time the loader took.

Each change of state is passed to ``report`` (a
:class:`~tangram_dask.messages.ResidencyReport`) as it happens.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, NamedTuple, Protocol, Sequence

from ..errors import ModelError
from ..messages import ResidencyReport

logger = logging.getLogger("tangram_dask.models")

LOADING, RESIDENT, FAILED, EVICTED = "loading", "resident", "failed", "evicted"
#: The failed replicas no action pins that stay known here (their state and error, in ``snapshot``), the latest
#: ones; older ones are forgotten (the scheduler dropped them from its ledger when their failure was reported,
#: and never grants their ids again)
FAILED_KEPT = 8
SHUTDOWN_PREFIX = "the worker is shutting down: "  # a failed load's report that is not its loader's fault
LOADER_FAILED = "the loader of model "  # how the errors of a loader that raised or never returned begin


class Scorer(Protocol):
    """What a loader returns: ``score(batch) -> list[float]``; ``param_bytes`` if it knows it."""

    def score(self, batch: Sequence[Any]) -> list[float]: ...


Loader = Callable[[tuple[str, ...]], Scorer]


@dataclass(frozen=True)
class ModelEntry:
    """A registered model as the worker knows it: the loader and the bytes per replica to expect."""

    name: str
    loader: Loader
    memory_bytes: int  # one replica, all its GPUs together (declared, or measured by a first load)
    timeout_s: float | None = None  # a load whose loader has not returned by then fails (None: no deadline)


def param_bytes(scorer: Any) -> int:
    """The parameter (and buffer) bytes a scorer holds: its ``param_bytes`` if it says, else its torch modules'."""
    pb = getattr(scorer, "param_bytes", None)
    if pb is not None:
        v = pb() if callable(pb) else pb
        try:
            n = int(v)
        except (TypeError, ValueError, OverflowError):
            n = -1
        if n < 0 or isinstance(v, bool):  # a negative size made the ledger count negative memory and over-commit
            raise ModelError(f"the scorer's param_bytes is {v!r}: it must be a whole number of bytes >= 0")
        return n
    total, seen = 0, set()
    for value in vars(scorer).values() if hasattr(scorer, "__dict__") else ():
        params = getattr(value, "parameters", None)
        if callable(params) and id(value) not in seen:
            seen.add(id(value))
            for t in list(value.parameters()) + list(value.buffers()):
                total += t.numel() * t.element_size()
    return total


class MemoryProbe:
    """Measures what a load took on each device. This one: nothing (the parameter bytes decide)."""

    name = "params"

    def before(self, devices: tuple[str, ...]) -> Any:
        return None

    def after(self, devices: tuple[str, ...], token: Any) -> list[int] | None:
        return None

    def freed(self, devices: tuple[str, ...]) -> None:
        pass


class CudaProbe(MemoryProbe):
    """CUDA's allocated bytes on each ``cuda:k`` device, before and after the load (torch)."""

    name = "cuda"

    @staticmethod
    def _cuda(devices: tuple[str, ...]) -> list[int]:
        return [int(d.split(":")[1]) for d in devices if d.startswith("cuda:")]

    def before(self, devices: tuple[str, ...]) -> Any:
        import torch

        ords = self._cuda(devices)
        for k in ords:
            torch.cuda.synchronize(k)
        return {k: torch.cuda.memory_allocated(k) for k in ords}

    def after(self, devices: tuple[str, ...], token: Any) -> list[int] | None:
        import torch

        if not token:
            return None
        out = []
        for k in self._cuda(devices):
            torch.cuda.synchronize(k)
            out.append(max(0, torch.cuda.memory_allocated(k) - token[k]))
        return out

    def freed(self, devices: tuple[str, ...]) -> None:
        import torch

        if self._cuda(devices):
            gc.collect()  # the dropped model's tensors go back to torch's cache, then to the device
            torch.cuda.empty_cache()


@dataclass
class Replica:
    rid: int
    model: str
    gpus: tuple[int, ...]
    devices: tuple[str, ...]
    state: str = LOADING
    scorer: Any = None
    bytes_per_gpu: int = 0  # what it holds on each of its GPUs (the estimate while loading)
    param_bytes: int = 0
    measured_by: str = ""
    load_s: float = 0.0
    first: bool = False  # the process's first load of this model (its load_s includes one-time costs)
    took: int = 0  # a load measured but not kept (it did not fit): what it took on each GPU
    error: BaseException | None = None
    pins: set = field(default_factory=set)
    ready: threading.Event = field(default_factory=threading.Event)


class LoadGivenUp(ModelError):
    """A load given up on at its deadline: its loader runs on, and ``per_gpu`` bytes stay counted (load ``hold``)."""

    def __init__(self, hold: int, per_gpu: int, message: str):
        super().__init__(message)
        self.hold, self.per_gpu = hold, per_gpu


class LastLoad(NamedTuple):
    """What a worker's latest load of a model measured (kept or not): a later load's estimate, by that loader only,
    and what a refusal before a load reports."""
    loader: Any
    nbytes: int  # one replica, all its GPUs
    param_bytes: int
    measured_by: str
    load_s: float
    first: bool  # the process's first load of the model


@dataclass
class ResidencyStats:
    loads: int = 0
    evictions: int = 0
    failures: int = 0
    peak_used: list[int] = field(default_factory=list)


class Residency:
    """Replicas resident on one worker's GPUs (see the module docstring).

    ``capacity``: bytes of each policy GPU. ``models(name)``: the
    :class:`ModelEntry` of a model (raises :class:`ModelError` if unknown).
    ``devices(gpus)``: the device strings a loader gets for those GPUs
    (``"cuda:1"``, or ``"cpu"`` where there is no CUDA). ``probe``: how a
    load's memory is measured. ``report``: called with every state change.
    ``load_threads``: threads per GPU that run loads, the GPU being a replica's first: a load waiting to
    evict a replica that a running action still pins holds its thread, and with one pool for every GPU
    four such loads held all of it, so a load onto a free GPU waited 24.5 s behind them (session 31).
    """

    def __init__(self, capacity: Sequence[int], models: Callable[[str], ModelEntry],
                 devices: Callable[[tuple[int, ...]], tuple[str, ...]], *, probe: MemoryProbe | None = None,
                 report: Callable[[ResidencyReport], None] = lambda r: None, load_threads: int = 1,
                 room_wait_s: float = 5.0):
        self.capacity = [int(c) for c in capacity]
        self.used = [0] * len(self.capacity)
        self.models = models
        self.devices = devices
        self.probe = probe or MemoryProbe()
        self.report = report
        self.replicas: dict[int, Replica] = {}
        self.pins: dict[Hashable, int] = {}
        self.stats = ResidencyStats(peak_used=[0] * len(self.capacity))
        self._cond = threading.Condition()
        self._gpu_locks = [threading.Lock() for _ in self.capacity]
        self._load_threads = load_threads
        self._pools: dict[int, ThreadPoolExecutor] = {}  # the first GPU of a replica -> the pool of its loads
        self._closed = False
        self._placeholders = 0  # negative ids of refused grants (they hold nothing)
        self._hung: dict[int, tuple[tuple[int, ...], int]] = {}  # loads given up whose loader runs on: GPUs, bytes
        self._hung_seq = 0
        # model -> the loader of its latest load in this process (a load of another loader is a first again: one of
        # the old loader ending after forget_loads no longer marks the new loader's first load as a reload)
        self._loaded: dict[str, Any] = {}
        # model -> what its latest load here measured: a load's estimate, rather than the registered memory_gb,
        # once known; by that loader only (a load of the old loader still running when the model was registered
        # again ends after forget_loads, and records its own size)
        self._sizes: dict[str, LastLoad] = {}
        self.room_wait_s = room_wait_s  # how long a load waits for room before it fails

    def forget_loads(self, model: str) -> None:
        """The model's next load counts as its first in this process (it was registered with a new loader)."""
        with self._cond:
            self._loaded.pop(model, None)
            self._sizes.pop(model, None)

    # -- the action's side ---------------------------------------------------------
    def prepare(self, key: Hashable, rid: int, model: str, gpus: Sequence[int], evict: Sequence[int] = ()) -> None:
        """An action holding replica ``rid`` arrived: pin it, and load it (after ``evict``) if it is not here."""
        with self._cond:
            if key in self.pins:
                return
            r = self._ensure(rid, model, gpus, evict)
            if r.rid != rid:  # refused: a placeholder that carries the error to the action
                self.replicas[r.rid] = r
            r.pins.add(key)
            self.pins[key] = r.rid

    def load_ahead(self, rid: int, model: str, gpus: Sequence[int], evict: Sequence[int] = ()) -> Replica:
        """Load replica ``rid`` before any action needs it (after ``evict``); no action pins it yet."""
        with self._cond:
            return self._ensure(rid, model, gpus, evict)

    def _ensure(self, rid: int, model: str, gpus: Sequence[int], evict: Sequence[int]) -> Replica:
        """The replica ``rid`` as the grant describes it: here, loading, or refused (under the lock)."""
        gpus = tuple(int(g) for g in gpus)
        r = self.replicas.get(rid)
        if r is not None and (r.model != model or r.gpus != gpus):
            if r.pins:
                return self._refused(rid, model, gpus, ModelError(
                    f"replica {rid} is {r.model} on GPUs {list(r.gpus)} here, but an action was granted it as "
                    f"{model} on GPUs {list(gpus)}: the scheduler and this worker disagree (was the scheduler "
                    f"restarted?)"))
            self._drop(r)  # a stale replica under a reused id
            r = None
        if r is None or (r.state in (FAILED, EVICTED) and not r.pins):
            if self._closed:
                return self._refused(rid, model, gpus, ModelError("this worker's models are closing: no load"))
            if any(not 0 <= g < len(self.capacity) for g in gpus) or not gpus:
                return self._refused(rid, model, gpus, ModelError(
                    f"the grant names GPUs {list(gpus)} but this worker has GPUs 0..{len(self.capacity) - 1}"))
            r = Replica(rid, model, gpus, self.devices(gpus))
            self.replicas[rid] = r
            pool = self._pools.get(gpus[0])
            if pool is None:
                pool = self._pools[gpus[0]] = ThreadPoolExecutor(self._load_threads,
                                                                 thread_name_prefix=f"tangram-load-{gpus[0]}")
            pool.submit(self._load, r, tuple(int(e) for e in evict))
        return r

    def _refused(self, rid: int, model: str, gpus: tuple[int, ...], err: ModelError) -> Replica:
        self._placeholders -= 1
        r = Replica(self._placeholders, model, gpus, (), FAILED, error=err)
        r.ready.set()
        return r

    def get(self, key: Hashable, timeout: float | None = None) -> Any:
        """The scorer of the replica ``key`` pinned, once resident (raises the load's error)."""
        with self._cond:
            rid = self.pins.get(key)
            r = self.replicas.get(rid) if rid is not None else None
        if r is None:
            raise ModelError(f"action {key!r} holds no model replica on this worker (is it a GPU action with a "
                             f"model, placed by the tangram scheduler plugin?)")
        if not r.ready.wait(timeout):
            raise ModelError(f"replica {r.rid} of {r.model} did not load within {timeout} s")
        if r.state != RESIDENT:
            if r.error is None:
                raise ModelError(f"replica {r.rid} of {r.model} is {r.state}")
            # a copy: raising the replica's own error added each action's frames to its traceback, so the next action
            # granted the replica showed the earlier ones' frames under its own, and the error kept every such
            # action's locals (its batch, its rollout) alive for as long as the failed replica was known here
            raise _copy_error(r.error)
        return r.scorer

    def unpin(self, key: Hashable) -> None:
        """The action ended (or was released): its replica may be evicted again. Safe twice."""
        with self._cond:
            rid = self.pins.pop(key, None)
            r = self.replicas.get(rid) if rid is not None else None
            if r is None:
                return
            r.pins.discard(key)
            if rid < 0 and not r.pins:  # a placeholder for a refused grant
                del self.replicas[rid]
            elif r.state == FAILED and not r.pins:
                self._forget_failed()
            self._cond.notify_all()

    # -- the scheduler's side ------------------------------------------------------
    def evict(self, rid: int, timeout: float | None = None) -> bool:
        """Evict replica ``rid`` once no action pins it (waits up to ``timeout``). False if it is not here."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            r = self.replicas.get(rid)
            if r is None:
                return False
            while r.pins or r.state == LOADING:
                if self._closed:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ModelError(f"replica {rid} of {r.model} is still serving an action after {timeout} s: "
                                     f"not evicted")
                self._cond.wait(left if left is not None else 1.0)
                if self.replicas.get(rid) is not r:
                    return False
            if r.state != RESIDENT:
                self._drop(r)
                return False
            self._drop(r)
            self._cond.notify_all()  # loads waiting for room
        if not isinstance(self.probe, CudaProbe):  # (whose freed() collects)
            # a torch module is full of reference cycles: the evicted scorer goes now, not at the interpreter's next
            # full collection (before session 35, on a CPU worker, 7 evicted MiniLM copies were still alive after
            # 10 load/evict cycles: RSS 935 MB, 583 MB once collected)
            gc.collect()
        self.probe.freed(r.devices)
        self.stats.evictions += 1
        self._report(r, EVICTED)
        return True

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return {"used": list(self.used), "capacity": list(self.capacity),
                    "replicas": {rid: {"model": r.model, "gpus": list(r.gpus), "state": r.state,
                                       "pins": len(r.pins), "bytes_per_gpu": r.bytes_per_gpu,
                                       "param_bytes": r.param_bytes, "measured_by": r.measured_by,
                                       "load_s": r.load_s, "first": r.first}
                                 for rid, r in self.replicas.items() if rid >= 0},
                    "loads": self.stats.loads, "evictions": self.stats.evictions,
                    "failures": self.stats.failures, "peak_used": list(self.stats.peak_used)}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    # -- internals -------------------------------------------------------------------
    def _forget_failed(self) -> None:
        """The failed replicas no action pins, but for the latest ``FAILED_KEPT``, leave (under the lock). Each
        failed load is a replica id the scheduler never grants again: before, every one stayed here with its error
        for as long as the worker ran (a loader failing now and then over days of steps: one more per failure)."""
        idle = [rid for rid, r in self.replicas.items() if rid >= 0 and r.state == FAILED and not r.pins]
        for rid in idle[:-FAILED_KEPT] if len(idle) > FAILED_KEPT else ():
            del self.replicas[rid]

    def _drop(self, r: Replica) -> None:
        """Forget a replica and give its bytes back (under the lock)."""
        if self.replicas.get(r.rid) is r:
            del self.replicas[r.rid]
        if r.state in (LOADING, RESIDENT):
            for g in r.gpus:
                self.used[g] -= r.bytes_per_gpu
        if r.state == LOADING:  # its load thread must not give the estimate back again (nor a hung entry keep it)
            r.bytes_per_gpu = 0
        r.state = EVICTED if r.state == RESIDENT else r.state
        r.scorer = None

    def _take(self, r: Replica, per_gpu: int, what: str, advice: str = "") -> None:
        """Reserve ``per_gpu`` bytes on each of the replica's GPUs, or raise (under the lock)."""
        for g in r.gpus:
            if self.used[g] + per_gpu > self.capacity[g]:
                hung = sum(b for gpus, b in self._hung.values() if g in gpus)
                why = (f"{hung / 1e9:.6g} GB of it held by a load given up on, whose loader has not returned"
                       if hung else advice or f"the scheduler's memory figures for {r.model} are below what it "
                                              f"takes: register it with a larger memory_gb")
                raise ModelError(
                    f"replica {r.rid} of {r.model} {what} {per_gpu / 1e9:.6g} GB on GPU {g}, which has "
                    f"{(self.capacity[g] - self.used[g]) / 1e9:.6g} GB free of {self.capacity[g] / 1e9:.6g}: "
                    f"not loaded ({why})")
        for g in r.gpus:
            self.used[g] += per_gpu
            self.stats.peak_used[g] = max(self.stats.peak_used[g], self.used[g])

    def _load(self, r: Replica, evict: tuple[int, ...]) -> None:
        try:
            self._load_in(r, evict)
        except BaseException as e:  # the action that needs it gets this error; nothing is held
            with self._cond:
                if r.state == LOADING:
                    for g in r.gpus:
                        self.used[g] -= r.bytes_per_gpu
                r.bytes_per_gpu = 0
                r.state, r.scorer = FAILED, None
                r.error = e if isinstance(e, ModelError) else ModelError(
                    f"loading replica {r.rid} of {r.model!r} failed: {type(e).__name__}: {e}")
                if r.error is not e:  # where it was raised (a scorer's parameters(), CUDA's counters): its trace
                    r.error.__cause__ = e
                _forget_locals(e, r.error)  # what the loader (or its scorer) held goes now, not with the error
                self.stats.failures += 1
                if not r.pins:  # a background load: no action holds it (else, when the last one lets it go)
                    self._forget_failed()
                self._cond.notify_all()
            r.ready.set()
            gc.collect()
            self.probe.freed(r.devices)
            shutdown = self._closed or _at_shutdown(e)
            if shutdown:  # Ctrl-C or a closing worker: expected, not a broken loader
                logger.info("tangram: %s (the worker is shutting down)", r.error)
            else:
                logger.warning("tangram: %s", r.error)
            self._report(r, FAILED, f"{SHUTDOWN_PREFIX}{r.error}" if shutdown else str(r.error))
            if isinstance(e, LoadGivenUp):  # what its loader may hold stays counted: the scheduler's ledger too
                self._report_hold(r, "stalled", e.hold, e.per_gpu)

    def _load_in(self, r: Replica, evict: tuple[int, ...]) -> None:
        """:meth:`_load` less its failure handling: its frame (the scorer it holds) has ended when that runs."""
        for e in evict:
            if e != r.rid:
                self.evict(e)
        entry = self.models(r.model)
        k = len(r.gpus)
        with self._cond:
            size = self._sizes.get(r.model)
        known = size.nbytes if size is not None and size.loader is entry.loader else None
        # what its loads here measured, once one has: the registered memory_gb may be far off either way, and one
        # declared larger than it is (0.2 GB for 0.03) was refused for room at each reload beside other replicas
        # that the scheduler, planning with the measured size, had rightly placed it beside (before session 35).
        # The scheduler plans with the latest size any worker measured; where this worker measured it larger (a CUDA
        # probe here, parameter bytes there), a refusal at that size reports it below, as a load measured and then
        # refused does, and the scheduler plans with it. (Capped at the registered size instead, a load went ahead
        # into less room than this worker had seen it take: on a GPU, out of memory inside the loader, counted as
        # the loader's failure; helper-47's review.)
        own = known is not None
        est = math.ceil((known if own else entry.memory_bytes) / k)
        where = (f"what its last load here measured, {known / 1e9:g} GB" if own else
                 f"its registered memory_gb = {entry.memory_bytes / 1e9:g}")
        advice = (f"expected by {where}; the scheduler's ledger had room for it here, so its figures for this GPU "
                  f"differ from this worker's")
        self._report(r, LOADING)
        with self._cond:
            # room may be on its way (a stale replica the scheduler is having evicted): wait a while
            deadline = time.monotonic() + self.room_wait_s
            while not self._closed and not all(self.used[g] + est <= self.capacity[g] for g in r.gpus):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self.replicas.get(r.rid) is not r:
                return
            try:
                self._take(r, est, "is expected to take", advice)
            except ModelError:
                if own:
                    # refused by what its last load here measured: the report says so (what it takes, as measured),
                    # as a load measured then refused does, and the scheduler plans with it. Before, it reported
                    # nothing taken where the scheduler planned with a smaller size measured elsewhere: it placed
                    # the replica here again, each action waiting room_wait_s and erring
                    r.took = est
                    r.param_bytes, r.measured_by, r.load_s = size.param_bytes, size.measured_by, size.load_s
                    # and whether that load was the process's first: a cold first load's time (9.1 s against 0.13 s
                    # for all-MiniLM-L6-v2 on an H200) reported as a reload's, the scheduler planned reloads with it
                    r.first = size.first
                raise
            r.bytes_per_gpu = est
        locks = [self._gpu_locks[g] for g in sorted(set(r.gpus))]
        for lk in locks:  # one load per GPU at a time, so CUDA's counters measure this one alone
            lk.acquire()
        try:
            with self._cond:
                hung_seq = self._hung_seq
                hung_beside = any(set(gpus) & set(r.gpus) for gpus, _ in self._hung.values())
            token = self.probe.before(r.devices)
            t0 = time.perf_counter()
            scorer = self._call_loader(entry, r)
            if not callable(getattr(scorer, "score", None)):
                raise ModelError(f"{LOADER_FAILED}{r.model!r} returned {type(scorer).__name__}, which has "
                                 f"no score(batch) method")
            load_s = time.perf_counter() - t0
            measured = self.probe.after(r.devices, token)
            with self._cond:  # a loader given up on ran (or returned) beside it: CUDA's counters mix the two
                if hung_beside or self._hung_seq != hung_seq or any(
                        set(gpus) & set(r.gpus) for gpus, _ in self._hung.values()):
                    measured = None
        finally:
            for lk in reversed(locks):
                lk.release()
        try:
            pb = param_bytes(scorer)
        except ModelError as e:
            raise ModelError(f"model {r.model!r}: {e}") from None
        if measured:
            per_gpu, by = max(measured), self.probe.name
        else:
            per_gpu, by = math.ceil(pb / k), "params"
        with self._cond:
            if self.replicas.get(r.rid) is not r:
                return
            for g in r.gpus:
                self.used[g] -= r.bytes_per_gpu
            r.bytes_per_gpu = 0
            r.param_bytes, r.measured_by, r.load_s = pb, by, load_s  # measured, kept or not
            r.first = self._loaded.get(r.model) is not entry.loader
            self._sizes[r.model] = LastLoad(entry.loader, per_gpu * k, pb, by, load_s, r.first)
            try:
                self._take(r, per_gpu, "took")
            except ModelError:  # it did not fit: the report says what it took
                scorer = None
                r.took = per_gpu
                raise
            r.bytes_per_gpu = per_gpu
            self._loaded[r.model] = entry.loader
            r.scorer, r.state = scorer, RESIDENT
            scorer = None  # the replica holds it: an action may evict it as soon as it is ready, and it then goes
            self.stats.loads += 1
            self._cond.notify_all()
        r.ready.set()
        self._report(r, RESIDENT)

    def _call_loader(self, entry: ModelEntry, r: Replica) -> Any:
        """The loader's scorer; with a deadline (``entry.timeout_s``) the loader runs in a thread of its own.

        A loader that has not returned by then (a stalled download or file system) fails the load: the
        action that needs it errs, the scheduler places the replica elsewhere, and this GPU's load thread
        serves the next load. Python cannot stop the loader's thread, so what it may allocate stays counted
        on its GPUs (the load's estimate) until it returns; what it returns then is dropped."""
        timeout = entry.timeout_s
        if timeout is None:
            try:
                return entry.loader(r.devices)
            except Exception as e:
                raise self._loader_error(r, e) from e
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["scorer"] = entry.loader(r.devices)
            except BaseException as e:  # handed to the load thread, or dropped once given up on
                box["error"] = e
            with self._cond:  # either the load thread takes what it returned, or it was given up on
                given_up = box.get("given_up")
                if given_up is None:
                    box["done"] = True
            if given_up is None:
                done.set()
            else:
                self._hung_returned(r, given_up, box)

        threading.Thread(target=run, daemon=True, name=f"tangram-loader-{r.model}-{r.rid}").start()
        until = time.monotonic() + timeout
        while not done.wait(min(max(until - time.monotonic(), 0.0), 0.5)) and time.monotonic() < until:
            if self._closed:  # the worker closes: its load thread must not hold its exit up for the deadline
                break
        if not done.is_set():
            with self._cond:
                hung = not box.get("done")
                if hung:  # its estimate stays taken until it returns: the replica no longer counts it
                    self._hung_seq += 1
                    box["given_up"] = self._hung_seq
                    self._hung[self._hung_seq] = (r.gpus, r.bytes_per_gpu)
                    r.bytes_per_gpu = 0
            if hung:
                raise LoadGivenUp(box["given_up"], self._hung[box["given_up"]][1],
                                  f"{LOADER_FAILED}{r.model!r} did not return within {timeout:g} s on GPUs "
                                 f"{list(r.gpus)} (devices {list(r.devices)}): the load is given up (raise "
                                 f"tangram.worker.load-timeout-s if it is only slow); its thread runs on, and "
                                 f"what it may hold stays counted on those GPUs until it returns")
        err = box.get("error")
        if isinstance(err, Exception):
            raise self._loader_error(r, err) from err
        if err is not None:  # KeyboardInterrupt, SystemExit: as they are
            raise err
        return box["scorer"]

    @staticmethod
    def _loader_error(r: Replica, e: Exception) -> ModelError:
        return ModelError(f"{LOADER_FAILED}{r.model!r} failed on GPUs {list(r.gpus)} "
                          f"(devices {list(r.devices)}): {type(e).__name__}: {e}")

    def _hung_returned(self, r: Replica, key: int, box: dict[str, Any]) -> None:
        """A loader given up on returned at last: what it returned is dropped, its GPUs' estimate freed."""
        box.clear()
        with self._cond:
            gpus, per_gpu = self._hung.pop(key, ((), 0))
            for g in gpus:
                self.used[g] -= per_gpu
            self._cond.notify_all()
        gc.collect()
        self.probe.freed(r.devices)
        self._report_hold(r, "unstalled", key, per_gpu)
        logger.warning("tangram: the loader of model %r given up on (replica %d) returned after all: dropped; its "
                       "GPUs %s are free again", r.model, r.rid, list(r.gpus))

    def _report_hold(self, r: Replica, state: str, key: int, per_gpu: int) -> None:
        with self._cond:
            free = tuple(c - u for c, u in zip(self.capacity, self.used))
        try:
            self.report(ResidencyReport(r.rid, r.model, state, r.gpus, per_gpu, free_bytes=free, hold=key))
        except Exception:  # reporting must never break residency
            logger.exception("tangram: could not report load %d of replica %d %s", key, r.rid, state)

    def _report(self, r: Replica, state: str, error: str = "") -> None:
        with self._cond:
            free = tuple(c - u for c, u in zip(self.capacity, self.used))
        held = r.took if state == FAILED else r.bytes_per_gpu
        try:
            self.report(ResidencyReport(r.rid, r.model, state, r.gpus, held, r.param_bytes,
                                        r.measured_by, r.load_s, error, free, r.first))
        except Exception:  # reporting must never break residency
            logger.exception("tangram: could not report replica %d %s", r.rid, state)


def _forget_locals(*errors: BaseException | None) -> None:
    """Clear the local variables of the ended frames in the tracebacks of ``errors`` and of the exceptions they were
    raised from. A failed load's error is kept (the replica's, raised to each action granted it) for as long as the
    failed replica is known here, and its traceback held the loader's frames: what the loader had read before it
    raised (a checkpoint, a model on the GPU that did not fit), or the scorer whose size was refused, stayed in
    memory while the ledger counted none of it (300 MB per failed load, measured; session 35)."""
    seen: set[int] = set()
    todo = [e for e in errors if e is not None]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # (an executing frame is left as is)
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]


def _copy_error(e: BaseException) -> BaseException:
    """``e`` anew, to raise: its type, arguments and attributes, what it was raised from, and its traceback (the
    load's) as its own start; raising it leaves ``e`` as it was. (No ``__init__`` call: :class:`LoadGivenUp`'s
    takes other arguments than its ``args``.)"""
    new = type(e).__new__(type(e), *e.args)
    new.__dict__.update(vars(e))
    new.__cause__, new.__context__, new.__suppress_context__ = e.__cause__, e.__context__, e.__suppress_context__
    return new.with_traceback(e.__traceback__)


def _at_shutdown(e: BaseException | None) -> bool:
    """The error, or one it was raised from, is the interpreter's own refusal while it shuts down (a loader
    that starts threads, as torch's and transformers' do, after the worker process was told to exit)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, RuntimeError) and "interpreter shutdown" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False
