"""Residency: GPU replicas follow each model's demand (docs/scheduling.md, "3b. Residency").

A new replica is loaded when the work an action would find on arrival
(queued plus the model's recent demand during the load) outlasts what the
replicas can do meanwhile (``_should_load``). A model keeps the replicas its
demand needs, as many as keep its queueing short (``_keep``, Erlang C;
``_evictable``), and a replica tangram loaded stays until it has served as
much work as its load took. A new replica never leaves another model with
demand without a replica free of loads (``_stalls``), goes where the fewest
evictions and the least busy neighbours are (``_contention``), waits for
busy GPUs that take it evicting nothing rather than evict a replica with
demand (``site_wait``), and takes ``units.max`` GPUs of the group where that
costs nothing more (``_replica_shapes``). Opt-in: ``load_ahead``
(``_plan_ahead``) and ``grow`` (``_plan_grow``).

A mixin of :class:`~.tangram.TangramPolicy`, which sets up the state it
reads (pools and their demand, the GPU ledger, replicas it loaded) in
``__init__``.
"""

from __future__ import annotations

import math

from ..spec import ActionSpec
from .queues import Pool
from .types import Decision, ReplicaId

#: The shortest demand horizon the load rule gives (``_demand_tau``): over less, one call is a burst.
_MIN_DEMAND_S = 1.0


class Residency:
    """Where and when replicas load, and which ones may go.

    Reads each GPU pool's demand and arrival rates, the GPU ledger, the replicas deployed before the step
    (``_deployed``) and loaded and not yet paid back (``_unpaid``). The loads it decides on are begun by
    :meth:`~.gpus.GpuPlacement._begin_load`; its own state is its notes of one decision (``_loader_density``,
    ``_loader_starved``, ``_site_score``, ``_waited_site``), the replica shapes per model (``_shapes``) and
    what ``load_ahead`` and ``grow`` keep (``_ahead_spec``, ``_grow_at``, ``grows``).
    """

    def _plan_ahead(self, now: float, out: list[Decision]) -> None:
        """A replica for the demand to come, loaded before any action waits for it: ``ahead_tools`` (the
        default) for a model most of whose calls are tools, ``load_ahead`` (opt-in) for any model.

        A model with arrival rate ``lam`` and mean work ``s`` per action offers ``a = lam s``
        busy replicas; on ``c`` replicas (loading ones counted) its actions wait ``Wq(c)`` on
        average (Erlang C). One more replica saves ``lam (Wq(c) - Wq(c+1))`` seconds of waiting
        per second. Over a horizon that must beat the GPU-seconds the load holds (``load_s`` x GPUs,
        plus the busy replicas beside it, ``_contention``). Only on a site that evicts no replica whose
        model has demand and blocks no model with demand (``_stalls``).

        - ``load_ahead``: the horizon is ``load_ahead`` x the model's demand horizon (30 s at most).
        - ``ahead_tools``, for a model whose calls are mostly tools (a process reward model scored on
          most turns; ``model_tools``): its demand is steady, so it is there for the step's expected
          rest (``_rest_s``), not only the next 30 s. On the GPU-bound file the process reward model
          kept 3 replicas about 60% busy past the warm-up (its calls waited 0.32 s on a 0.92 s floor):
          at 30 s a fourth one never paid for its 30 s load, over the step's rest it does. Over that
          horizon a site beside another model's busy replicas costs more than its load: each second
          the new replica serves, they wait, and each second they serve, it does; the cost counts
          ``2 x`` its expected busy share (``a / (c + 1)``) x their busy share x the horizon. Reward
          models are left out: their calls come in bursts at trajectories' ends, and a rate read
          over 30 s, held for the rest of the step, loaded the vision judge twice at 64 s on
          ``small-gpu53`` (seed 1087), which then lost its step (0.946 -> 1.019x static's).
        """
        self._forecast_load = False  # (plan_keep_last reads _should_load's verdict only)
        gp = self.gpu
        opt = self.opt
        rest = -1.0
        for model, pool in self.pools.items():
            if pool.resource != "gpu" or not gp.idle:
                continue
            spec = self._ahead_spec.get(model)
            if spec is None:
                continue
            tools = opt.ahead_tools and model in self._tool_models
            if not (tools or opt.load_ahead):
                continue
            a = pool.demand.rate(now)
            n = pool.arrivals.rate(now)
            if a <= 0 or n <= 0:
                continue
            horizon = opt.load_ahead * pool.demand.tau
            if tools:
                if rest < 0:
                    rest = self._rest_s()
                horizon = max(horizon, rest)
            c = len(gp.by_model.get(model, ()))
            s = a / n
            ms = self.models[model]
            k = ms.replica_gpus(spec.units_min, max(sh.gpu_memory_gb for sh in self._capacity.gpu_shapes))
            if n * _erlang_wq_bound(c, a, s) * horizon <= ms.load_s * k:
                continue  # the wait on c replicas is too short for a load to pay, whatever one more saves
            w0, w1 = _erlang_wq_pair(c, a, s)
            saved = math.inf if w0 == math.inf else n * (w0 - w1)
            if saved * horizon <= ms.load_s * k:
                continue
            site = self._load_site(model, spec)
            if site is None or self._site_score is None:
                continue
            stalls, n_evict, contention, _ = self._site_score
            cost = ms.load_s * (len(site[1]) + contention)
            if tools:
                cost += 2.0 * horizon * min(1.0, a / (c + 1)) * contention
            if stalls or saved * horizon <= cost:
                continue  # the load would block a model's only replica, or the busy ones beside it cost more
            if any(self._needed(gp.replicas[rid].model, now) > 0 or self._unseen_deployed(gp.replicas[rid].model)
                   for rid in site[2]):
                continue
            self._begin_load(model, site, now, out)

    def _rest_s(self) -> float:
        """The step's expected rest: one mean trajectory, after the time the trajectories waiting for admission
        take to get in at the current rate (those in flight per mean length). 0 until 8 trajectories ended."""
        if self.traj_n < 8:
            return 0.0
        t = self.traj_sum / self.traj_n
        return t * (1.0 + len(self.admission_queue) / max(len(self.admitted), 1))

    def _plan_grow(self, now: float, out: list[Decision]) -> None:
        """``grow``: a larger replica of a model with demand, loaded in the background on idle GPUs.

        Replicas are loaded at ``units.min``'s size where memory is short, and ``_load_site`` grows a
        new one only onto GPUs that cost nothing more. Where GPUs then sit idle, a model's actions run
        on fewer units than they could: a replica of ``k`` GPUs (the largest within ``units.max`` and
        one topology group) runs each of them ``s(k0) - s(k)`` seconds faster, less the price of the
        extra GPU-seconds at the cluster's GPU occupancy (``_units``' rule). Over ``grow`` x the
        model's horizon, at its arrival rate, that must beat what the load costs in waiting: for each
        model whose replicas the load evicts (idle ones of the same model, or of a model with no
        demand) or holds for ``load_s`` (those that stay on its GPUs), its arrival rate x ``load_s``
        x the rise of its Erlang C wait on the replicas left. A model left with fewer replicas than
        ``_keep`` (its last one, say) is never touched, nor one deployed and not seen yet. Large
        replicas are added while fewer than keep the model's wait at the large size under
        ``evict_wait`` of its work (Erlang C), one load of the model at a time; each model is looked
        at once a second at most.
        """
        self._forecast_load = False
        gp = self.gpu
        rho = (gp.total - gp.idle) / max(gp.total, 1)
        price = self.opt.price * rho / (1.0 - rho) if rho < 1.0 else math.inf
        for model, pool in self.pools.items():
            if pool.resource != "gpu" or not gp.idle or self._grow_at.get(model, -math.inf) > now:
                continue
            self._grow_at[model] = now + 1.0
            spec = self._ahead_spec.get(model)
            if spec is None or spec.parallel_fraction == 0.0 or spec.units_max <= spec.units_min:
                continue
            a = pool.demand.rate(now)
            n = pool.arrivals.rate(now)
            if a <= 0 or n <= 0 or now - pool.arrivals.t0 < pool.demand.tau or gp.loading_of(model):
                continue  # no demand, or not measured over a horizon yet, or a load of it under way
            ms = self.models[model]
            s0 = a / n  # mean work per action on units.min
            best = None
            for name, st in gp.nodes.items():
                k0 = ms.replica_gpus(spec.units_min, st.spec.gpu_memory_gb)
                k = min(spec.units_max, max(st.spec.groups))
                if k <= k0:
                    continue
                s_k = s0 * spec.scale(k)
                s_k0 = s0 * spec.scale(k0)
                net = (s_k0 - s_k) - price * (k * s_k - k0 * s_k0)
                if net <= 0:
                    continue
                big = sum(1 for rid in gp.by_model[model] if len(gp.replicas[rid].gpus) >= k)
                want = _servers(n * s_k, 1, max(1, gp.total), self.opt.evict_wait)
                if big >= want:
                    continue
                saved = n * net * self.opt.grow * pool.demand.tau
                site = self._grow_site(model, name, st, k, saved)
                if site is not None and (best is None or site[0] < best[0]):
                    best = site
            if best is not None:
                self._begin_load(model, best[1:], now, out)
                self.grows += 1

    def _grow_site(self, model: str, name: str, st, k: int, saved: float) -> tuple | None:
        """``grow``'s site for a ``k``-GPU replica of ``model`` on node ``name``: ``(cost, node, GPUs,
        evicted)``, the one whose load costs the least waiting, if under ``saved``; else None.

        Only GPUs of one group, idle and unclaimed, beside no load, no replica of the model as large
        (two replicas on the same GPUs serve one at a time: it would add nothing) and no replica of
        another model with demand or deployed and not seen yet (each large action would block it).
        It may evict the model's smaller replicas (not one loaded and not paid back yet) and replicas
        of models with no demand. The cost: the model's replicas there (evicted, or held by the load)
        are gone for ``load_s``; its arrival rate x ``load_s`` x the rise of its Erlang C wait on the
        replicas left, and none of them may go where that leaves fewer than ``_keep``.
        """
        gp = self.gpu
        ms = self.models[model]
        now = self._now
        share = ms.gpu_memory_gb / k
        pool = self.pools[model]
        a, n = pool.demand.rate(now), pool.arrivals.rate(now)
        c = len(gp.by_model[model])
        keep = self._keep(model)
        best = None
        for gpus, cands in self._idle_sites(name, st, k):
            order, lost, fits = [], 0, True
            for rid in sorted(cands):
                r = gp.replicas[rid]
                if r.loading:
                    fits = False
                elif r.model == model:
                    lost += 1
                    fits = len(r.gpus) < k
                    if rid not in self._unpaid:
                        order.append(rid)
                elif self._needed(r.model, now) > 0 or self._unseen_deployed(r.model):
                    fits = False
                else:
                    order.append(rid)
                if not fits:
                    break
            if not fits or (lost and c - lost < keep):
                continue
            order.sort(key=lambda rid: (gp.replicas[rid].model == model, len(gp.replicas[rid].gpus), rid))
            plan = gp.eviction_plan(name, gpus, share, order)
            if plan is None:
                continue
            cost = n * ms.load_s * (_erlang_wq(c - lost, a, a / n) - _erlang_wq(c, a, a / n)) if lost else 0.0
            if cost < saved and (best is None or (cost, len(plan)) < (best[0], len(best[3]))):
                best = (cost, name, gpus, plan)
        return best

    def _should_load(self, pool: Pool, now: float) -> bool:
        """Load one more replica when the work it would find on arrival pays for its load.

        The replicas the model has can do ``reps x load_s`` seconds of work while
        a new one loads. The work there is for them meanwhile is what waits now
        plus what the model's recent demand (expected work submitted per second)
        brings in ``load_s``. When that exceeds ``load_patience`` times what the
        replicas can do, the new replica has work the moment it is ready: the
        load saves waiting rather than holding GPUs idle. A model whose arrival
        rate alone keeps its replicas busy (utilisation >= 1) gets a replica as
        soon as one of its actions cannot start; a burst gets one when its queue
        outlasts a load (the earlier rule, which ignored arrivals). In the warm-up
        on a cluster that leans to GPUs (``plan_loads``), a model whose replicas
        those in flight would keep over ``plan_busy`` busy gets one as soon as
        one of its actions cannot start.
        """
        model = pool.name
        self._forecast_load = False
        reps = self.gpu.open_replicas(model)  # those on a cordoned node (a paused worker's) serve nothing now
        if reps == 0:
            return True
        if self._planned(model):
            # those in flight keep this model's replicas over plan_busy busy: a replica more shortens its
            # queues before they grow (and, past admission_model busy, admits more trajectories)
            if self.opt.plan_keep_last:
                self._forecast_load = not self._load_pays(pool, reps, now)
            return True
        return self._load_pays(pool, reps, now)

    def _load_pays(self, pool: Pool, reps: int, now: float) -> bool:
        """``_should_load``'s test on the model's demand (its queue and recent arrivals), not the warm-up plan."""
        load_s = self.models[pool.name].load_s
        bar = self.opt.load_patience * reps * load_s
        coming = pool.demand.rate(now) * load_s if self.opt.residency else 0.0
        if coming > bar:
            return True  # (the queued work, never negative, is not read: it could only add)
        return pool.qmin * self._mean_est(pool) + coming > bar

    def _planned(self, model: str) -> bool:
        """``plan_loads``: in the warm-up on a cluster that leans to GPUs, with trajectories waiting for
        admission, those in flight would keep the model's replicas (loading ones counted) over ``plan_busy``
        busy (``_model_limit``, from the actions seen so far)."""
        return bool(self.opt.plan_loads and self.opt.admission_model and self.ended_n < self.opt.admission_warmup
                    and self.admission_queue and self.turn_time.n >= 4 and self._gpu_lean()
                    and self._model_limit(model, loading=True, busy=self.opt.plan_busy)
                    < min(self.cpu.slots, self._lim_other, self.opt.plan_loads * max(self.active, 1)))

    def _needed(self, model: str, now: float) -> float:
        """Replicas the model's recent demand keeps busy (expected work per second; waiters count)."""
        pool = self.pools.get(model)
        if pool is None:
            return 0.0
        return pool.demand.rate(now) + (1.0 if pool.waiting else 0.0)

    def _mean_est(self, pool: Pool) -> float:
        q = pool.heap
        if not q:
            return 0.0
        n = min(len(q), 16)
        tot = 0.0
        for e in q[:n]:
            p = pool.waiting.get(e[2])
            if p is not None:
                tot += p.est / p.spec.units_min
        return tot / n

    def _models_waiting(self) -> set[str]:
        return {name for name, pool in self.pools.items() if pool.resource == "gpu" and pool.head() is not None}

    def _load_site(self, model: str, spec: ActionSpec) -> tuple[str, tuple[int, ...], list[ReplicaId]] | None:
        gp = self.gpu
        ms = self.models[model]
        waiting = self._models_waiting()
        self._loader_density = self._density(model)
        self._loader_starved = not gp.by_model.get(model)
        self._site_score = None
        best = None
        within, _, kmax, at = self._replica_shapes(ms, spec)
        idle = gp.idle_nodes
        if len(idle) * 8 < len(gp.nodes):  # a busy cluster of many nodes: those with an idle GPU, in node order
            within = [e for node in sorted(idle, key=gp.order.__getitem__) for e in at[node]]
        # no site scores below (no stall, no eviction, no contention, the largest size): the first found ends
        # the search (a later one could only tie, and ties keep the first)
        floor = (0, 0, 0.0, -kmax)
        scored, most = 0, self.opt.site_scan or math.inf
        for name, st, k in within:
            if st.most_idle < k:
                continue  # no group with k idle GPUs (_idle_sites would yield nothing): most nodes, when busy
            if scored >= most:
                break  # site_scan sites ranked: the best of them
            share = ms.gpu_memory_gb / k
            for gpus, cands in self._idle_sites(name, st, k, waiting):
                order = self._evict_order(cands, waiting)
                plan = gp.eviction_plan(name, gpus, share, order)
                if plan is not None and self.opt.residency:
                    stalls = self._stalls(cands, plan)
                    if stalls and not self._loader_starved:
                        plan = None  # it would block another model's only replica for the whole load
                scored += plan is not None
                if plan is not None:
                    if self.opt.residency:
                        score = (stalls, len(plan), self._contention(cands, plan), -k)
                        if best is None or score < best[0]:
                            best = (score, name, gpus, plan)
                            if score <= floor:
                                break
                    else:
                        score = len(plan)
                        if best is None or score < best[0]:
                            best = (score, name, gpus, plan)
                            if score == 0:
                                return name, gpus, plan
            if best is not None and self.opt.residency and best[0] <= floor:
                break
        if best is None:
            best = self._spanning_site(model, spec, waiting)
        elif self.opt.residency:
            self._site_score = best[0]
            if self.opt.site_wait and best[3] and any(self._needed(gp.replicas[rid].model, self._now) > 0
                                                      for rid in best[3]):
                free = self._free_site(ms, spec)
                if free is not None:
                    self._waited_site = free
                    return None
        return None if best is None else best[1:]

    def _idle_sites(self, name: str, st, k: int, waiting: set[str] | None = None):
        """Per topology group of node ``name`` with ``k`` idle GPUs that no head claims (a load holds its
        GPUs long: never on a claimed one): ``(GPUs, replicas on them)``, the ``k`` with the most free memory.

        With ``waiting`` (and ``site_rank``), among GPUs equally free those whose replicas are the cheaper to
        lose (``_evict_rank`` of the dearest on each) come first: on benchmarks/residency.py's two GPUs of one
        replica each, the first by index went, evicting the model called every 0.15 s rather than one idle for
        seconds, and it was loaded back at once (seeds 0-19: 203 loads against 173, fifo 262)."""
        claims = self._claims
        start = 0
        for g, size in enumerate(st.spec.groups):
            lo, start = start, start + size
            if st.idle_in_group[g] < k:
                continue
            idle = [i for i in range(lo, start) if not st.gpus[i].busy and not (claims and (name, i) in claims)]
            if len(idle) < k:
                continue
            if waiting is not None and self.opt.site_rank:
                rank = self._evict_rank
                idle.sort(key=lambda i: (-st.gpus[i].mem_free,
                                         max((rank(r, waiting) for r in st.gpus[i].replicas), default=())))
            else:
                idle.sort(key=lambda i: -st.gpus[i].mem_free)
            gpus = tuple(sorted(idle[:k]))
            yield gpus, {rid for i in gpus for rid in st.gpus[i].replicas}

    def _free_site(self, ms, spec: ActionSpec) -> tuple[str, tuple[int, ...], float] | None:
        """``site_wait``: the GPUs of one topology group with memory for the smallest replica of ``ms``
        beside what they hold (no eviction), none of them loading, busy now but expected to free
        within ``ms.load_s``: ``(node, GPUs, when they free)``, the first to free; None if none.

        ``_load_site`` ranks sites by stalls, then evictions, then contention, over idle GPUs only:
        a site that evicts nothing but serves a 0.8 s call now lost to one that evicts a model's
        replica. On gpux-111 (gpu-small) the vision judge's second replica evicted one of the 140 GB
        judge's two replicas at t = 53 s, while a group of 141 GB GPUs that held it beside the others
        was busy with process-reward calls: the 140 GB judge's rewards then queued on its last
        replica (6.2 s each on average, static's 0.4) until it was loaded back at t = 281 s.
        Waiting for the busy group a second: ACT/ideal 1.72 -> 1.56, step 495 -> 469 s.
        """
        now = self._now
        limit = now + ms.load_s  # waiting longer than the load itself takes is never cheaper
        best = None
        reps = self.gpu.replicas
        for name, st, k in self._replica_shapes(ms, spec)[0]:
            if k != ms.replica_gpus(spec.units_min, st.spec.gpu_memory_gb):
                continue  # the smallest replica only: a larger one is worth no wait
            share = ms.gpu_memory_gb / k
            start = 0
            for size in st.spec.groups:
                cand = []
                for i in range(start, start + size):
                    if st.gpus[i].mem_free + 1e-9 < share:
                        continue
                    if any(reps[rid].model == ms.name for rid in st.gpus[i].replicas):
                        continue  # it serves this model already: a second replica there adds no capacity
                    t = self._frees_at(st, i, now)
                    if t <= limit:
                        cand.append((t, i))
                start += size
                if len(cand) < k:
                    continue
                cand.sort()
                t = cand[k - 1][0]
                if best is not None and t >= best[2]:
                    continue
                gpus = tuple(sorted(i for _, i in cand[:k]))
                claims = self._claims
                if t <= now and not (claims and any((name, i) in claims for i in gpus)):
                    continue  # idle and free to take: _load_site passed it over for a reason of its own
                if self._stalls({rid for i in gpus for rid in st.gpus[i].replicas}, []):
                    continue  # it would block another model's only replica for the whole load
                best = (name, gpus, t)
        return best

    def _replica_shapes(self, ms, spec: ActionSpec) -> tuple[list, list, int, dict]:
        """``(within, spanning, kmax, at)``: ``within`` the (node, state, GPUs per replica) to try within a topology
        group (``spanning``: the nodes where the smallest replica spans groups, ``_spanning_site``; ``kmax``:
        the most GPUs of a replica in ``within``; ``at``: node -> its entries of ``within``);
        the smallest replica that fits the node's GPUs (WORKLOAD.md's size) and, with ``residency`` and
        ``wide_replicas`` (opt-in, beyond the contract), also one of ``units.max`` GPUs within one group.

        ``_load_site`` ranks the sites of both sizes alike: no stalled model, fewest evictions, least
        contention, then the larger replica. So a wide replica goes only onto GPUs that cost nothing
        more than the smallest site would (memory free without evicting more, beside replicas no
        busier): its actions then run on more units (ideal ACT is measured at ``units.max``).
        """
        key = (ms.name, spec.units_min, spec.units_max)
        shapes = self._shapes.get(key)
        if shapes is None:  # a function of the nodes and the model only: kept until they change
            shapes = self._shapes[key] = self._shapes_of(ms, spec)
        return shapes

    def _shapes_of(self, ms, spec: ActionSpec) -> tuple[list, list, int, dict]:
        """``_replica_shapes``: ``(within, spanning, kmax, at)``, the sites to try within a topology group, the
        nodes where the smallest replica spans groups (``_spanning_site``), with its GPUs, the most
        GPUs of a replica within a group, and each node's entries of the first."""
        within, spanning = [], []
        at: dict[str, list] = {}
        for name, st in self.gpu.nodes.items():
            k = ms.replica_gpus(spec.units_min, st.spec.gpu_memory_gb)
            within.append((name, st, k))
            at[name] = [within[-1]]
            if self.opt.residency and self.opt.wide_replicas and spec.units_max > k and spec.parallel_fraction > 0.0:
                within.append((name, st, spec.units_max))
                at[name].append(within[-1])
            if max(st.spec.groups) < k <= st.spec.gpus:
                spanning.append((name, st, k))
        return within, spanning, max((k for _, _, k in within), default=0), at

    def _unseen_deployed(self, model: str) -> bool:
        """Resident before the step, and fewer than 8 trajectories ended: its demand (rewards come
        last) cannot be measured yet (``keep_deployed``)."""
        return bool(self.opt.keep_deployed) and self.traj_n < 8 and model in self._deployed

    def _contention(self, cands: set[ReplicaId], plan: list[ReplicaId]) -> float:
        """How busy the replicas that stay on the chosen GPUs are expected to be.

        A GPU runs one action at a time: a replica placed beside another model's
        busy replica waits whenever that one serves (and blocks it in turn).
        Each staying replica counts its model's demand per replica (capped at 1). A replica
        deployed before the step whose model was never called (``unseen_busy``) counts as busy: its
        demand is not measured yet, and for a reward model it comes in bursts, later. On ``gpu-seed39``
        drawn on seed 1039 the process reward model's first load (t = 6.2 s) went beside the vision
        judge's deployed replica, not called yet: its rewards then waited 81 s in all behind the tool
        calls on the same GPUs; placed beside a judge already seen, 20 s (ACT/ideal 1.75 -> 1.50).
        """
        gp = self.gpu
        out = 0.0
        unseen = self.opt.unseen_busy
        for rid in cands:
            if rid in plan:
                continue
            m = gp.replicas[rid].model
            if unseen and m not in self.pools and self._unseen_deployed(m):
                out += unseen
                continue
            out += min(1.0, self._needed(m, self._now) / max(len(gp.by_model[m]), 1))
        return round(out, 6)

    def _stalls(self, cands: set[ReplicaId], plan: list[ReplicaId]) -> int:
        """Models with demand that the load leaves with no replica free to serve.

        A load holds its GPUs for ``load_s``, and a GPU runs one thing at a time: every replica
        that stays there is blocked meanwhile. For a model with other replicas that is contention;
        for a model whose only replica it is, none of its actions can run for the whole load (on
        an 8-GPU cluster the 8B judge's one replica sat beside a 140 GB judge's 100 s load, and its
        actions waited up to 103 s). Such a site is used only by a model with no replica at all.

        With ``stall_free`` "only replica" is read as "no replica left free": every replica of the
        model is on the chosen GPUs (beside the load, or evicted by it) or already held by another
        load under way (``_held_by_load``), and at least one of them waits for a load. On
        ``gpux-111`` a vision-judge load beside one of the 140 GB judge's two replicas was followed
        2.5 s later by an 8B-judge load beside the other, and the 140 GB judge served nothing for
        25 s. Evicting a model's last replica, with none of it blocked, is ``_evictable``'s business.
        """
        gp = self.gpu
        out = 0
        if not self.opt.stall_free:
            for rid in cands:
                if rid in plan:
                    continue
                m = gp.replicas[rid].model
                if len(gp.by_model[m]) == 1 and self._needed(m, self._now) > 0:
                    out += 1
            return out
        seen: set[str] = set()
        for rid in cands:
            m = gp.replicas[rid].model
            if m in seen:
                continue
            seen.add(m)
            if self._needed(m, self._now) <= 0:
                continue
            blocked = False  # some replica of it waits for a load: beside this one, or beside another
            for o in gp.by_model[m]:
                if o in cands:
                    blocked = blocked or o not in plan
                elif self._held_by_load(o):
                    blocked = True
                else:
                    break  # a replica free of loads: it still serves
            else:
                out += blocked
        return out

    def _stalls_deployed(self, model: str, site: tuple) -> bool:
        """``at_once_safe``: a load on ``site`` would leave some other deployed model whose demand is not
        measured yet (``_unseen_deployed``) with no replica free of loads (every one beside it, evicted by
        it, or held by another load). ``_stalls`` counts only models with demand, so in the warm-up a
        reward model whose calls have not come yet does not count there; that is right for a load some
        waiting call needs (on 8 GPUs every site is beside some deployed replica), but ``plan_at_once``'s
        loads beyond those are a forecast's, and can wait for the next call instead."""
        gp = self.gpu
        node, gpus, evict = site
        st = gp.nodes[node]
        cands = {o for i in gpus for o in st.gpus[i].replicas}
        cands.update(evict)
        for m in {gp.replicas[o].model for o in cands}:
            if m != model and self._unseen_deployed(m) and all(
                    o in cands or self._held_by_load(o) for o in gp.by_model[m]):
                return True
        return False

    def _held_by_load(self, rid: ReplicaId) -> bool:
        """The replica cannot serve until a load ends: it is loading, or shares a GPU with one that is."""
        gp = self.gpu
        r = gp.replicas[rid]
        if r.loading:
            return True
        gpus = gp.nodes[r.node].gpus
        return any(gp.replicas[o].loading for i in r.gpus for o in gpus[i].replicas)

    def _spanning_site(self, model: str, spec: ActionSpec, waiting: set[str]) -> tuple | None:
        """A replica too large for any topology group spans groups (and pays the slowdown)."""
        gp = self.gpu
        ms = self.models[model]
        best = None
        # only the nodes where it spans groups: where it fits one group is the main path's case, and
        # where it is larger than the node it never fits
        for name, st, k in self._replica_shapes(ms, spec)[1]:
            idle = [i for i, g in enumerate(st.gpus) if not g.busy]
            if len(idle) < k:
                continue
            idle.sort(key=lambda i: -st.gpus[i].mem_free)
            gpus = tuple(sorted(idle[:k]))
            cands = {rid for i in gpus for rid in st.gpus[i].replicas}
            order = self._evict_order(cands, waiting)
            plan = gp.eviction_plan(name, gpus, ms.gpu_memory_gb / k, order)
            if plan is not None and (best is None or len(plan) < best[0]):
                best = (len(plan), name, gpus, plan)
        return best

    def _evict_rank(self, rid: ReplicaId, waiting: set[str]) -> tuple:
        r = self.gpu.replicas[rid]
        if self.opt.residency:
            return (r.model in waiting, self._density(r.model), -len(self.gpu.by_model[r.model]), r.last_used, rid)
        return (r.model in waiting, -len(self.gpu.by_model[r.model]), r.last_used, rid)

    def _density(self, model: str) -> float:
        """Demand per GB of the model's replicas: what a GB of its residency is worth."""
        return self._needed(model, self._now) / max(self.models[model].gpu_memory_gb, 1e-6)

    def _evict_order(self, cands, waiting: set[str]) -> list[ReplicaId]:
        """The replicas on a load site that may go, in the order to evict them (``_evict_rank``).

        With ``evict_count`` each is judged with the replicas of its model listed before it gone
        (``_evictable``'s ``gone``): a model whose demand needs one of its two replicas may lose one,
        not both. Judged one at a time, both were "beyond its need": on the live benchmark's 4 GPUs a
        140 GB judge's second replica evicted both replicas of the 16 GB judge during a burst of rewards,
        which then waited for a reload beside the 140 GB judge's only ready replica.
        """
        out: list[ReplicaId] = []
        gone: dict[str, int] = {}  # per model, its replicas already in ``out`` (kept at 0 without evict_count)
        for rid in sorted(cands, key=lambda rid: self._evict_rank(rid, waiting)):
            m = self.gpu.replicas[rid].model
            if self._evictable(rid, waiting, gone.get(m, 0)):
                out.append(rid)
                if self.opt.evict_count:
                    gone[m] = gone.get(m, 0) + 1
        return out

    def _evictable(self, rid: ReplicaId, waiting: set[str], gone: int = 0) -> bool:
        """Idle, and not a replica its model's demand needs, unless the loader needs the memory more.

        A model keeps ``_keep`` replicas (``ceil(needed)``: recent demand in busy
        replicas, plus one while it has waiters; with ``evict_wait``, as many as
        keep its queueing short); a replica beyond that may
        go. One within it goes only for a model with ``evict_margin`` times
        its demand per GB, and with ``evict_wait`` only if the replicas left keep
        its queueing short (its last one, only if none of its calls is expected
        within one reload: on ``live-seed4`` a 140 GB judge's second replica took
        both of the 16 GB judge's, one beyond its need and its last by density,
        and the 16 GB judge was loaded back 7 s later, ACT 1.25x static's ->
        1.10x), or for a model with waiters and no replica at all
        when it has no waiters itself: so a model that cannot load is never
        stuck behind idle replicas nobody waits for. A model deployed before
        the step whose actions were not seen yet is kept until 8 trajectories
        have ended (rewards come last). A replica this policy loaded is kept
        until it has served as many seconds of work as its load took (the
        load is paid back), unless a model with no replica at all needs it.
        """
        r = self.gpu.replicas[rid]
        if r.busy:
            return False
        reps = len(self.gpu.by_model[r.model]) - gone  # gone: of its model's replicas, those evicted before it
        if r.model in waiting and reps <= 1:
            return False
        if not self.opt.residency:
            return True
        if reps <= 1 and self._forecast_load and not self._loader_starved and self._needed(r.model, self._now) > 0:
            return False  # plan_keep_last: a forecast does not take a model with demand its last replica
        if rid in self._unpaid and not self._loader_starved:
            return False  # loaded here and not paid back yet: it has served less work than its load took
        if ((r.model not in self.pools or self._unseen_deployed(r.model)) and self.traj_n < 8
                and not self._loader_starved):
            return False  # deployed for demand not seen yet (rewards come last): keep it until trajectories end
        if reps > self._keep(r.model):
            return True
        if self._loader_starved and r.model not in waiting:
            return True
        if self._loader_density <= self.opt.evict_margin * self._density(r.model):
            return False
        if self._loader_starved or not self.opt.evict_wait:
            return True
        if reps <= 1:  # its last replica: kept while a call of it is expected within one reload
            pool = self.pools.get(r.model)
            return pool is None or pool.arrivals.rate(self._now) * self.models[r.model].load_s < 1.0
        return self._wait_ratio(r.model, reps - 1) <= self.opt.evict_wait

    def _wait_ratio(self, model: str, c: int) -> float:
        """``evict_wait``: on ``c`` replicas, the mean wait of ``model``'s actions over their mean work
        (M/M/c, Erlang C, at its recent demand in busy replicas: the ratio needs nothing else); 0 where no
        demand was measured."""
        a = self._busy(model)
        return _erlang_wq(c, a, 1.0) if a > 0 else 0.0

    def _busy(self, model: str) -> float:
        """The model's recent demand in busy replicas (0 for a model never called)."""
        pool = self.pools.get(model)
        return pool.demand.rate(self._now) if pool is not None else 0.0

    def _keep(self, model: str) -> int:
        """The replicas ``model``'s demand needs: ``ceil(needed)`` (a replica per busy one, one more while
        its actions wait) and, with ``evict_wait``, as many as keep its actions' mean wait (Erlang C)
        under ``evict_wait`` x their mean work.

        A replica per busy one leaves a model at utilisation near 1 on the replicas it keeps, and
        its actions queue. On gpux-111 the 140 GB judge, 0.57 replicas busy (7 s calls), kept one
        of its two: the vision judge's third replica evicted the other (t = 179 s), and its
        rewards then waited 6 s each on average (Erlang C on one replica: 9 s) until it was loaded
        back (100 s). On two replicas Erlang C gives 0.7 s: it keeps both.
        """
        need = math.ceil(self._needed(model, self._now))
        if not self.opt.evict_wait:
            return need
        c = max(need, 1)
        # no model holds more replicas than GPUs: Erlang C is not run past that
        return _servers(self._busy(model), c, max(c, self.gpu.total), self.opt.evict_wait)


def _servers(a: float, c: int, most: int, wait: float) -> int:
    """The fewest servers from ``c`` up (at most ``most``) on which an offered load of ``a`` busy ones waits,
    on average, at most ``wait`` x its mean work (Erlang C, as :func:`_erlang_wq`); ``c`` for no load.

    Erlang B is carried from one ``c`` to the next (its recursion in ``c``), so the search is O(servers);
    computed anew for each ``c`` it was O(servers^2): 14% of the run's time (cProfile) on scale.yaml cut to
    20,000 trajectories on cluster-large.yaml, 2% on the whole of it."""
    if a <= 0 or c >= most:
        return c
    b = 1.0
    for k in range(1, c + 1):  # Erlang B on c servers
        b = a * b / (k + a * b)
        if b == 0.0:
            break  # underflowed: every later step gives 0.0 again
    while c < most:
        if a < c and _wait_of(c, a, b, 1.0) <= wait:
            return c
        c += 1
        b = a * b / (c + a * b)
    return c


def _wait_of(c: int, a: float, b: float, s: float) -> float:
    """The mean wait on ``c`` servers (``a < c``) from Erlang B ``b``: Erlang C ``pw = c B / (c - a (1 - B))``, the
    wait ``pw s / (c - a)``."""
    return c * b / (c - a * (1.0 - b)) * s / (c - a)


def _erlang_wq_pair(c: int, a: float, s: float) -> tuple[float, float]:
    """``(_erlang_wq(c, a, s), _erlang_wq(c + 1, a, s))``, the mean waits on ``c`` and ``c + 1`` servers, from
    one Erlang B recursion (it passes through ``c`` on its way to ``c + 1``), each read by :func:`_wait_of`."""
    if c + 1 <= 0 or a >= c + 1:
        return math.inf, math.inf
    b = 1.0
    w0 = math.inf
    for k in range(1, c + 2):  # Erlang B by recursion, read at c and at c + 1
        b = a * b / (k + a * b)
        if b == 0.0:  # underflowed: 0.0 from here on, so a wait read after this step is 0.0
            return (w0 if k > c else (0.0 if 0 < c and a < c else math.inf)), 0.0
        if k == c and a < c:
            w0 = _wait_of(c, a, b, s)
    return w0, _wait_of(c + 1, a, b, s)


def _erlang_wq_bound(c: int, a: float, s: float) -> float:
    """An upper bound of ``_erlang_wq(c, a, s)`` in O(1) (``inf`` where it gives none), so that ``_plan_ahead``
    runs the O(c) recursion only where a load may pay: most of its calls are on models with many replicas
    and little waiting (decision_cost.py --gpu at 512 nodes: median 478 replicas at 58% busy).

    Erlang B is ``P(X = c) / P(X <= c)`` for ``X`` Poisson with mean ``a``. Past ``a + 1`` servers ``c`` is above
    the Poisson median (under ``a + 1/3``), so ``P(X <= c) >= 1/2``: ``B <= 2 P(X = c)``, the probability read
    from ``lgamma`` (with a margin for its rounding). Erlang C grows with ``B``."""
    if a <= 0 or c < a + 1:
        return math.inf
    b = 2.0 * (1.0 + 1e-9) * math.exp(c * math.log(a) - a - math.lgamma(c + 1.0))
    return _wait_of(c, a, 1.0 if b > 1.0 else b, s)


def _erlang_wq(c: int, a: float, s: float) -> float:
    """Mean wait in an M/M/c queue (Erlang C) with offered load ``a`` (busy servers) and mean service ``s``
    (infinite where ``a >= c``)."""
    return _erlang_wq_pair(c - 1, a, s)[1]
