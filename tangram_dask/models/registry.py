"""Registering reward models (client side) and reaching the granted replica (inside an action).

    rm = tangram_dask.register_model(client, "rm-small", rm_small(), memory_gb=0.001, load_s=0.1)
    with rm.action(hint_s=0.05):                      # resource="gpu", model="rm-small", units from the model
        fut = client.submit(judge, "the answer is 4", "4")

    def judge(response, reference):                   # runs on the GPU worker the scheduler chose
        return tangram_dask.reward_model("rm-small").score([(response, reference)])[0]

A loader is any picklable callable ``(devices) -> scorer`` where ``devices``
is one device string per granted GPU (``"cuda:1"`` where CUDA exists, else
``"cpu"``) and ``scorer.score(batch) -> list[float]``.
"""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..errors import ModelError
from ..messages import MODELS_HANDLER, REGISTER_MODEL_HANDLER, ModelRegistration


@dataclass(frozen=True)
class RegisteredModel:
    """What :func:`register_model` returns: the model's name and the units its actions take."""

    name: str
    units: tuple[int, int]
    memory_gb: float
    load_s: float

    @contextmanager
    def action(self, kind: str | None = None, **fields: Any) -> Iterator[Any]:
        """``tangram_dask.action(...)`` for a scoring action of this model (GPU, its units)."""
        from ..annotate import action

        fields.setdefault("units", self.units)
        with action(kind or f"score:{self.name}", "gpu", model=self.name, **fields) as spec:
            yield spec


def check_model_fields(name: Any, memory_gb: Any, units: Any, load_s: Any) -> tuple[str, float, tuple[int, int],
                                                                                   float]:
    """``(name, memory_gb, (min, max), load_s)`` of a registration, else ModelError naming the bad field. The
    client checks them (``make_registration``) and so does the scheduler (a raw RPC, or an older client, may
    not have: one NaN there made every worker's model handler raise and stopped a joining worker's fetch)."""
    if not isinstance(name, str) or not name.strip():
        raise ModelError(f"register_model: name = {name!r}: must be a non-empty string")
    try:
        mem = float(memory_gb)
    except (TypeError, ValueError):
        raise ModelError(f"register_model({name!r}): memory_gb = {memory_gb!r} is not a number") from None
    if not (math.isfinite(mem) and mem > 0):
        raise ModelError(f"register_model({name!r}): memory_gb = {memory_gb!r}: must be a finite number > 0 "
                         f"(the memory of one replica, in GB)")
    bad = ModelError(f"register_model({name!r}): units = {units!r}: must be n or (min, max) with "
                     f"1 <= min <= max GPUs")
    if isinstance(units, numbers.Integral) and not isinstance(units, bool):
        lo = hi = units
    elif isinstance(units, (str, bytes)):  # (b"12" would unpack to two ints)
        raise bad
    else:
        try:
            lo, hi = units
        except (TypeError, ValueError):
            raise bad from None
    if not all(isinstance(u, numbers.Integral) and not isinstance(u, bool) for u in (lo, hi)) or not 1 <= lo <= hi:
        raise bad
    try:
        ls = float(load_s)
    except (TypeError, ValueError):
        raise ModelError(f"register_model({name!r}): load_s = {load_s!r} is not a number") from None
    if not (math.isfinite(ls) and ls >= 0):
        raise ModelError(f"register_model({name!r}): load_s = {load_s!r}: must be a finite number >= 0")
    return name, mem, (int(lo), int(hi)), ls


def make_registration(name: str, loader: Callable[..., Any], *, memory_gb: float,
                      units: int | tuple[int, int] = (1, 1), load_s: float = 1.0) -> ModelRegistration:
    """Check the arguments of :func:`register_model` and build its message (ModelError naming a bad one)."""
    from distributed.protocol.pickle import dumps

    name, mem, (lo, hi), ls = check_model_fields(name, memory_gb, units, load_s)
    if not callable(loader):
        raise ModelError(f"register_model({name!r}): loader = {loader!r} is not callable: pass a function "
                         f"(devices) -> scorer")
    try:
        blob = dumps(loader)
    except Exception as e:
        raise ModelError(f"register_model({name!r}): the loader cannot be pickled ({type(e).__name__}: {e}); "
                         f"define it at module level or as a picklable object") from None
    return ModelRegistration(name, blob, mem, (lo, hi), ls)


def register_model(client: Any, name: str, loader: Callable[..., Any], *, memory_gb: float,
                   units: int | tuple[int, int] = (1, 1), load_s: float = 1.0) -> Any:
    """Register a reward model with the scheduler and every worker (workers joining later fetch it).

    ``memory_gb``: one replica's memory (all its GPUs together) and ``load_s``
    its load time, as declared; the scheduler's policy replaces both with what
    the first load measured. ``units``: GPUs per scoring action, n or (min, max).
    Registering a name again replaces its loader (replicas already resident stay).
    Returns a :class:`RegisteredModel`; on an asynchronous client, an awaitable of one
    (``rm = await register_model(client, ...)``). Bad arguments raise at the call either way.
    """
    reg = make_registration(name, loader, memory_gb=memory_gb, units=units, load_s=load_s)
    return client.sync(_register, client, reg)


async def _register(client: Any, reg: ModelRegistration) -> RegisteredModel:
    rpc = getattr(client.scheduler, REGISTER_MODEL_HANDLER)
    try:
        reply = await rpc(registration=reg.to_msg())
    except Exception as e:
        raise ModelError(f"register_model({reg.name!r}): the scheduler did not take it ({type(e).__name__}: {e}); "
                         f"does it run the tangram scheduler plugin?") from e
    if reply is None:  # what a scheduler without the handler answers
        from ..annotate import _missing

        raise ModelError(f"register_model({reg.name!r}): {_missing(client.scheduler.address)}")
    if isinstance(reply, dict) and reply.get("status") == "error" and reply.get("message"):
        raise ModelError(f"the scheduler refused it: {reply['message']}")
    if not isinstance(reply, dict) or reply.get("status") != "OK":
        raise ModelError(f"register_model({reg.name!r}): the scheduler answered {reply!r}")
    return RegisteredModel(reg.name, reg.units, reg.memory_gb, reg.load_s)


def models_snapshot(client: Any) -> Any:
    """Registered models, what their loads measured, what is resident on which worker, counts.

    On an asynchronous client, an awaitable of that dict."""
    return client.sync(getattr(client.scheduler, MODELS_HANDLER), loaders=False)


class RewardModel:
    """The replica granted to the running action; :meth:`score` waits until it is resident."""

    def __init__(self, name: str, residency: Any, key: Any, timeout: float | None):
        self.name = name
        self._residency = residency
        self._key = key
        self._timeout = timeout

    @property
    def scorer(self) -> Any:
        return self._residency.get(self._key, self._timeout)

    def score(self, batch: Sequence[Any]) -> list[float]:
        """Score a batch with the granted replica (each item: (response, reference) for the built-in models).

        One score per item, or a ModelError naming the model: a scorer that returned fewer or more (a bug in it)
        had its rewards paired with the wrong items, or dropped, in silence."""
        out = list(self.scorer.score(batch))
        n = len(batch) if hasattr(batch, "__len__") else None
        if n is not None and len(out) != n:
            raise ModelError(f"the scorer of model {self.name!r} returned {len(out)} scores for a batch of {n} items: "
                             f"its score(batch) must return one per item, in order")
        return out

    @property
    def devices(self) -> tuple[str, ...]:
        """Where the replica lives: ``("cuda:0",)``, or ``("cpu",)`` where there is no CUDA."""
        return self._replica().devices

    def info(self) -> dict[str, Any]:
        """The replica's residency facts (bytes per GPU, parameter bytes, how measured, load time)."""
        self.scorer  # resident first
        r = self._replica()
        return {"replica": r.rid, "model": r.model, "gpus": r.gpus, "devices": r.devices,
                "bytes_per_gpu": r.bytes_per_gpu, "param_bytes": r.param_bytes, "measured_by": r.measured_by,
                "load_s": r.load_s, "first": r.first}

    def _replica(self) -> Any:
        res = self._residency
        return res.replicas[res.pins[self._key]]


def reward_model(name: str, *, timeout: float | None = None) -> RewardModel:
    """Inside a GPU action: the replica of ``name`` the scheduler granted it (ModelError elsewhere)."""
    from distributed import get_worker
    from distributed.worker import thread_state

    from ..allocation import current_allocation
    from ..workers import PLUGIN_NAME

    alloc = current_allocation()
    if alloc is None or alloc.resource != "gpu":
        raise ModelError(f"reward_model({name!r}) is called outside a GPU action: submit the function inside "
                         f"tangram_dask.action(resource='gpu', model={name!r}, ...)")
    if alloc.model != name:
        raise ModelError(f"reward_model({name!r}): this action was granted a replica of {alloc.model!r}, not "
                         f"{name!r} (its spec says model={alloc.model!r})")
    plugin = get_worker().plugins.get(PLUGIN_NAME)
    residency = getattr(getattr(plugin, "residency", None), "residency", None)
    if residency is None:
        raise ModelError(f"reward_model({name!r}): this worker keeps no models (it declared no GPU, or the "
                         f"tangram worker plugin is not installed)")
    plugin.residency.prepare_deferred(thread_state.key)
    return RewardModel(name, residency, thread_state.key, timeout)
