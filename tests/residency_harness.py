"""A test helper (tests/test_models_breaker.py): the scheduler side of residency without Dask: the real
TangramSchedulerPlugin's policy and replica hooks, SchedulerResidency, and real worker Residency ledgers whose
reports go straight to handle_report."""
from __future__ import annotations

import asyncio
import time

import cloudpickle

from tangram_dask import make_spec
from tangram_dask.cluster import GpuNode
from tangram_dask.models import ModelEntry, Residency
from tangram_dask.models.scheduler import SchedulerResidency
from tangram_dask.policy.types import Load, Reject, Start
from tangram_dask.scheduler import TangramSchedulerPlugin


class Loop:
    def __init__(self):
        self.cbs = []

    def add_callback(self, f, *a, **k):
        self.cbs.append((f, a, k))

    def call_later(self, *a, **k):
        pass


class FakeScheduler:
    def __init__(self):
        self.workers = {}
        self.loop = Loop()

    async def broadcast(self, msg=None, workers=(), on_error=None):
        return {w: {"status": "OK"} for w in workers}


class Harness:
    def __init__(self, policy="tangram"):
        self.plugin = TangramSchedulerPlugin(policy=policy)
        self.sched = FakeScheduler()
        self.plugin.scheduler = None  # _kick does nothing
        self.plugin.policy = self.plugin.build_policy()
        self.res = SchedulerResidency(self.plugin, self.sched)
        self.plugin.residency = self.res
        self.workers: dict[str, Residency] = {}
        self.decisions = []
        self.inbox = []
        self.plugin._t0 = time.monotonic()

    def drain(self):
        while self.inbox:
            w, msg = self.inbox.pop(0)
            self.res.handle_report(worker=w, report=msg)

    def add_gpu_worker(self, name, gpus=1, gb=80.0, loaders=None, timeout_s=None, room_wait_s=0.1):
        self.sched.workers[name] = object()
        self.plugin.policy.add_gpu_node(GpuNode(name, gpus, gb, (gpus,)))
        loaders = loaders or {}

        def entry(m):
            spec = self.plugin.policy.models[m]
            return ModelEntry(m, loaders[m], int(spec.gpu_memory_gb * 1e9), timeout_s)

        r = Residency([int(gb * 1e9)] * gpus, entry, lambda g: tuple("cpu" for _ in g),
                      report=lambda rep, w=name: self.inbox.append((w, rep.to_msg())),
                      room_wait_s=room_wait_s)
        self.workers[name] = r
        return r

    def register(self, name, loader, memory_gb, load_s=1.0):
        reg = {"name": name, "loader": cloudpickle.dumps(loader), "memory_gb": memory_gb, "units": (1, 1),
               "load_s": load_s}
        return asyncio.run(self.res.handle_register(reg))

    def schedule(self, now):
        out = self.plugin.policy.schedule(now)
        self.decisions += out
        return out


def gpu_spec(model, hint_s=1.0):
    return make_spec("judge", "gpu", 1, hint_s=hint_s, model=model)


class Scorer:
    def __init__(self, nbytes):
        self.param_bytes = nbytes

    def score(self, batch):
        return [1.0] * len(batch)


class OkLoader:
    def __init__(self, nbytes):
        self.nbytes = nbytes

    def __call__(self, devices):
        return Scorer(self.nbytes)


class FailLoader:
    def __init__(self, msg="no such weights file"):
        self.msg = msg

    def __call__(self, devices):
        raise OSError(self.msg)


def run_action(h, aid, spec, now, timeout=10):
    """Submit, schedule until it starts or is rejected; run it on its worker's ledger; finish it.
    Returns ('rejected', reason) | ('ok', None) | ('erred', message)."""
    pol = h.plugin.policy
    pol.submit(aid, spec, now)
    for _ in range(50):
        h.drain()
        for d in h.schedule(now):
            if isinstance(d, Reject) and d.action == aid:
                return "rejected", d.reason
            if isinstance(d, Load):
                h.workers[d.node].load_ahead(int(d.replica), d.model, d.gpus, tuple(int(e) for e in d.evict))
            if isinstance(d, Start) and d.action == aid:
                w = h.workers[d.node]
                w.prepare(aid, int(d.replica), spec.model, d.gpus, tuple(int(e) for e in d.evict))
                try:
                    w.get(aid, timeout=timeout)
                    out = ("ok", d.replica)
                except Exception as e:
                    out = ("erred", f"replica {d.replica}: {e}")
                w.unpin(aid)
                time.sleep(0.05)
                h.drain()
                pol.finish(aid, now + 0.1, None)
                return out
        now += 0.01
        time.sleep(0.05)
    return "waiting", None
