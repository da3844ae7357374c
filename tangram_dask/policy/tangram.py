"""``tangram``: action-level elastic scheduling. The algorithm: docs/scheduling.md.

Pure: no Dask import. One heap of waiting actions per pool (CPU slots, API
tokens, each model's GPU replicas: :mod:`.queues`); each decision goes
through small phases, each in a module of its own:

1. **order** (``submit``, here): key = ``aging * issued_at + est``; ``est``
   is the posterior expected work (the hint blended with the kind's history,
   see :mod:`.estimate`). Shortest expected work first; the clock term
   bounds any wait (no starvation).
2. **fit**, 3. **place**, 4. **size**: for CPU slots and API tokens
   :mod:`.placement` (a stateful action goes home, an elephant reserves, an
   elastic action takes units while they pay their price); for GPUs
   :mod:`.gpus` (a ready replica of the action's model within one topology
   group), and, where none is ready, :mod:`.residency` (whether a new
   replica is worth its load, where it goes, which replicas may go).
5. **reserve / release**: the ledger takes and returns units (:mod:`.ledger`).

Before any of that, admission (:mod:`.admission`) decides which trajectories
are in flight: only while the expected demand on each resource stays under a
target.

:class:`TangramPolicy` is the policy: its state, set up in ``__init__``, and
the events (submit, finish, cancel, trajectories); the phases are mixins it
is made of, one per module, reading that state.

Cost per decision: O(log n) in the pending actions, O(1) amortised in the
number of nodes (the ledger indexes nodes by free slots); GPU loads scan the
topology groups, and they are rare.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass, replace

from ..cluster import ModelSpec
from ..spec import SECONDS_LIMIT, ActionSpec
from .admission import AdmissionGate
from .base import Policy, Running
from .estimate import BoundedMean, Covariance, Estimator, Welford
from .gpus import GpuPlacement
from .placement import Placement
from .queues import Pending, Pool, Rate, Reservation, _pending
from .residency import _MIN_DEMAND_S, Residency
from .types import GPU_WAIT_REASONS, ActionId, Decision, PoolStats, ReplicaId, Shortfall


@dataclass(frozen=True)
class TangramOptions:
    """Knobs of the tangram policy (defaults are what docs/scheduling.md justifies)."""

    aging: float = 1.0          # priority gained per second waited, in seconds of est work
    price: float = 0.5          # price of a unit-second at occupancy rho is price * rho / (1 - rho)
    horizon_s: float = 30.0     # time constant of the observed slot-release rate and of each model's demand
                                # (at least the model's load_s for its demand)
    demand_loads: float = 20.0  # a model's demand horizon is at most this many of its load_s (0: horizon_s)
    load_patience: float = 1.0  # load a replica when the model's backlog exceeds patience x load_s
    makespan: float = 1.0       # weight of an action's length against a trajectory's (0: off)
    reserve_gain: float = 4.0   # reserve slots for an action when waiting saves > this x the expected wait
    admission: float = 1.0      # admit trajectories while expected CPU demand < this x capacity (0: all at once)
    admission_at_max: float = 0.0  # 1: measure admission demand at units.max, 0: at units.min
    admission_cycles: float = 0.0  # >0: no trajectory waits for admission longer than this many turn cycles
    elephant_z: float = 2.0     # an action is an elephant when log(est) > mean + z sd of its kind's log estimates
    elephant_hint: float = 2.25  # also an elephant when log(hint) > mean + this sd of its kind's log hints (0: off)
    admission_gpu: float = 0.5  # >0: the gate also keeps GPU demand under this x the GPUs, and API demand under
                                # admission_api x the tokens (0: neither)
    admission_api: float = 0.6  # (with admission_gpu) the API term's target (0: admission_gpu's); where the cluster
                                # leans to GPUs, admission_gpu_lean's
    turn_runs: float = 6.0      # >0 (with gate_runs): a finished action's run replaces its estimate in the turn figures
                                # where the two differ by over this x its kind's hint error sd, at least 1 (in log)
    gate_runs: float = 1.0      # 1: an ended trajectory's demand in the gate is what its actions took (their run
                                # times, normalised as the estimator's), not what was expected of them at issue (the
                                # first of each kind are raw hints, exp(sigma^2 / 2) high on average: 1.65x at hint
                                # sigma 1, 3.1x at 1.5); 0: the estimates at issue, as before session 27
    admission_warmup: float = 8.0  # until this many trajectories ended, demand is learned per action and capped
    warmup_units: float = 1.0   # cap until then: 1, one per unit of the scarcest resource seen; 0, one per CPU slot
    admission_queue: float = 1.0  # >0: admit nobody while queued work per unit exceeds this x a mean action
    admit_tail: float = 0.15    # >0: in warm-up, admit all who wait once they are at most this x those in flight
    idle_admit: float = 0.25    # >0: in warm-up, one past the limit per this x a turn cycle while all is idle
    admission_issued: float = 0.0  # >0: CPU demand over every action issued (not those ended) kept under this x slots
    admission_ramp: float = 0.0  # >0: until learned, 16 first, then this x those in flight more; none while any queue
    idle_learned: float = 0.3   # >0: once a trajectory ended, idle admission goes on while the GPU or API limit binds
                                # and every resource is under this x its capacity busy (0: only before any ended)
    admission_measured: float = 0.0  # >0: admission_issued's CPU demand also from measured units.min held/queued
    admission_step: float = 0.0  # >0: admit while waiting > this x in flight x (H_in_flight - 1) (gate sets step)
    admission_knee: float = 0.8  # >0: CPU demand over every issued action at units.max kept under this x slots
                                 # (the knee: past it more in flight shrink actions, not fill slots; under 1,
                                 # headroom for the variance of arrivals: at 1 the slots queue as an M/G/c at rho 1)
    evict_margin: float = 2.0   # a replica its model's demand needs goes only for 2x its demand per GB
    site_rank: float = 1.0     # >0: of a group's idle GPUs equally free, a load takes those whose replicas cost least
    #                            to lose (_evict_rank); 0: the first by index
    site_scan: float = 64.0     # >0: a load ranks at most this many sites that can take it (those it can evict for), in
                                # node order, and takes the best of them (0: every site): on 512 nodes of 8 GPUs it
                                # ranked ~270 sites per load. Decisions change only past that many sites
    evict_count: float = 1.0    # 1: a replica is beyond its model's need counting those one load evicts before it
                                # (0: each judged alone, so one load could take every replica its demand needs)
    residency: float = 1.0      # 1: GPU loads and evictions follow each model's recent demand (0: backlog only)
    keep_deployed: float = 1.0  # 1: replicas deployed before the step stay until 8 trajectories ended
    unseen_busy: float = 1.0    # (with keep_deployed) a load site beside such a replica whose model was never called
                                # counts it this busy in its contention (its rewards come last); 0: as idle
    hint_bound: float = 6.0     # >0: a hint's log counts at most this x its kind's spread from its kind's (bad input)
    hint_spread: float = 1.0    # 1: a kind's work spread also from the hints of every issued action (not only finished)
    elephant_move: float = 1.0  # 1: an elephant whose home has little room moves to the node with the most
    elephant_tail: float = 0.5  # >0: once no trajectory waits for admission (the step's tail), an action expected to
                                # run longer than this x the mean trajectory (on units.min) is an elephant too
    admission_model: float = 0.5  # >0: in warm-up, each model's replicas kept under this x busy (per-model gate)
    admission_open: float = 12.0  # >0: with admission_model, this many first, until 4 actions were seen
    plan_loads: float = 1.0     # >0: in warm-up, a model whose replicas cannot serve this x those in flight at
                                # plan_busy busy loads one as soon as one of its actions waits
    plan_keep_last: float = 1.0  # >0: a load the warm-up plan alone asks for evicts no model's last replica
    plan_busy: float = 0.2      # (with plan_loads) that share busy (0: admission_model, 0.5, as before session 20)
    plan_at_once: float = 1.0   # 1 (with plan_loads): a tool model loads every replica plan_loads calls for at once,
                                # not one per action of it waiting
    at_once_safe: float = 1.0   # 1 (with plan_at_once): its loads beyond one per waiting action never leave a deployed
                                # model whose demand the warm-up cannot measure yet with no replica free of loads
    safe_loads: float = 2.0     # >0 (with at_once_safe): so neither does any load made while this many replicas of
                                # its model are loading (those serve the calls waiting now: one more is a forecast's)
    lull_loads: float = 1.0     # 1 (with at_once_safe): once a step's last trajectory ended, the loads at_once_safe
                                # held back during it go, on the same sites, where they evict nothing
    gpu_lean: float = 4.0       # >0: the six above and admission_gpu_lean only on a cluster that leans to GPUs,
                                # CPU slots <= this x GPUs (0: on every cluster)
    admission_gpu_lean: float = 0.55  # >0: admission_gpu (and admission_api) where the per-model gate applies and
                                      # most GPU calls are tools (not rewards): the opening holds ACT, this gives the
                                      # step back (0.7 before gate_runs)
    steps_knee: float = 0.7     # >0: admission_knee at most this once a whole step ended (as steps_gpu_lean below):
                                # the first step's middle was held by its GPU term, read high from the short
                                # trajectories that end first; later steps' GPU term reads them all, and the knee binds
    steps_gpu_lean: float = 0.5  # >0: admission_gpu_lean at most this once a whole step ended (a lull: nothing in
                                 # flight or waiting, admission_warmup trajectories ended): the bias of the first
                                 # step's figure (its short trajectories end first) is gone (0.55, 0.7 x 0.79, before
                                 # gate_runs)
    open_hold: float = 16.0     # >0: once a GPU action was seen, the per-model limit stays under admission_open
                                # until this many actions were seen (4 say little: one short prm hint read 41)
    open_blind: float = 0.0     # >0 (opt-in, with open_hold): while none of the actions seen was a GPU action the
                                # opening also holds until this many were seen (on gpu-xl-heavy the first five were
                                # CPU and API calls: 32 in flight at t = 1.7 s on one process-reward replica)
    stall_free: float = 1.0     # >0 (with residency): a load stalls a model with demand when it leaves none of its
                                # replicas free of loads (beside this one, evicted by it, or beside another load
                                # under way); 0: only when it blocks the model's one replica
    load_one: float = 1.0       # >0 (with residency, where gpu_lean applies; 2: everywhere): while a model's replica
                                # loads, another load of it evicts nothing
    background_load: float = 1.0  # 1 (default): a load is a Load decision no action waits inside; the action that
                                  # wanted it stays queued and takes whichever replica is ready first
    home_reserve: float = 1.0   # 1: a stateful action that waited at home is sized, and reserves as an elephant,
                                # as any other CPU start (0: sized by the price only, on what its home has free)
    gpu_merge: float = 1.0      # 1: models' queues take free GPUs by their heads' keys, one action at a time (0: each
                                # model's queue drained whole, in the order models were first seen)
    gpu_claim: float = 1.0      # 1 (with gpu_merge): a head that waits for the GPUs of a replica of its model claims
                                # them; a later head starts there only if it is expected to end before they all free
    evict_wait: float = 0.25    # >0 (with residency): a model keeps the replicas on which its actions would wait
                                # (M/M/c, Erlang C) at most this x their mean work, and one of them goes for a denser
                                # model only if the rest keep that, its last while a call is expected within one
                                # reload (0: it keeps ceil(demand), a replica per busy one)
    ahead_wait: float = 1.0     # >0: an action is sent ahead of a free slot (the plugin's dispatch-ahead) only to a
                                # node where a running action is expected to end within this many seconds, the most
                                # free of up to 8 such nodes; else it waits here for a slot (0: the most free node)
    pair_floor: float = 1.0     # 1: an elastic CPU action (parallel_fraction > 0) starts on at least units.min + 1
                                # units where its node has them free, whatever the spare cap; where it has only
                                # units.min free, it reserves one more when that saves reserve_gain x the wait for it
                                # (0: the cap and the price only)
    site_wait: float = 1.0      # 1 (with residency): a load that would evict a replica of a model with demand waits
                                # instead for busy GPUs that can take it evicting nothing, when they are expected to
                                # free within its load_s, and claims them meanwhile (0: it evicts at once)
    load_ahead: float = 0.0     # >0 (with background_load): load a replica no action waits for yet when the
                                # waiting it saves over this x the model's horizon (Erlang C) beats load_s x
                                # GPUs, on a site that evicts nothing with demand and blocks no busy model
    ahead_tools: float = 1.0    # 1 (with background_load and admission): a GPU model whose calls are mostly tools, not
                                # rewards, gets a replica before its actions wait, by load_ahead's rule over the step's
                                # expected rest (its demand is steady), a busy site's blocking counted both ways
    open_share: float = 1.0     # 1: the opening, before anything is learned, is one trajectory per API token as well
                                # as per CPU slot, then, once 4 actions were seen, per unit of what the actions seen
                                # hold of each (static binds a token per trajectory); 0: one per CPU slot. Not where
                                # the per-model gate opens (admission_model, on a cluster that leans to GPUs)
    open_prior: float = 4.0     # (with open_share) once 4 actions were seen, the opening's share per action is read
                                # with its own guess (one unit of each resource per action) counted as this many of
                                # them: 4 actions alone read one API call in four on api-tight at seed 1216, and the
                                # opening went from 12 to 32 trajectories on 12 tokens (0: from the actions alone)
    api_whole: float = 1.0      # 1: the gate's API term past the warm-up reads a trajectory's API work as its tool
                                # calls (from every one issued) x its tool turns (from the hazard of ending) plus its
                                # last call (from those that ended); 0: from the ended trajectories alone
    wide_replicas: float = 0.0  # >0 (opt-in, with residency; beyond WORKLOAD.md, which loads every replica on the
                                # smallest k >= units.min whose share fits a GPU): a load may also make a replica of
                                # units.max GPUs within one group, where that site costs no more than the smallest
    spare_shared: float = 1.0   # 1: an action goes to the ready replica of its model whose GPUs the other models'
                                # replicas need least (their demand per replica); 0: the first ready one
    grow: float = 0.0           # >0 (with residency and background_load): load a larger replica (up to units.max,
                                # within one group) of a model with demand on idle GPUs, replacing smaller ones of
                                # it, when its actions' seconds saved over this x its horizon beat the waiting the
                                # load adds (Erlang C) to every model whose replicas it evicts or blocks
    admit_long: float = 2.0     # >0: a waiting trajectory whose expected length (begin_trajectory's expected_s,
                                # expect_trajectories) is over this x the mean of those given is admitted first,
                                # longest first; the rest in the order they asked. The gate then holds fewer in
                                # flight (the three long_* below replace their admission_* knobs; two of them while
                                # the expectations are trusted, long_trust): a late long trajectory no longer sets
                                # the step. Without expectations it does nothing (0: expectations are ignored)
    long_knee: float = 0.55     # (with admit_long, while the expectations are trusted) admission_knee
    long_gpu_lean: float = 0.4  # (the same) admission_gpu_lean (0.5 before gate_runs)
    long_model: float = 0.4     # (with admit_long, from the first expectation: the warm-up's per-model target acts
                                # before any trajectory ended, so it cannot wait for the trust) admission_model
    long_trust: float = 0.5     # long_knee and long_gpu_lean apply while the expected and measured lengths (logs) of
                                # the ended trajectories (8 at least) correlate at least this much (0: from the first
                                # expectation given); the order does not wait for it

    def __post_init__(self) -> None:
        """Every knob a finite number >= 0, as ``tangram.scheduler.policy-options`` and ``-o`` require: one set in
        code (``TangramSchedulerPlugin(tangram=TangramOptions(admission=-1))``) was taken as given before
        session 34, and a NaN would have turned every comparison it takes part in false."""
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                raise ValueError(f"TangramOptions.{name} = {value!r}: must be a finite number >= 0")


class TangramPolicy(AdmissionGate, Placement, GpuPlacement, Residency, Policy):
    """The tangram policy: the state every phase reads, set up here, and the events that change it.

    The phases are the mixins: :class:`~.admission.AdmissionGate`, :class:`~.placement.Placement`
    (CPU and API), :class:`~.gpus.GpuPlacement` and :class:`~.residency.Residency`; ``_schedule``
    runs them, once per pass.
    """

    name = "tangram"

    def __init__(self, *a, options: TangramOptions | None = None, **kw):
        super().__init__(*a, **kw)
        self.opt = options or TangramOptions()
        # replicas wider than the contract's smallest k (WORKLOAD.md): the simulator checks them unless named here
        self.beyond_contract = tuple(n for n in ("wide_replicas", "grow") if getattr(self.opt, n))
        self.est = Estimator(from_hints=bool(self.opt.hint_spread), hint_bound=self.opt.hint_bound)
        self.pools: dict[str, Pool] = {"cpu": Pool("cpu", "cpu"), "api": Pool("api", "api")}
        self.dirty: dict[str, None] = {}
        self._seq = 0
        self.traj_start: dict[str, float] = {}
        self._t0: float | None = None
        self.reserved: dict[str, Reservation] = {}  # node -> its one reservation
        self.home_wait: dict[str, dict[ActionId, Pending]] = {}  # node -> stateful actions waiting for it
        # CPU actions only a cordoned node can hold (a paused worker's): out of the queue, where as its head one
        # would hold up every action behind it, until a cordon ends or a node changes
        self.cordon_parked: dict[ActionId, Pending] = {}
        self.home_deadlines: list[tuple[float, int, ActionId, str]] = []
        self.freed_nodes: dict[str, None] = {}  # nodes with home waiters where slots were freed
        self.freed_res: dict[str, None] = {}  # reserved nodes where slots were freed
        self.res_deadlines: list[tuple[float, int, str, ActionId]] = []
        self.ests: dict[str, Welford] = {}  # per kind: log of the estimates made at submission
        self.all_ests = Welford()  # the same, every kind together (_elephant, until a kind has 8)
        # trajectory -> when it asked; an OrderedDict: a plain dict's first item costs O(deleted) to reach
        self.admission_queue: OrderedDict[str, float] = OrderedDict()
        self._long: list[tuple[float, int, str]] = []  # admit_long: (-expected_s, seq, trajectory), a heap, lazy
        self._long_seq: dict[str, int] = {}  # admit_long: waiting trajectory -> the seq of its live heap entry
        self._expected = BoundedMean(self.opt.hint_bound)  # admit_long: the expected lengths given (seconds)
        self._hinted: dict[str, float] = {}  # admit_long: trajectory -> its expected length, until it ends
        self._hint_fit = Covariance()  # admit_long: log expected vs log measured length of those that ended
        self._fit_held: list[tuple[float, float]] = []  # (expected, measured) held until expectations are bounded
        self._opt0 = self.opt  # the options given (admit_long's long_model in; its other targets while trusted)
        self.admitted: set[str] = set()  # admitted through the gate and not yet ended
        self.gaps = Welford()       # LLM gap: from a trajectory's admission or last action's end to its next action
        self.turn_units = {"cpu": 0.0, "gpu": 0.0, "api": 0.0}  # unit-seconds submitted, per resource
        self.turn_count_units = {"cpu": 0.0, "gpu": 0.0, "api": 0.0}  # units submitted, per resource
        self.model_work: dict[str, float] = {}  # per model: replica-seconds submitted (at units.min)
        self.cpu_at_max = 0.0  # CPU unit-seconds submitted, each action at units.max (admission_knee)
        self.gpu_calls = 0  # GPU actions submitted by trajectories (admission_gpu_lean)
        self.gpu_tools = 0  # of those, the ones their trajectory issued another action after (tools, not rewards)
        self._gpu_last: dict[str, str] = {}  # trajectories in flight whose last action was a GPU action -> its model
        self.model_calls: dict[str, int] = {}  # per model: its actions submitted by trajectories
        self.model_tools: dict[str, int] = {}  # of those, the ones their trajectory issued another action after
        self._tool_models: set[str] = set()  # models most of whose calls are tools (ahead_tools)
        # per trajectory in flight: [cpu, gpu, api unit-seconds, action seconds, actions, its last action's api
        # unit-seconds, its last action's seconds]; summed when it ends (api_whole reads the last two)
        self.traj_work: dict[str, list[float]] = {}
        # gate_runs: per trajectory in flight, per action of it, (seconds and units it added to traj_work, its
        # ordinal there); when it finishes, its run time takes the estimate's place. A cancelled action's entry
        # stays (it may come back unrun, submit(issued_at=...), and run) until its trajectory ends
        self._issued_work: dict[str, dict[ActionId, tuple[float, int, float, float, float]]] = {}
        z = self.opt.turn_runs  # (_ran: estimate / run within these is never far enough off, whatever the sd)
        self._turn_near = (math.exp(-z), math.exp(z)) if z else None
        self._binds = -1  # the resource that set the learned admission limit: 0 CPU, 1 GPUs, 2 API, -1 none
        self.ended_work = [0.0] * 7  # traj_work's seven figures, summed over the ended trajectories
        self.ended_n = 0
        self.lulls = 0  # times nothing was in flight or waiting once admission_warmup trajectories had ended
        self.turn_time = Welford()  # expected action time at units.max
        self.last_end: dict[str, float] = {}
        self.release_rate = Rate(self.opt.horizon_s)  # CPU slots freed per second
        self.traj_n = 0
        self.traj_sum = 0.0
        self._now = 0.0  # the time of the schedule pass under way (set by _schedule)
        self._claims: dict[tuple[str, int], float] | None = None  # gpu_claim, during one _drain_gpus pass
        self._waited_site: tuple | None = None  # site_wait: the busy GPUs a load waits for (one _load_site call)
        self._limit: tuple[float, float] | None = None  # (admission limit, max wait), while not _limit_dirty
        self._limit_dirty = True
        self._m_t, self._m_occ, self._m_act, self._m_w, self._lim_other = 0.0, 0.0, 0.0, 0.0, math.inf
        self._m_prev: tuple[int, int] | None = None  # admission_measured: the state at the last pass with a queue
        self._idle_at = -math.inf  # when the last trajectory was admitted past the limit (_idle)
        self.fresh: set[str] = set()  # admitted, no action issued yet: their demand is not seen
        self._loader_density = 0.0  # demand per GB of the model a load is being planned for
        self._loader_starved = False  # that model has no replica at all
        self._forecast_load = False  # plan_keep_last: the load asked for is the warm-up plan's alone (_should_load)
        self._deployed = frozenset(r.model for r in self.gpu.replicas.values())  # resident before the step
        self._unpaid: dict[ReplicaId, float] = {}  # replicas this policy loaded -> seconds of work still owed
        self._loading: dict[ReplicaId, str] = {}  # replicas whose loading action has not finished -> model
        # lull_loads: model -> the sites (node, GPUs) of the loads at_once_safe held back in this step, in that order
        self._deferred: dict[str, dict[tuple[str, tuple[int, ...]], None]] = {}
        self._lull_due = False  # a step ended with loads held back: they go in the next pass
        self._shapes: dict[tuple, tuple[list, list, int]] = {}  # _replica_shapes, until the nodes or models change
        self._ahead_spec: dict[str, ActionSpec] = {}  # load_ahead: per model, its last action's spec
        self._site_score: tuple | None = None  # _load_site's score of the site it chose (residency)
        self.loads_ahead = 0  # Load decisions made (background_load)
        self._grow_at: dict[str, float] = {}  # grow: per model, when next to look for a larger replica
        self.grows = 0  # Load decisions made by grow

    def pool(self, spec: ActionSpec) -> Pool:
        name = spec.model if spec.resource == "gpu" else spec.resource
        p = self.pools.get(name)
        if p is None:
            p = self.pools[name] = Pool(name, "gpu", self._demand_tau(name))
        return p

    def _demand_tau(self, model: str) -> float:
        """The time constant of a model's demand and arrival rates: ``horizon_s``, at most ``demand_loads``
        of its ``load_s`` (a model reloaded in 0.1 s follows a shift of the mix over seconds; with 30 s, a
        model called in the first half of a 10 s stream still outranked one called now, and two others
        took turns evicting each other), and at least its ``load_s`` (a replica pays back only after its
        load: a burst shorter than that is not demand for one). Not under ``_MIN_DEMAND_S`` by the load
        rule: a model declared to load in 2e-311 s read a demand horizon of 4e-310 s, and one call as
        infinite demand (hypothesis found it: ``math.ceil`` of it raised in ``_keep``)."""
        load_s = self.models[model].load_s
        h = self.opt.horizon_s
        if self.opt.demand_loads > 0 and load_s > 0:  # a model declared to load in no time keeps horizon_s
            h = min(h, max(self.opt.demand_loads * load_s, _MIN_DEMAND_S))
        return max(h, load_s)

    def set_model(self, model: ModelSpec) -> None:
        super().set_model(model)
        pool = self.pools.get(model.name)
        if pool is not None and pool.resource == "gpu":  # a measured load time moves its horizon
            tau = self._demand_tau(model.name)
            pool.demand.retau(tau)
            pool.arrivals.retau(tau)

    # -- trajectories ---------------------------------------------------------
    def begin_trajectory(self, trajectory: str, now: float, expected_s: float | None = None) -> None:
        if not self.opt.admission:
            return super().begin_trajectory(trajectory, now)
        self.admission_queue[trajectory] = now
        if expected_s is not None and self.opt.admit_long:
            if not self._expected.n:  # the first: the warm-up's per-model target (it acts before any end)
                self.opt = self._opt0 = replace(self._opt0, admission_model=self._opt0.long_model)
                self._limit_dirty = True
                if not self.opt.long_trust:
                    self._trust(True)
            # bounded as hints are: before session 33 one trajectory expected to last 1e9 s set the mean that
            # long-first admission compares with, and the others' step on the tight file was 1.10x
            expected_s = self._expected.add(expected_s if expected_s < SECONDS_LIMIT else SECONDS_LIMIT)
            self._hinted[trajectory] = expected_s
            self._long_seq[trajectory] = self._expected.n
            heapq.heappush(self._long, (-expected_s, self._expected.n, trajectory))
            if len(self._long) > 2 * len(self._long_seq) + 16:
                # stale entries (admitted in arrival order, or ended, before reaching the top) compacted: the live
                # ones in the same order (their keys are unique), so the same trajectory comes first. Before, those
                # below the last live top stayed, and the heap drifted up step after step (145 entries for 16
                # trajectories a step after 200 steps)
                live = self._long_seq
                self._long = [e for e in self._long if live.get(e[2]) == e[1]]
                heapq.heapify(self._long)

    def end_trajectory(self, trajectory: str, now: float) -> None:
        super().end_trajectory(trajectory, now)
        self.admission_queue.pop(trajectory, None)
        if self._long_seq.pop(trajectory, None) is not None and not self._long_seq:
            self._long.clear()  # nobody with an expected length waits: every heap entry is stale
        self.admitted.discard(trajectory)
        self.fresh.discard(trajectory)
        self._gpu_last.pop(trajectory, None)
        self.last_end.pop(trajectory, None)
        if self._issued_work:
            self._issued_work.pop(trajectory, None)
        acc = self.traj_work.pop(trajectory, None)
        if acc is not None:
            self._limit_dirty = True
            self.ended_n += 1
            for i, x in enumerate(acc):
                self.ended_work[i] += x
            if not self.admitted and not self.admission_queue and self.ended_n >= self.opt.admission_warmup:
                self.lulls += 1  # a whole step ended (steps_knee, steps_gpu_lean)
                self._lull_due = bool(self._deferred)
        t0 = self.traj_start.pop(trajectory, None)
        if t0 is not None:
            self.traj_n += 1
            self.traj_sum += now - t0
        expected = self._hinted.pop(trajectory, None) if self._hinted else None
        if expected is not None and t0 is not None and self.opt.long_trust and now > t0 and expected > 0:
            self._fit_held.append((expected, now - t0))
            if self._expected.bounded():  # (one absurd expectation is no measure of the others')
                c = self._hint_fit
                for x, y in self._fit_held:
                    if self._expected.within(x):
                        c.add(math.log(x), math.log(y))
                self._fit_held.clear()
                if c.n >= 8:
                    self._trust(c.corr() >= self.opt.long_trust)

    def _trust(self, on: bool) -> None:
        """``admit_long``: the gate's targets for long-first admission (``long_knee``, ``long_gpu_lean``) while
        the expectations given are trusted, its own otherwise."""
        if on == (self.opt is not self._opt0):
            return
        o = self._opt0
        self.opt = replace(o, admission_knee=o.long_knee, admission_gpu_lean=o.long_gpu_lean) if on else o
        self._limit_dirty = True

    @property
    def active(self) -> int:
        """Trajectories admitted through the gate and not yet ended."""
        return len(self.admitted)

    def _t_ref(self, now: float) -> float:
        """The scale of a trajectory's length: mean of those ended, else the time elapsed."""
        if self.traj_n >= 8:
            t = self.traj_sum / self.traj_n
        else:
            t = now - self._t0
        return 1e-3 if 1e-3 > t else t  # max(t, 1e-3), without the call

    # -- events: order ----------------------------------------------------------
    def _submit(self, aid: ActionId, spec: ActionSpec, now: float, issued_at: float | None = None) -> None:
        if self._t0 is None:
            self._t0 = now
        traj = spec.trajectory
        if traj is not None and traj not in self.traj_start:
            self.traj_start[traj] = now
        if self.trajectory_ttl_s is not None:
            self._touch(traj, now)
        if self.fresh:
            self.fresh.discard(traj)
        if issued_at is not None:  # back unrun: counted when first issued; it keeps its place in the order
            est = self.est.expected(spec)
            self._enqueue(aid, spec, est, self.opt.aging * min(issued_at, now) + est)
            return
        # its hint recorded, then its expected work (tagged, for _rebound, where the gate's figures count it)
        est = self.est.issue(spec, (aid, spec) if traj is not None and self.opt.admission and self.opt.gate_runs
                             else None)
        if self.est.rebounded:
            self._rebound()
        if traj is not None and self.opt.admission:
            self._limit_dirty = True
            if self._gpu_last:
                m = self._gpu_last.pop(traj, None)
                if m is not None:
                    self.gpu_tools += 1  # its last GPU action was not its reward
                    self.model_tools[m] = self.model_tools.get(m, 0) + 1
                    self._classify(m)
            t_end = self.last_end.get(traj)
            if t_end is not None:
                self.gaps.add(now - t_end)
            u = self._units_at_most(spec) if self.opt.admission_at_max else spec.units_min
            t_u = est * spec.scale(u)
            self.turn_time.add(t_u)
            res = spec.resource
            self.turn_units[res] += t_u * u
            self.turn_count_units[res] += u
            if res == "gpu":
                self.model_work[spec.model] = self.model_work.get(spec.model, 0.0) + t_u
                self.gpu_calls += 1
                self._gpu_last[traj] = spec.model
                self.model_calls[spec.model] = self.model_calls.get(spec.model, 0) + 1
                self._classify(spec.model)
            f = 0.0  # (cpu) what cpu_at_max counts per second of work on units.min
            if res == "cpu":
                m = self._units_at_most(spec)
                f = spec.scale(m) * m
                self.cpu_at_max += est * f
            acc = self.traj_work.get(traj)
            if acc is None:
                acc = self.traj_work[traj] = [0.0] * 7
            acc[_RES[res]] += t_u * u
            acc[3] += t_u
            acc[4] += 1
            acc[5] = t_u * u if res == "api" else 0.0  # the last action so far (at the end: the reward)
            acc[6] = t_u
            if self.opt.gate_runs:
                w = self._issued_work.get(traj)
                if w is None:
                    w = self._issued_work[traj] = {}
                w[aid] = (t_u, u, acc[4], est, f)
        if est > 0:
            log_est = math.log(est)
            w = self.ests.get(spec.kind)
            if w is None:
                w = self.ests[spec.kind] = Welford()
            w.add(log_est)
            self.all_ests.add(log_est)
        pool = self.pool(spec)
        if spec.resource == "gpu":  # a pool's demand and arrivals are read by the residency rules only
            pool.demand.add(now, est)
            if self.opt.load_ahead or self.opt.ahead_tools or self.opt.evict_wait:
                pool.arrivals.add(now, 1.0)
                if self.opt.load_ahead or self.opt.ahead_tools or self.opt.grow:
                    self._ahead_spec[spec.model] = spec
        self._enqueue(aid, spec, est, self.opt.aging * now + est, pool)

    def _snapshot_extra(self) -> dict:
        out = super()._snapshot_extra()
        if self.est.bounded:  # kind -> hints counted out of bounds (hint_bound): the user's hints are off
            out["hints_bounded"] = {k: v[0] for k, v in self.est.bounded.items()}
        return out

    def _units_at_most(self, spec: ActionSpec) -> int:
        """The most units the action could use, which the gate's figures read: ``units.max``, at most what the
        largest node of its resource holds, and at most the size where its unit-seconds double over ``units.min``
        (``units.min`` itself with no parallel fraction: it is always sized ``units.min``, ``_units``). Before
        session 33 one action asking 1e6 slots made the tight file's step 5.4x the same run's without it, and
        code runs declared ``units=(1, 32)`` without a speedup 2.4x the step of the same declared ``units=1``."""
        cap, m, p = self._capacity, spec.units_max, spec.parallel_fraction
        if p == 0.0:
            return spec.units_min
        if p < 1.0:  # past the size where its unit-seconds double (Amdahl: k (1 - p) + p = 2 (lo (1 - p) + p)), the
            # sizing rule never goes, whatever the price (a parallel fraction of 0.3 on units (1, 32): 2, not 32)
            k = int(2 * spec.units_min + p / (1.0 - p))
            if k < m:
                m = k
        r = spec.resource
        c = cap.cpu_largest if r == "cpu" else cap.api_tokens if r == "api" else max(
            (s.gpus for s in cap.gpu_shapes), default=0)
        return c if 0 < c < m else m

    def _classify(self, model: str) -> None:
        """``ahead_tools``: whether most of ``model``'s calls are tools (their trajectory issued another action
        after them), read by ``_plan_ahead``."""
        if 2 * self.model_tools.get(model, 0) > self.model_calls.get(model, 0):
            self._tool_models.add(model)
        else:
            self._tool_models.discard(model)

    def _enqueue(self, aid: ActionId, spec: ActionSpec, est: float, key: float, pool: Pool | None = None) -> None:
        """Phase 1, order: into its pool's heap, keyed by aging x issue time + expected work."""
        if pool is None:
            pool = self.pool(spec)
        pool.push(_pending((key, self._seq, aid, spec, est)))
        self._seq += 1
        self.dirty[pool.name] = None

    def _finished(self, aid: ActionId, r: Running, now: float, run_s: float | None) -> None:
        spec = r.spec
        traj = spec.trajectory
        if traj is not None and self.opt.admission and traj in self.traj_start:
            self.last_end[traj] = now
        self._released(r)
        if spec.resource == "cpu":
            self.release_rate.add(now, r.units)
        if self._unpaid and r.replica in self._unpaid and run_s:
            owed = self._unpaid[r.replica] - run_s
            if owed > 0:
                self._unpaid[r.replica] = owed
            else:
                del self._unpaid[r.replica]
        w = self._issued_work.get(traj) if self._issued_work else None
        issued = w.pop(aid, None) if w else None
        if run_s is not None and run_s > 0:
            u, m = r.units, spec.units_max
            work = run_s / spec.scale(u if u < m else m)  # min(u, m)
            if issued is not None:  # (before its own error is learned: with hint_bound=0 it would widen the test)
                self._ran(traj, spec, work, issued)
            self.est.observe(spec, work)

    def _ran(self, traj: str | None, spec: ActionSpec, work: float,
             issued: tuple[float, int, float, float, float]) -> None:
        """``gate_runs``: an action of a trajectory in flight finished; in its trajectory's figures (``traj_work``)
        what it took (``work``, on units.min) replaces what was expected of it at issue. With ``turn_runs``, in
        the figures of every action issued too (``turn_time``, ``turn_units``, ``model_work``, ``cpu_at_max``),
        where the estimate was off by over ``turn_runs`` times the sd of its kind's hint errors (in log; at least 1:
        403x at 6): one absurd hint stayed there for the rest of the run, and one made the tight file's step up to
        1.42x the same run's without it (before session 33). Not every estimate: replacing all of them cost
        ACT/ideal 0.005-0.031 on five of seven families (``reseed.py --k 12``), since the first actions to finish
        are the short ones. At a fixed e^8 a hint 2,000-3,000x its run got through (the step 1.12x); with the
        spread of the hints rather than of their errors, too (hints of 1.4 sd: over 8.5 in log)."""
        t_est = issued[0]
        t_run = work * spec.scale(issued[1])
        turn = False
        if self._turn_near and t_est > 0 and t_run > 0 and not (
                self._turn_near[0] <= t_est / t_run <= self._turn_near[1]):  # within e^z: no log, no sd (the most)
            turn = abs(math.log(t_est) - math.log(t_run)) > self.opt.turn_runs * self.est.error_sd(spec)
        self._reestimated(traj, spec, issued, work, t_run, turn)

    def _reestimated(self, traj: str | None, spec: ActionSpec, issued: tuple[float, int, float, float, float],
                     work: float, t_new: float, turn: bool) -> None:
        """What ``issued`` counted for an action (its seconds ``t_est`` on its ``u`` units, its work ``est`` on
        units.min) is ``t_new`` and ``work`` now: in its trajectory's figures, and (``turn``) in the turn figures."""
        t_est, u, k, est, f = issued
        d = t_new - t_est
        res = spec.resource
        if turn:
            self.turn_time.replace(t_est, t_new)
            self.turn_units[res] += d * u
            if res == "gpu":
                self.model_work[spec.model] = self.model_work.get(spec.model, 0.0) + d
            elif f:
                self.cpu_at_max += (work - est) * f
            self._limit_dirty = True
        acc = self.traj_work.get(traj)
        if acc is None:
            return
        acc[_RES[res]] += d * u
        acc[3] += d
        if acc[4] == k:  # its trajectory's last action so far
            acc[5] = t_new * u if res == "api" else 0.0
            acc[6] = t_new

    def _rebound(self) -> None:
        """``hint_bound``: actions whose hints, among the first of their kind, were found out of bounds when its
        8th came (``Estimator.rebounded``): while they run, their estimate from the bounded hint replaces the old
        one wherever it counted (once they end, ``_ran`` puts their runs there). Without it, an absurd hint among
        the first of its kind counts there for as long as its action runs."""
        items, self.est.rebounded = self.est.rebounded, []
        for (aid, spec), e in items:
            w = self._issued_work.get(spec.trajectory)
            issued = w.get(aid) if w else None
            if issued is None:
                continue
            t_new = e * spec.scale(issued[1])
            self._reestimated(spec.trajectory, spec, issued, e, t_new, True)
            w[aid] = (t_new, issued[1], issued[2], e, issued[4])

    def cancel(self, aid: ActionId, now: float = 0.0) -> bool:
        r = self.running.get(aid)
        done = super().cancel(aid, now)
        if r is not None:
            self._released(r)
        return done

    def forget(self, aid: ActionId, spec: ActionSpec) -> None:
        """A cancelled action is gone for good (``cancel`` keeps its issued figures, since an action released
        from a worker that left comes back): in its trajectory's figures it did no work. Before session 34 they
        counted its expected work until the trajectory ended, feeding the gate (a helper's review)."""
        w = self._issued_work.get(spec.trajectory) if self._issued_work else None
        issued = w.pop(aid, None) if w else None
        if issued is not None and aid not in self.running:
            self._reestimated(spec.trajectory, spec, issued, 0.0, 0.0, False)

    def _lost(self, r: Running) -> None:
        self._released(r)  # (before session 33 its units.min stayed counted as running in its pool, for good)

    def _released(self, r: Running) -> None:
        """An action gave its units back: its pool's counters, and who may use them."""
        if self._loading and r.replica is not None:
            self._loading.pop(r.replica, None)  # its replica's load is over
        spec = r.spec
        if spec.resource == "gpu":
            self.pools[spec.model].rmin -= spec.units_min
            self._gpu_freed()
            return
        self.pools[spec.resource].rmin -= spec.units_min
        if spec.resource == "cpu":
            self._slots_freed(r.node)
        self.dirty[spec.resource] = None

    def _cordoned(self, name: str, now: float) -> None:
        rv = self.reserved.pop(name, None)
        if rv is not None:  # its slots go to the cordon's hold; the action starts elsewhere
            if rv.held:
                self.cpu.give(name, rv.held)
            self.pools["cpu"].rmin -= rv.p.spec.units_min
            self._requeue(rv.aid, rv.p)
            self.dirty["cpu"] = None
        self._home_waiters_back(name)  # nothing frees at a cordoned home: its waiters restore elsewhere now

    def _uncordoned(self, name: str) -> None:
        self._slots_freed(name)

    def _slots_freed(self, node: str) -> None:
        if node in self.home_wait:
            self.freed_nodes[node] = None
        if node in self.reserved:
            self.freed_res[node] = None

    def _drop_pending(self, aid: ActionId) -> bool:
        if self.cordon_parked and self.cordon_parked.pop(aid, None) is not None:
            return True
        cpu = self.pools["cpu"]
        for node, waiting in self.home_wait.items():
            p = waiting.pop(aid, None)
            if p is not None:
                cpu.unqueued(p)
                return True
        for node, rv in self.reserved.items():
            if rv.aid == aid:
                del self.reserved[node]
                if rv.held:
                    self.cpu.give(node, rv.held)
                    self._slots_freed(node)
                cpu.rmin -= rv.p.spec.units_min
                self.dirty["cpu"] = None
                return True
        for pool in self.pools.values():
            if pool.drop(aid) is not None:
                return True
        return False

    def _queued_specs(self) -> list[tuple[ActionId, ActionSpec]]:
        out = [(aid, p.spec) for pool in self.pools.values() for aid, p in pool.waiting.items()]
        out += [(aid, p.spec) for aid, p in self.cordon_parked.items()]
        out += [(aid, p.spec) for waiting in self.home_wait.values() for aid, p in waiting.items()]
        out += [(rv.aid, rv.p.spec) for rv in self.reserved.values()]
        return out

    def _capacity_changed(self) -> None:
        if self.cordon_parked:  # a cordon ended or a node came or went: they may fit again
            parked, self.cordon_parked = self.cordon_parked, {}
            for aid, p in parked.items():
                self._requeue(aid, p)
        self._shapes = {}  # (model, units.min, units.max) -> replica shapes per node: the nodes changed
        if self._loading:  # a node left with replicas loading there: they are gone
            for rid in [r for r in self._loading if r not in self.gpu.replicas]:
                del self._loading[rid]
        self._limit_dirty = True
        for name in self.pools:
            self.dirty[name] = None
        self.freed_res.update(dict.fromkeys(self.reserved))  # a node may have left: look at each
        if self.home_wait:  # actions waiting at a home that left go back to the queue, to start elsewhere now
            for node in [node for node in self.home_wait if node not in self.cpu.free]:
                self._home_waiters_back(node)

    def _home_waiters_back(self, node: str) -> None:
        """The actions waiting at their home ``node`` go back to the queue, to start elsewhere."""
        waiting = self.home_wait.pop(node, None)
        if waiting:
            pool = self.pools["cpu"]
            for aid, p in waiting.items():
                pool.unqueued(p)
                self._requeue(aid, p)

    # -- decisions --------------------------------------------------------------
    def _schedule(self, now: float, out: list[Decision]) -> None:
        self._now = now  # the pass's time, for the residency rules (they take no ``now`` of their own)
        if self.admission_queue:
            self._admit(now, out)
        hd, rd = self.home_deadlines, self.res_deadlines
        while hd and hd[0][2] not in self.home_wait.get(hd[0][3], ()):
            heapq.heappop(hd)  # its waiter started, left, or was requeued: not a deadline any more
        while rd and (rd[0][2] not in self.reserved or self.reserved[rd[0][2]].aid != rd[0][3]):
            heapq.heappop(rd)  # its reservation started or went
        if (hd and hd[0][0] <= now) or (rd and rd[0][0] <= now):
            # a deadline passed (a wait at home, a reservation's): served now, not at the next CPU event, which
            # on a quiet cluster (a step's last trajectory) may never come
            self.dirty["cpu"] = None
        dirty, self.dirty = self.dirty, {}
        gpu = []
        for name in dirty:
            pool = self.pools[name]
            if name == "cpu":
                self._drain_cpu(pool, now, out)
            elif name == "api":
                self._drain_api(pool, now, out)
            elif self.opt.gpu_merge:
                gpu.append(pool)
            else:
                self._drain_gpu(pool, now, out)
        if gpu:
            self._drain_gpus(gpu, now, out)
        if self._lull_due:
            self._lull_due = False
            if self.opt.lull_loads and self.opt.background_load:
                self._deferred_loads(now, out)
        if (self.opt.load_ahead or (self.opt.ahead_tools and self._tool_models)) and self.opt.background_load \
                and self.gpu.idle:
            self._plan_ahead(now, out)
        if self.opt.grow and self.opt.background_load and self.opt.residency and self.gpu.idle:
            self._plan_grow(now, out)

    def _guarded(self, aid: ActionId, p: Pending, decide, *args) -> None:
        """Run one decision for ``aid`` (already out of its queue): all or nothing.

        Each decision computes first and commits last (the ledger checks a take
        before it changes anything), so an exception leaves every counter as
        it was; the action is rejected with the error, and nothing else is.
        """
        try:
            decide(aid, p, *args)
        except Exception as e:  # a policy bug must cost one action, never the pool
            self._failed(aid, p, e)

    def _failed(self, aid: ActionId, p: Pending, e: Exception) -> None:
        """One decision raised (``_guarded``, or its inlined form on the hot CPU and API paths)."""
        self._reject(aid, f"the tangram policy could not place action {aid!r} ({p.spec.kind}): "
                          f"{type(e).__name__}: {e}")

    # -- snapshot ---------------------------------------------------------------------
    def _shortfall(self, pool: Pool) -> Shortfall | None:
        """Why the head of ``pool`` waits, as a Shortfall (from what the last drain pass noted)."""
        if pool.blocked is None or pool.head() is None:
            return None
        why, spec, free = pool.blocked
        largest = self._capacity.cpu_largest if pool.resource == "cpu" else (
            self.api.total if pool.resource == "api" else self._largest_gpus())
        return Shortfall(pool.resource, spec.units_min, free, why.format(need=spec.units_min, model=pool.name),
                         pool.name, largest, False, spec.kind)

    def gpu_waiting(self) -> tuple[tuple[str, str, int], ...]:
        """``(model, reason, actions)`` for each model whose GPU actions wait: the first reason of
        ``GPU_WAIT_REASONS`` that one of its replicas gives (an idle replica held back, an idle one whose GPUs
        serve another model or hold a load, one loading, all busy with its own actions, idle ones on paused
        workers only, none at all).
        benchmarks/gpu_waits.py sums it over a run; the scheduler exports it (``dask_tangram_gpu_waiting_actions``)."""
        gp = self.gpu
        out = []
        for model, pool in self.pools.items():
            if pool.resource != "gpu" or not pool.waiting:
                continue
            found = set()
            for rid in gp.by_model.get(model, ()):
                r = gp.replicas[rid]
                if gp.nodes[r.node].cordon is not None and not r.busy:
                    found.add("paused")  # (its GPUs read busy: held by the cordon)
                elif r.loading:
                    found.add("loading")
                elif r.busy:
                    found.add("busy")
                elif self._held_by_load(rid):  # a GPU of it holds another replica's load
                    found.add("gpu_loading")
                elif any(gp.nodes[r.node].gpus[i].busy for i in r.gpus):
                    found.add("gpu_shared")
                else:
                    found.add("idle")
            reason = next((c for c in GPU_WAIT_REASONS if c in found), "no_replica")
            out.append((model, reason, len(pool.waiting)))
        return tuple(out)

    def _largest_gpus(self) -> int:
        return max((s.gpus for s in self._capacity.gpu_shapes), default=0)

    def _queued(self) -> dict[str, int]:
        out = {"cpu": 0, "api": 0, "gpu": 0}
        for pool in self.pools.values():
            out[pool.resource] += len(pool.waiting)
        out["cpu"] += sum(len(w) for w in self.home_wait.values()) + len(self.reserved) + len(self.cordon_parked)
        return out

    def _admission_waiting(self) -> int:
        return len(self.admission_queue)

    def _pool_stats(self) -> list[PoolStats]:
        base = super()._pool_stats()
        out = []
        for ps in base:
            if ps.resource in ("cpu", "api"):
                pool = self.pools[ps.resource]
                out.append(replace(ps, head=self._shortfall(pool),
                                   queued_units=pool.qmin, queued_work_s=round(pool.qwork, 6)))
            else:
                gpu_pools = [p for p in self.pools.values() if p.resource == "gpu"]
                out.append(replace(ps, queued_units=sum(p.qmin for p in gpu_pools),
                                   queued_work_s=round(sum(p.qwork for p in gpu_pools), 6)))
        running: dict[str, int] = {}
        for r in self.running.values():
            if r.spec.resource == "gpu":
                running[r.spec.model] = running.get(r.spec.model, 0) + 1
        gp = self.gpu
        for name, pool in self.pools.items():
            if pool.resource != "gpu" or not (pool.waiting or running.get(name)):
                continue
            reps = gp.by_model.get(name, {})
            out.append(PoolStats("gpu", sum(len(gp.replicas[r].gpus) for r in reps), len(gp.ready.get(name, ())),
                                 len(pool.waiting), running.get(name, 0),
                                 self._shortfall(pool), name, pool.qmin,
                                 round(pool.qwork, 6)))
        return out


_RES = {"cpu": 0, "gpu": 1, "api": 2}  # traj_work's figure of each resource
