"""The worker side of reward-model residency: carries out what the grants say.

:class:`WorkerResidency` is created by :class:`tangram_dask.workers.TangramWorkerPlugin`
on every GPU worker. It decides nothing: the policy chose the replica, its
GPUs, whether to load it and what to evict; here

- a task arriving with a grant pins the granted replica, and if it is not
  resident starts loading it in the background (after evicting the grant's
  ``evict`` list, each once no action uses it);
- the task's end unpins it;
- :func:`tangram_dask.reward_model` inside the action blocks until it is
  resident and scores with it;
- every change of a replica's state goes to the scheduler at once, on the
  worker's batched stream (``tangram_residency``), not on the heartbeat.

Models come from the scheduler: it pushes each registration to every worker
(``tangram_worker_model``) and a worker that joins later fetches them all.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from distributed.protocol.pickle import loads

from ..cluster import ModelSpec
from ..errors import ModelError
from ..messages import (MODELS_HANDLER, RESIDENCY_HANDLER, WORKER_EVICT_HANDLER, WORKER_LOAD_HANDLER,
                        WORKER_MODEL_HANDLER, ModelRegistration, ResidencyReport, WorkerDeclaration, granted)
from .residency import CudaProbe, MemoryProbe, ModelEntry, Residency

logger = logging.getLogger("tangram_dask.models")

_ARRIVED = frozenset({"waiting", "ready", "constrained", "executing"})
_ENDED = frozenset({"memory", "error", "released", "forgotten"})
_RUNNING = frozenset({"executing", "long-running", "cancelled", "resumed"})


def cuda_ordinals_ok(facts: Any) -> tuple[bool, str]:
    """Initialise CUDA in this process and check its device numbering against NVML's UUIDs."""
    try:
        import torch
    except ImportError as e:
        return False, f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    torch.cuda.init()
    n = torch.cuda.device_count()
    for pol, k in enumerate(facts.cuda_ordinals):
        if k >= n:
            return False, f"CUDA ordinal {k} of GPU {pol} is past the {n} devices torch sees"
        uuid = str(getattr(torch.cuda.get_device_properties(k), "uuid", "") or "").lower().removeprefix("gpu-")
        want = facts.declaration.device_uuids[pol]
        if uuid and want.startswith("GPU-") and want[4:].lower() != uuid:
            return False, f"torch's cuda:{k} is GPU-{uuid}, NVML's GPU {pol} is {want}"
    return True, ""


class WorkerResidency:
    """Residency on one Dask worker (see the module docstring)."""

    def __init__(self, worker: Any, declaration: WorkerDeclaration, facts: Any = None, prepare: bool = True,
                 load_timeout_s: float = 0.0):
        self.worker = worker
        self.load_timeout_s = load_timeout_s  # tangram.worker.load-timeout-s (0: loads have no deadline)
        self.declaration = declaration
        self.facts = facts
        self.registrations: dict[str, ModelRegistration] = {}
        self._loaders: dict[str, Any] = {}
        self.prepare = prepare  # tangram.worker.prepare-models
        self.prepared: dict[str, str] = {}  # model -> "ok", or why its loader's prepare() failed or did not run here
        # grants for models this worker has no registration for (e.g. models the scheduler only plans, as the
        # live benchmark's): nothing is loaded unless the action asks for the model (reward_model)
        self._deferred: dict[Any, tuple[int, str, tuple[int, ...], tuple[int, ...]]] = {}
        self.cuda = False
        self.cuda_why = "the GPUs are abstract (declared by config, not found through NVML)"
        cap = int(declaration.gpu_memory_gb * 1e9)
        self.residency = Residency([cap] * declaration.gpus, self._entry, self._devices, report=self._report)

    async def start(self) -> None:
        w = self.worker
        w.handlers[WORKER_MODEL_HANDLER] = self._handle_model
        w.handlers[WORKER_EVICT_HANDLER] = self._handle_evict
        w.handlers[WORKER_LOAD_HANDLER] = self._handle_load
        if self.facts is not None:  # real GPUs: initialise CUDA now, with the worker's own device list
            loop = asyncio.get_running_loop()
            self.cuda, self.cuda_why = await loop.run_in_executor(None, cuda_ordinals_ok, self.facts)
            if self.cuda:
                self.residency.probe = CudaProbe()
            else:
                logger.warning("tangram: NVML found GPUs but models will load on the CPU: %s", self.cuda_why)
        try:
            await self._fetch()
        except Exception:  # no tangram plugin on the scheduler: no models to know
            logger.warning("tangram: could not fetch the registered models from the scheduler", exc_info=True)

    def close(self) -> None:
        self.residency.close()

    # -- registrations ------------------------------------------------------------------
    def add(self, reg: ModelRegistration) -> None:
        old = self.registrations.get(reg.name)
        self.registrations[reg.name] = reg
        if old is None or old.loader != reg.loader:
            self._loaders.pop(reg.name, None)
            self.residency.forget_loads(reg.name)  # a new loader's first load is a first again
            if self.prepare:
                why = self._hosts_none(reg)
                if why:
                    self.prepared[reg.name] = why
                else:
                    threading.Thread(target=self._prepare, args=(reg.name, reg.loader), daemon=True,
                                     name=f"tangram-prepare-{reg.name}").start()

    def _hosts_none(self, reg: ModelRegistration) -> str:
        """Why no replica of ``reg`` can ever be placed here ("" if one can), by the policy's own rule
        (:meth:`ModelSpec.replica_gpus`): then preparing it would import its libraries for nothing."""
        d = self.declaration
        k = ModelSpec(reg.name, reg.memory_gb, reg.load_s).replica_gpus(reg.units[0], d.gpu_memory_gb)
        if k <= d.gpus:
            return ""
        return (f"not prepared here: a replica ({reg.memory_gb:g} GB) needs {k} GPUs of {d.gpu_memory_gb:g} GB, "
                f"this worker has {d.gpus}")

    def _prepare(self, name: str, pickled: bytes) -> None:
        """``prepare-models``: the loader's ``prepare()`` (imports, no model loaded), in the background. The first
        load of a model in a worker process paid the import of its libraries: MiniLM's first load took 9-14 s on
        the H200, its reloads 0.1 s. A loader without ``prepare`` is left alone; one that fails is logged."""
        try:
            loader = loads(pickled)
            prep = getattr(loader, "prepare", None)
            if not callable(prep):
                return
            prep()
            self.prepared[name] = "ok"
        except Exception as e:  # the load will meet the same error, and report it to the action that needs it
            self.prepared[name] = f"{type(e).__name__}: {e}"
            logger.warning("tangram: preparing model %r failed: %s", name, self.prepared[name])

    def _handle_model(self, registration: dict) -> dict:
        self.add(ModelRegistration.from_msg(registration))
        return {"status": "OK"}

    async def _handle_evict(self, replica: int, timeout: float = 60.0) -> dict:
        loop = asyncio.get_running_loop()
        try:
            done = await loop.run_in_executor(None, self.residency.evict, int(replica), timeout)
        except ModelError as e:
            return {"status": "busy", "error": str(e)}
        return {"status": "OK" if done else "absent"}

    async def _handle_load(self, replica: int, model: str, gpus: list, evict: list | tuple = (),
                           wait: bool = False, timeout: float = 600.0) -> dict:
        """Load ahead: replica ``replica`` of ``model`` on ``gpus`` (after ``evict``), before its actions come."""
        r = self.residency.load_ahead(int(replica), str(model), tuple(gpus), tuple(evict))
        if wait:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, r.ready.wait, timeout)
        out = {"status": r.state}
        if r.error is not None:
            out["error"] = str(r.error)
        return out

    def _entry(self, name: str) -> ModelEntry:
        reg = self.registrations.get(name)
        if reg is None:  # registered after this worker's last word from the scheduler: ask
            fut = asyncio.run_coroutine_threadsafe(self._fetch(), self.worker.loop.asyncio_loop)
            fut.result(30)
            reg = self.registrations.get(name)
        if reg is None:
            raise ModelError(f"model {name!r} is not registered (registered: {sorted(self.registrations)}): call "
                             f"tangram_dask.register_model(client, {name!r}, loader, memory_gb=...) first")
        loader = self._loaders.get(name)
        if loader is None:
            try:
                loader = self._loaders[name] = loads(reg.loader)
            except Exception as e:
                raise ModelError(f"the loader of model {name!r} cannot be unpickled on this worker: "
                                 f"{type(e).__name__}: {e} (is its module importable here?)") from e
        t = self.load_timeout_s
        return ModelEntry(name, loader, int(reg.memory_gb * 1e9), max(t, 10 * reg.load_s) if t > 0 else None)

    async def _fetch(self) -> None:
        reply = await getattr(self.worker.scheduler, MODELS_HANDLER)(loaders=True)
        for name, msg in (reply or {}).get("models", {}).items():
            try:  # one bad registration leaves the others known
                self.add(ModelRegistration.from_msg(msg))
            except Exception:
                logger.exception("tangram: the registration of model %r could not be taken; the others are", name)

    def _devices(self, gpus: tuple[int, ...]) -> tuple[str, ...]:
        if self.cuda:
            return tuple(f"cuda:{self.facts.cuda_ordinals[g]}" for g in gpus)
        return tuple("cpu" for _ in gpus)

    # -- the worker's stream --------------------------------------------------------------
    def _report(self, report: ResidencyReport) -> None:
        msg = {"op": RESIDENCY_HANDLER, "report": report.to_msg()}
        self.worker.loop.add_callback(self.worker.batched_send, msg)

    # -- task transitions (the worker plugin's hook, on the event loop) ------------------
    def transition(self, key: Any, start: str, finish: str) -> None:
        if finish in _ENDED:
            # the hook names the state asked for: a running task asked to be released is "cancelled" and its
            # thread runs on, using its replica, until it returns; it is unpinned on its way out
            ts = self.worker.state.tasks.get(key)
            if ts is None or ts.state not in _RUNNING:
                self.residency.unpin(key)
                self._deferred.pop(key, None)
            return
        if finish not in _ARRIVED or key in self.residency.pins:
            return
        ts = self.worker.state.tasks.get(key)
        ann = (ts.annotations or {}).get("tangram") if ts is not None else None
        if not isinstance(ann, dict):
            return
        grant = granted(ts.annotations)
        if grant is None or grant.replica is None or not ann.get("model"):
            return
        args = (grant.replica, str(ann["model"]), grant.gpus, grant.evict)
        if args[1] not in self.registrations:
            self._deferred[key] = args  # no scheduler round trip, no load, per action of an unregistered model
            return
        self.residency.prepare(key, *args)

    def prepare_deferred(self, key: Any) -> None:
        """The action asks for its model after all (its registration may have arrived late): load it now."""
        args = self._deferred.pop(key, None)
        if args is not None and key not in self.residency.pins:
            self.residency.prepare(key, *args)

    def snapshot(self) -> dict[str, Any]:
        snap = self.residency.snapshot()
        snap["cuda"] = self.cuda
        snap["cuda_why"] = "" if self.cuda else self.cuda_why
        snap["probe"] = self.residency.probe.name
        snap["prepared"] = dict(self.prepared)
        return snap


__all__ = ["WorkerResidency", "MemoryProbe"]
