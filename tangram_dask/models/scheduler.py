"""The scheduler side of reward-model residency: registrations in, measurements to the policy.

``install_residency(plugin, scheduler)`` is called once by
:meth:`tangram_dask.scheduler.TangramSchedulerPlugin.start`. It installs:

- ``tangram_register_model`` (client -> scheduler): the policy learns the model
  (``Policy.set_model``) and every connected worker gets the registration;
- ``tangram_models`` (worker or client -> scheduler): the registrations (with
  their pickled loaders for a worker that asks), and for a client what is
  resident where and what was measured;
- ``tangram_residency`` (a worker's stream): one replica changed state. The
  first load of a model measures its memory and load time; the policy is told
  (``Policy.set_model``) so later decisions use what the load really took.

It decides nothing: which replica, where, load or evict stays the policy's.
It keeps the workers' residency equal to the policy's ledger: a replica
resident on a worker that the policy does not hold (its eviction was decided
in a grant that never reached the worker: the task was cancelled on the way)
is evicted on the worker (``tangram_worker_evict``), on each report and once
a second (:meth:`SchedulerResidency.reconcile`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..cluster import ModelSpec
from ..errors import ModelError
from ..messages import (MODELS_HANDLER, REGISTER_MODEL_HANDLER, RESIDENCY_HANDLER, WORKER_EVICT_HANDLER,
                        WORKER_MODEL_HANDLER, ModelRegistration, ResidencyReport)
from .registry import check_model_fields
from .residency import LOADER_FAILED

logger = logging.getLogger("tangram_dask.models")

#: A model whose loader failed this many times in a row is refused (``Policy.model_broken``); every BROKEN_RETRY_S
#: seconds one action of it is let through to try it again (``Policy.model_probe``), until a load of it works or
#: it is registered again
BROKEN_AFTER = 3
BROKEN_RETRY_S = 60.0


@dataclass
class Measured:
    """What loads of one model really took (the latest resident report)."""

    memory_gb: float  # one replica, all its GPUs together, as the worker accounts it
    param_bytes: int
    load_s: float  # the latest load
    measured_by: str
    loads: int = 0
    warm_load_s: float | None = None  # the latest load that was not its worker process's first of this model
    planned_load_s: float = 0.0  # what the policy plans a load of it to take (see _measured)


@dataclass
class SchedulerResidency:
    """The scheduler's view of models and their replicas (``plugin.residency``)."""

    plugin: Any
    scheduler: Any
    registrations: dict[str, ModelRegistration] = field(default_factory=dict)
    measured: dict[str, Measured] = field(default_factory=dict)
    replicas: dict[str, dict[int, ResidencyReport]] = field(default_factory=dict)  # worker -> replica -> last
    counts: Counter = field(default_factory=Counter)  # load_starts, loads, evictions, failures, stale (events)
    failed_in_a_row: Counter = field(default_factory=Counter)  # model -> its loader's failures since it last loaded
    broken_since: dict = field(default_factory=dict)  # model -> monotonic time it was marked broken
    # (worker, replica) -> model: a background load (a Load decision) whose loader failed; the action granted
    # that replica tries the load again, and that second failure is the same action's: it does not count again
    _retrying: dict = field(default_factory=dict)
    _evicting: set = field(default_factory=set)  # (worker, replica) evict requests in flight
    # model -> the (worker, replica) of an earlier loader still resident when it was registered with a new one: the
    # policy counts the model at least as big as the largest of them until they have left (_old_floor)
    _old_loader: dict = field(default_factory=dict)

    def install(self, reconcile_s: float = 1.0) -> None:
        from tornado.ioloop import PeriodicCallback

        s = self.scheduler
        s.handlers[REGISTER_MODEL_HANDLER] = self.handle_register
        s.handlers[MODELS_HANDLER] = self.handle_models
        s.stream_handlers[RESIDENCY_HANDLER] = self.handle_report
        pc = PeriodicCallback(self.tick, reconcile_s * 1000)
        s.periodic_callbacks["tangram-residency"] = pc  # stopped with the scheduler
        pc.start()

    # -- registration ----------------------------------------------------------------------
    async def handle_register(self, registration: dict) -> dict[str, Any]:
        try:  # the client checks these; a raw RPC (or another client) may not have: refused, nothing changes
            d = dict(registration)
            check_model_fields(d.get("name"), d.get("memory_gb"), d.get("units", (1, 1)), d.get("load_s", 1.0))
            reg = ModelRegistration.from_msg(d)
        except Exception as e:
            return {"status": "error", "message": f"{type(e).__name__}: {e}" if not isinstance(e, ModelError)
                    else str(e)}
        old = self.registrations.get(reg.name)
        self.registrations[reg.name] = reg
        self._forget_failures(reg.name)  # registered again: its loads are tried again
        self.broken_since.pop(reg.name, None)
        if self.plugin.policy is not None:  # (set_model below runs only if its figures changed)
            self.plugin.policy.model_mended(reg.name)
        if old is None or old.loader != reg.loader or reg.name not in self.measured:
            # a new loader: measure again. The same loader registered again (a second client, a notebook cell run
            # twice) keeps what its loads measured, and its replicas resident at that size stay. Before session 31
            # a smaller memory_gb here shrank them in the policy's ledger: another model was then placed beside
            # one on a GPU without the room, its worker refused it, and each of its actions failed, blaming it
            self.measured.pop(reg.name, None)
            if old is not None:
                # the old loader's replicas stay resident at their measured size: the policy's ledger counts the
                # model at least that big until they have left, also once the new loader's loads measured it
                # (before session 35, only until then: a smaller new model shrank the old replicas there)
                self._old_loader.setdefault(reg.name, set()).update(
                    (w, rid) for w, reps in self.replicas.items() for rid, r in reps.items()
                    if r.model == reg.name and r.state == "resident")
        self._retell(reg.name)
        msg = {"op": WORKER_MODEL_HANDLER, "registration": reg.to_msg()}
        # not to the workers declared without GPUs: they have no handler for it, and each logged an ERROR.
        # A worker not declared yet is told (its plugin may be past its own fetch of the registrations)
        nodes = getattr(self.plugin, "nodes", {})
        to = [w for w in self.scheduler.workers if w not in nodes or nodes[w].gpus]
        replies = await self.scheduler.broadcast(msg=msg, workers=to, on_error="return_pickle") if to else {}
        failed = sorted(str(w) for w, r in replies.items() if not (isinstance(r, dict) and r.get("status") == "OK"))
        logger.info("tangram: model %s registered (%g GB, load %g s, units %s); %d workers told",
                    reg.name, reg.memory_gb, reg.load_s, reg.units, len(replies) - len(failed))
        return {"status": "OK", "workers": len(replies) - len(failed), "not_told": failed}

    def handle_models(self, loaders: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"models": {}}
        for name, reg in self.registrations.items():
            m = reg.to_msg()
            if not loaders:
                del m["loader"]
            out["models"][name] = m
        if not loaders:
            out["measured"] = {n: vars(m).copy() for n, m in self.measured.items()}
            live = self.scheduler.workers
            out["replicas"] = {w: {rid: r.to_msg() for rid, r in reps.items()}
                               for w, reps in self.replicas.items() if w in live}
            out["counts"] = dict(self.counts)
        return out

    # -- reports -----------------------------------------------------------------------------
    def handle_report(self, worker: str = "", report: dict | None = None, **_: Any) -> None:
        try:
            r = ResidencyReport.from_msg(report or {})
        except Exception:
            logger.exception("tangram: malformed residency report from %s: %r", worker, report)
            return
        if r.state in ("stalled", "unstalled"):
            self._stalled(worker, r)
            return
        reps = self.replicas.setdefault(worker, {})
        if r.state in ("evicted", "failed"):
            reps.pop(r.replica, None)
            if (worker, r.replica) in self._old_loader.get(r.model, ()):
                self._retell(r.model)  # a replica of its earlier loader left: the policy may count it smaller
        else:
            reps[r.replica] = r
        self.counts[{"loading": "load_starts", "resident": "loads", "evicted": "evictions",
                     "failed": "failures"}.get(r.state, r.state)] += 1
        if r.state == "failed":
            logger.warning("tangram: worker %s could not load replica %d of %s: %s", worker, r.replica, r.model,
                           r.error)
            if r.error.startswith(LOADER_FAILED):  # its loader raised or never returned (not: no room, not: shut down)
                self._loader_failed(worker, r)
        elif r.state in ("resident", "evicted") and self._retrying:
            self._retrying.pop((worker, r.replica), None)
        if r.state == "resident":
            self._forget_failures(r.model)
            if self.broken_since.pop(r.model, None) is not None and self.plugin.policy is not None:
                self.plugin.policy.model_mended(r.model)  # a probe's load worked: the model serves again
                logger.warning("tangram: model %s loaded again: its actions are taken again", r.model)
        did_not_fit = r.state == "failed" and r.bytes_per_gpu > 0  # a load measured, then refused for room
        if r.state == "resident" or did_not_fit:
            self._measured(r)  # a load that did not fit was measured too: the policy plans with its real size
        if did_not_fit:
            # the policy's memory figures were wrong, not the model. The replica leaves the ledger, and the
            # actions that wanted it are placed again with the measured size
            failed = getattr(self.plugin, "replica_failed", None)
            if failed is not None:
                failed(worker, r.replica)
        elif r.state in ("resident", "failed"):
            # a background load (a Load decision) is over. One whose loader failed stays in the ledger: the
            # action granted it retries the load and gets the loader's error (a broken model errs its own
            # actions, and only those)
            ready = getattr(self.plugin, "replica_ready", None)
            if ready is not None:
                ready(worker, r.replica)
        gone = [w for w in self.replicas if w not in self.scheduler.workers]
        for addr in gone:
            del self.replicas[addr]  # workers gone
        if gone and self._old_loader:
            for model in list(self._old_loader):
                self._retell(model)
        self.reconcile()

    def worker_left(self, worker: str) -> None:
        """The scheduler's ``remove_worker``: the worker's replicas leave this view, and a model whose earlier
        loader's replicas were among them is told its size again (:meth:`_old_floor`). Before, that waited for the
        next residency report from any worker: a model registered again with a smaller loader stayed counted at the
        old size, and where no other GPU held that size its actions waited for a report that no load would send."""
        self.replicas.pop(worker, None)
        for model in [m for m, keys in self._old_loader.items() if any(w == worker for w, _ in keys)]:
            self._retell(model)

    def _stalled(self, worker: str, r: ResidencyReport) -> None:
        """A load given up on at its deadline (``stalled``): its loader runs on and may hold its estimate on its
        GPUs, so the policy's ledger holds that memory too, and the replica leaves the ledger (else every later
        action of the model was granted it, on a GPU without the room, and erred). ``unstalled``: the loader
        returned, the memory is free."""
        pol = self.plugin.policy
        if pol is None:
            return
        self.counts[r.state] += 1
        try:
            if r.state == "stalled":
                pol.hold_gpu_memory((worker, r.hold), worker, r.gpus, r.bytes_per_gpu / 1e9)
                failed = getattr(self.plugin, "replica_failed", None)
                if failed is not None:
                    failed(worker, r.replica)
            else:
                pol.release_gpu_memory((worker, r.hold))
        except Exception:  # a policy bug must not take the scheduler's stream down
            logger.exception("tangram: the policy could not take worker %s's stalled load %d", worker, r.hold)
        self._kick()

    def _prune_retrying(self) -> None:
        """The failed background loads whose retry can no longer come: their worker left, or their replica left
        the policy's ledger (each once: replica ids are not reused)."""
        pol, live = self.plugin.policy, self.scheduler.workers
        held = pol.gpu.replicas if pol is not None else {}
        for k in [k for k in self._retrying if k[0] not in live or k[1] not in held]:
            del self._retrying[k]

    def _forget_failures(self, model: str) -> None:
        self.failed_in_a_row.pop(model, None)
        if self._retrying:
            for k in [k for k, m in self._retrying.items() if m == model]:
                del self._retrying[k]

    def _loader_failed(self, worker: str, r: ResidencyReport) -> None:
        """After ``BROKEN_AFTER`` failures of its loader in a row, on any workers, a model is broken: the
        policy rejects its actions with the last error for ``BROKEN_RETRY_S`` (then :meth:`tick` lets it be tried
        again), or until it is registered again; not while a replica of it is resident on a live worker, whose
        loader works. Before session 32 each of
        its actions waited for a load of its own and erred with it, one at a time (each up to the load
        deadline, 30 min, for a loader that never returns).

        A load the policy made ahead of its actions (a ``Load``) that fails counts once with the retry of the
        action granted its replica (before session 33 twice: two actions could break a model)."""
        pol = self.plugin.policy
        at = (worker, r.replica)
        if self._retrying.pop(at, None) is not None:
            return  # the retry of a background load that failed: counted with it
        rep = pol.gpu.replicas.get(r.replica) if pol is not None else None
        if rep is not None and rep.loading and rep.node == worker:  # a background load: its action retries it
            self._retrying[at] = r.model
        n = self.failed_in_a_row[r.model] = self.failed_in_a_row[r.model] + 1
        if pol is not None and r.model in pol.broken:
            self.broken_since[r.model] = time.monotonic()  # (a probe's load failed): the next probe is later
            return
        if n < BROKEN_AFTER or pol is None:
            return
        live = self.scheduler.workers
        if any(x.model == r.model and x.state == "resident"
               for w, reps in self.replicas.items() if w in live for x in reps.values()):
            return  # its loader works (a replica of it serves): the failures are those workers' own
        self.broken_since[r.model] = time.monotonic()
        reason = (f"model {r.model!r} failed to load {n} times in a row, so its actions are refused (every "
                  f"{BROKEN_RETRY_S:g} s one of them tries it again) until a load of it works or it is registered "
                  f"again (tangram_dask.register_model); the last failure: {r.error}")
        logger.error("tangram: %s", reason)
        try:
            pol.model_broken(r.model, reason)
        except Exception:  # a policy bug must not take the scheduler's stream down
            logger.exception("tangram: the policy could not mark model %s broken", r.model)
        self._kick()

    def _kick(self) -> None:
        kick = getattr(self.plugin, "_kick", None)
        if kick is not None:
            kick()

    def tick(self) -> None:
        """Once a second: reconcile, and ask the policy again while GPU actions wait.

        The tangram policy's GPU decisions depend on time as well as on events
        (a model's recent demand decays): with no event, a queue that a load
        could serve now would otherwise wait for the next arrival or end.
        Asking again decides nothing here; the policy does.
        """
        self.reconcile()
        pol = self.plugin.policy
        if self._retrying:
            self._prune_retrying()
        if self.broken_since and pol is not None:  # half-open: after a while, one action of a broken model is tried
            for model, t in list(self.broken_since.items()):
                if model not in pol.broken:  # registered again (set_model cleared it)
                    del self.broken_since[model]
                elif time.monotonic() - t >= BROKEN_RETRY_S:
                    self.broken_since[model] = time.monotonic()  # (the next probe, if this one never comes back)
                    pol.model_probe(model)
                    logger.warning("tangram: model %s: its next action tries it again (refused for %g s after its "
                                   "loads failed)", model, BROKEN_RETRY_S)
        if pol is not None:  # one policy.schedule(now) a second: cheap next to a flush per event
            self._kick()

    def reconcile(self) -> None:
        """Evict, on its worker, each resident replica the policy's ledger does not hold."""
        pol = self.plugin.policy
        if pol is None:
            return
        held = pol.gpu.replicas  # replica id -> the ledger's replica (read only)
        for w, reps in self.replicas.items():
            for rid, r in reps.items():
                if r.state != "resident" or (w, rid) in self._evicting:
                    continue
                k = held.get(rid)
                if k is not None and k.node == w and k.model == r.model:
                    continue
                self._evicting.add((w, rid))
                self.counts["stale"] += 1
                self.scheduler.loop.add_callback(self._evict_stale, w, rid, r.model)

    async def _evict_stale(self, worker: str, rid: int, model: str) -> None:
        try:
            reply = await getattr(self.scheduler.rpc(worker), WORKER_EVICT_HANDLER)(replica=rid, timeout=0.0)
            logger.info("tangram: replica %d of %s on %s is not in the policy's ledger: evict -> %s", rid, model,
                        worker, reply.get("status") if isinstance(reply, dict) else reply)
        except Exception as e:  # the worker left, or is busy: the next round tries again
            logger.debug("tangram: evicting stale replica %d on %s: %s", rid, worker, e)
        finally:
            self._evicting.discard((worker, rid))

    def _measured(self, r: ResidencyReport) -> None:
        k = max(1, len(r.gpus))
        gb = r.bytes_per_gpu * k / 1e9
        prev = self.measured.get(r.model)
        reg = self.registrations.get(r.model)
        # A worker process's first load of a model also pays for what happens once per process (the framework's
        # import, the first CUDA use, a cold file read): on an H200, all-MiniLM-L6-v2's first load took 9.1 s
        # and its reloads 0.13 s. The policy plans with the latest load that was not a first; until there is
        # one, with the first load's time or the declared one, whichever is less (the first is an upper bound).
        warm = prev.warm_load_s if prev else None
        if not r.first:
            warm = r.load_s
        plan = warm if warm is not None else min(r.load_s, reg.load_s if reg else r.load_s)
        m = Measured(gb, r.param_bytes, r.load_s, r.measured_by, (prev.loads if prev else 0) + 1, warm, plan)
        self.measured[r.model] = m
        if prev is None or abs(prev.memory_gb - gb) > 1e-3 * max(gb, 1e-9):
            logger.info("tangram: %s measured: %.4f GB per replica (%s; %d parameter bytes), load %.2f s%s",
                        r.model, gb, r.measured_by, r.param_bytes, r.load_s,
                        f" (declared {reg.memory_gb:g} GB, {reg.load_s:g} s)" if reg else "")
        self._retell(r.model)

    def _old_floor(self, model: str) -> float:
        """The largest measured size (GB) of ``model``'s replicas of an earlier loader still resident on a live
        worker (0 if none); forgets those that left."""
        keys = self._old_loader.get(model)
        if not keys:
            return 0.0
        live, gb = self.scheduler.workers, 0.0
        for w, rid in list(keys):
            r = self.replicas.get(w, {}).get(rid) if w in live else None
            if r is None or r.model != model or r.state != "resident":
                keys.discard((w, rid))
                continue
            gb = max(gb, r.bytes_per_gpu * max(1, len(r.gpus)) / 1e9)
        if not keys:
            del self._old_loader[model]
        return gb

    def _retell(self, model: str) -> None:
        """Tell the policy ``model``'s size and load time: what its loads measured (else what it was registered
        with), and at least the size of its earlier loader's replicas still resident (:meth:`_old_floor`)."""
        m, reg = self.measured.get(model), self.registrations.get(model)
        if m is not None:
            gb, load_s = m.memory_gb, m.planned_load_s / self._time_scale()
        elif reg is not None:
            gb, load_s = reg.memory_gb, reg.load_s
        else:
            return
        self._tell_policy(ModelSpec(model, max(gb, self._old_floor(model)), load_s))

    def _time_scale(self) -> float:
        """The plugin's ``time_scale`` (real seconds per policy second): load times go to the policy divided by it."""
        return getattr(getattr(self.plugin, "options", None), "time_scale", 1.0) or 1.0

    def _tell_policy(self, spec: ModelSpec) -> None:
        pol = self.plugin.policy
        if pol is None:
            return
        old = pol.models.get(spec.name)
        if old == spec:
            return
        pol.set_model(spec)
        kick = getattr(self.plugin, "_kick", None)
        if kick is not None:
            kick()  # a model the queue was waiting for, or room freed: decide again


def install_residency(plugin: Any, scheduler: Any) -> SchedulerResidency:
    """Install the model handlers on ``scheduler`` for ``plugin`` (its ``residency`` attribute)."""
    st = SchedulerResidency(plugin, scheduler)
    st.install()
    plugin.residency = st
    return st
