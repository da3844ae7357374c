"""Admission, the tangram policy's gate: which trajectories start now (docs/scheduling.md, "Admission").

Trajectories are admitted (``admission > 0``, the default) only while the
expected demand on each resource (Little's law, learned from whole
trajectories, rewards included, from what their actions took: ``gate_runs``)
stays under a target: CPU slots, GPUs (``admission_gpu``) and API tokens
(``admission_api``); never while queued work already exceeds
a mean action per unit (``_queueing``). The CPU term is the knee
(``admission_knee``): the CPU demand of every issued action at
``units.max``, kept under 0.8 x the slots. Before anything is learned, the
opening admits one trajectory per CPU slot and per API token
(``_open_share``), or, where the cluster leans to GPUs, what the per-model
gate allows (``_model_limit``).

A mixin of :class:`~.tangram.TangramPolicy`, which sets up the state it
reads (what was learned of trajectories and actions, the admission queue) in
``__init__``.
"""

from __future__ import annotations

import heapq
import math

from .types import Admit, Decision


class AdmissionGate:
    """The gate: ``_admit`` admits the trajectories that wait while ``_admission_limit`` allows.

    Reads what the events learned (``gaps``, ``turn_time``, ``turn_units``, ``turn_count_units``,
    ``cpu_at_max``, ``model_work``, ``gpu_calls``, ``gpu_tools``, ``ended_work``, ``ended_n``) and the
    queues; changes ``admission_queue``, ``admitted``, ``fresh`` and its own cache of the limit (``_limit``,
    ``_limit_dirty``, ``_binds``, ``_lim_other``, ``_idle_at``, ``admission_measured``'s ``_m_*``).
    """

    def _admit(self, now: float, out: list[Decision]) -> None:
        """Admit trajectories while the expected demand on each resource stays under its target (Little's law).

        The limit (``_admission_limit``) is a function of what was learned and
        of capacity only: it is recomputed when a submission, a trajectory's
        end or a capacity change touched them (``_limit_dirty``), not on every
        pass. The queue check runs only when the limit would admit someone.
        """
        opt = self.opt
        if self._limit_dirty or self._limit is None:
            max_wait = math.inf
            if self._learned():
                cycle = self.gaps.mean + self.turn_time.mean
                limit = self._admission_limit(cycle)
                if opt.admission_cycles:
                    max_wait = opt.admission_cycles * cycle
            else:
                limit = max(self.cpu.slots, 1)  # nothing learned yet: one trajectory per slot
                if opt.open_share and not (opt.admission_model and self._gpu_lean()):
                    limit = self._open_share(limit)  # (where the cluster leans to GPUs the per-model gate opens)
            self._limit = (limit, max_wait)
            self._limit_dirty = False
        limit, max_wait = self._limit
        if opt.admission_measured and opt.admission_issued:
            limit = self._measured(now, limit)
        if opt.admission_model and self.ended_n < opt.admission_warmup and self._gpu_lean():
            if self.turn_time.n >= 4:
                m = self._model_limit()
                if (opt.open_hold and opt.admission_open
                        and self.turn_time.n < (opt.open_hold if m < math.inf else opt.open_blind)):
                    # GPU actions seen: no more than the opening until as many actions as the learned limit
                    # needs (on gpux-101 the first four held one prm call hinted 0.2 s and read 41 in flight);
                    # with open_blind, also for a while when none was seen (four CPU calls say little either)
                    m = min(m, opt.admission_open)
                limit = min(limit, m)
            elif opt.admission_open:
                limit = min(limit, opt.admission_open)  # nothing seen yet: a first batch to learn from
        active = len(self.admitted)  # self.active, read once: this runs on every pass with a queue
        if active < limit:
            if opt.admission_queue and self._queueing():
                limit = active
        # (_idle's first test is read here: once a trajectory ended it is false on nearly every pass)
        elif opt.idle_admit and (not self.ended_n or (opt.idle_learned and self._binds > 0)) and self._idle(now):
            limit = active + 1
            self._idle_at = now
        if opt.admission_ramp and active < limit and not self._learned():
            limit = self._ramp(limit)
        queue = self.admission_queue
        if (opt.admit_tail and self.ended_n < opt.admission_warmup
                and len(queue) <= opt.admit_tail * active):
            limit = math.inf
        while queue:
            if active >= limit and not (opt.admission_step and self._step_short()):
                if max_wait == math.inf or now - next(iter(queue.values())) < max_wait:
                    break  # (the head's wait is read only where it may admit it)
            t = self._long_first() if self._long else None
            if t is None:
                t, _ = queue.popitem(last=False)
            else:
                del queue[t]
            if self._long_seq:
                self._long_seq.pop(t, None)
                if not self._long_seq:  # nobody with an expected length waits: every heap entry is stale
                    self._long.clear()
            self.admitted.add(t)
            if self.trajectory_ttl_s is not None:
                self._touch(t, now)  # one admitted that never issues an action still expires, and frees its place
            active = len(self.admitted)
            self.fresh.add(t)
            self.last_end[t] = now
            out.append(Admit(t))
        if not queue:
            self._m_prev = None  # nobody waits: the time until somebody does is not measured

    def _long_first(self) -> str | None:
        """``admit_long``: the longest expected trajectory waiting, where its expected length is over
        ``admit_long`` x the mean given; None: the queue's head goes. Entries of trajectories no longer
        waiting (or asked again since) are dropped as they reach the top: O(log n) amortised."""
        heap, live = self._long, self._long_seq
        while heap and live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        if heap and -heap[0][0] > self.opt.admit_long * self._expected.mean:
            return heapq.heappop(heap)[2]
        return None

    def _open_share(self, limit: float) -> float:
        """``open_share``: the opening per unit of the CPU slots and of the API quota alike, then, once 4
        actions were seen, per unit of what the actions seen hold of each on average (units.min).

        One trajectory per CPU slot presumes trajectories use the CPU. Where most calls hold API tokens,
        that puts more trajectories in flight than there are tokens: on ``api-tight`` (32 slots, 12
        tokens) 99 of the 144 s its API calls waited fell in the first 50 s, and its ACT was 1.03x
        static's (which binds a token per trajectory, so its calls never wait); now 0.99x. On the
        standard cluster (128 slots, 64 tokens) it opens with 64 and has 128 in flight by t = 5 s.

        ``open_prior``: the share per action is read with the opening's own guess (one unit of each per
        action) counted as ``open_prior`` actions seen, so that 4 actions do not move it far. On ``api-tight``
        drawn on seed 1216 the first 4 held one token between them: from them alone the limit went 12 -> 32 at
        t = 1.6 s, and 24-32 trajectories shared 12 tokens until t = 20 s (the learned limit then: 14-16); the
        searches waited 33 s in all, and ACT was 1.022x static's. With the guess counted as 4 actions the
        limit goes to 19, at most 24 are in flight before t = 20 s, the searches wait 8.5 s in all, and ACT is
        0.993x static's (step 0.41 -> 0.43x).

        Not where the cluster leans to GPUs (``_gpu_lean``, with ``admission_model``): there the per-model
        gate opens with ``admission_open``, and a token cap under it slowed the ramp. On the GPU-bound
        file's cluster at 30% (10 slots, 5 tokens, 8 GPUs) it opened with 5, and the step was 472 s
        against 400 s, over static's 443 on the whole cluster: its parity went 0.20 -> 0.45."""
        caps = {"cpu": self.cpu.slots, "api": self.api.total}
        n = self.turn_time.n
        if n < 4:
            return max(min([limit] + [c for c in caps.values() if c > 0]), 1)
        out = limit
        n0 = self.opt.open_prior  # the opening's own guess, one unit of each per action, as n0 actions seen
        for res, cap in caps.items():
            k = (self.turn_count_units[res] + n0) / (n + n0)
            if k > 0 and cap > 0:
                out = min(out, cap / k)
        return max(out, 1)

    def _learned(self) -> bool:
        """Enough turns seen (16 LLM gaps, 16 actions) for the admission limit to be learned from them."""
        return self.gaps.n >= 16 and self.turn_time.n >= 16

    def _gpu_lean(self) -> bool:
        """The per-model gate applies: the cluster leans to GPUs (CPU slots <= ``gpu_lean`` x GPUs), or
        ``gpu_lean`` is 0 (every cluster).

        The opening (``admission_open``) is decided before any action is seen, so from the cluster alone.
        Its guess of one trajectory per CPU slot presumes trajectories use the CPU; on a cluster with
        at most 4 CPU slots per GPU (the GPU shapes of benchmarks/variants.py have 2.7-4; the standard
        and tight clusters 8) the GPUs are likelier to be what fills first, and 32 trajectories
        admitted at once queue behind a process reward model's one replica. Where CPU slots are
        plentiful the gate changes nothing: there, a first batch that admits the rest a few seconds
        later moves which node a long test run meets, and the heavy-tail steps with it.
        """
        g = self.opt.gpu_lean
        return not g or (self.gpu.total > 0 and self.cpu.slots <= g * self.gpu.total)

    def _model_limit(self, model: str | None = None, loading: bool = False, busy: float = 0.0) -> float:
        """``admission_model``: trajectories in flight at which some model's replicas (one action at a
        time each) are ``admission_model`` busy (or ``busy``, where given: ``plan_busy``), from the
        actions seen so far (per action, over the turn cycle). The GPU limit counts every GPU as one
        pool; a model is served by its own replicas only (a process reward model on one 1-GPU replica
        caps a step at a few trajectories however many GPUs the other models hold)."""
        n = max(self.turn_time.n, 1)
        cycle = (self.gaps.mean if self.gaps.n else 4.0) + self.turn_time.mean
        out = math.inf
        for m, w in self.model_work.items():
            if model is not None and m != model:
                continue
            d = w / n / max(cycle, 1e-6)
            if d > 0:
                reps = len(self.gpu.by_model.get(m, ()))
                if not loading:  # a replica still loading serves nothing yet
                    reps -= sum(1 for x in self._loading.values() if x == m)
                out = min(out, (busy or self.opt.admission_model) * max(reps, 1) / d)
        return out

    def _measured(self, now: float, limit: float) -> float:
        """``admission_measured``: the CPU limit of ``admission_issued`` also from the CPU demand
        measured while trajectories wait for admission (units.min held or queued per trajectory in
        flight, time-averaged over ``horizon_s``), never below the modelled limit."""
        cpu = self.pools["cpu"]
        dt = now - self._m_t
        if dt > 0 and self._m_prev is not None:
            k = math.exp(-dt / self.opt.horizon_s)
            occ, act = self._m_prev
            self._m_occ = self._m_occ * k + (1 - k) * occ
            self._m_act = self._m_act * k + (1 - k) * act
            self._m_w = self._m_w * k + (1 - k)
        self._m_t = now
        self._m_prev = (cpu.rmin + cpu.qmin, self.active)
        if self._binds != 0 or self._m_w < 0.5 or self._m_act <= 0 or self._m_occ <= 0:
            return limit
        demand = self._m_occ / self._m_act
        cap = self.opt.admission_issued * self.opt.admission_measured * self.cpu.slots
        return max(limit, min(self._lim_other, cap / demand))

    def _step_short(self) -> bool:
        """``admission_step``: the queue would drain after those in flight have ended.

        With ``C`` in flight and memoryless trajectory lengths of mean ``T``, the last of them ends
        about ``T x H_C`` from now (``H_C`` the harmonic number); at the admission rate they set,
        ``C / T``, the ``Q`` waiting are all admitted after ``Q x T / C``, and the last ends ``T``
        later. Past ``Q > C x (H_C - 1)`` the gate, not the cluster, sets the step.
        """
        c = self.active
        if self._binds != 0 or c >= self._lim_other:
            return False
        if c == 0:
            return True
        return len(self.admission_queue) > self.opt.admission_step * c * (math.log(c) + 0.5772 - 1.0 + 0.5 / c)

    def _ramp(self, limit: float) -> float:
        """Before 16 actions were seen (``admission_ramp``): the limit of one trajectory per CPU slot
        is a guess, made before anything says which resources trajectories use. Admit 16 (enough to
        learn from), then ``admission_ramp`` x those in flight more once the previous ones have issued
        their first action, and nobody while an action waits anywhere: on a GPU-bound step of 48
        trajectories, 32 admitted at once queued 0-40 s behind one replica of a process reward model.
        """
        if any(pool.qmin for pool in self.pools.values()):
            return self.active
        grow = self.active * (1.0 + self.opt.admission_ramp) - len(self.fresh)
        return min(limit, max(16.0, grow))

    def _idle(self, now: float) -> bool:
        """Before any trajectory has ended: one more trajectory past the limit
        adds throughput, not queueing, while every resource is below its target occupancy now
        (``admission`` x the CPU slots, ``admission_gpu`` x the GPUs and the API tokens) and nothing
        waits for any of them.

        Until then the limit counts a trajectory as one unit of the scarcest resource it uses, even
        where trajectories spend most of their time in LLM generation. Rate-limited so that the
        demand of those admitted shows before more come: at most one per ``idle_admit`` turn
        cycles (LLM gap + action time), and none while ``1 / idle_admit`` admitted trajectories
        have not issued their first action.

        After a trajectory has ended (``idle_learned``), only while the learned limit is set by the
        GPUs or the API tokens, and every resource is under ``idle_learned`` x its capacity busy:
        that limit is read from the trajectories that ended first, the short ones, in which the
        reward (a GPU or API action) is a larger share than in the rest, so it reads low. On
        ``gpu-small-b`` it held 5-7 trajectories in flight from t = 50 to 115 s with 90 waiting,
        nothing queued and 4-7 of the 8 GPUs idle. A CPU limit read from the same sample is biased
        the other way (high), so idleness does not correct it.
        """
        learned = self.ended_n > 0
        if (learned and not (self.opt.idle_learned and self._binds > 0)) or self.gaps.n < 4:
            return False
        if len(self.fresh) * self.opt.idle_admit >= 1:
            return False
        if now - self._idle_at < self.opt.idle_admit * (self.gaps.mean + self.turn_time.mean):
            return False
        if any(pool.qwork > 0 for pool in self.pools.values()):
            return False
        gpu_target = self.opt.admission_gpu or 1.0
        api_target = self.opt.admission_api or gpu_target
        cpu_target = self.opt.admission
        if learned:
            cpu_target = gpu_target = api_target = self.opt.idle_learned
        busy = ((self.cpu.slots - self.cpu.slots_free, self.cpu.slots, cpu_target),
                (self.gpu.total - self.gpu.idle, self.gpu.total, gpu_target),
                (self.api.total - self.api.total_free, self.api.total, api_target))
        return all(b < target * units for b, units, target in busy if units > 0)

    def _queueing(self) -> bool:
        """Work already queued for some resource would make a new trajectory's action wait
        longer than ``admission_queue`` x a mean action: admitting it adds queueing, not throughput.

        Measured per resource: queued expected unit-seconds over its capacity
        (the GPUs together, the CPU slots, the API tokens).
        """
        if self.turn_time.n < 16:
            return False
        bound = self.opt.admission_queue * self.turn_time.mean
        cpu = gpu = api = 0.0
        for pool in self.pools.values():  # a few pools (CPU, API, one per model): no dict per pass
            r = pool.resource
            if r == "cpu":
                cpu += pool.qwork
            elif r == "gpu":
                gpu += pool.qwork
            else:
                api += pool.qwork
        return any(work > bound * cap for work, cap in ((cpu, self.cpu.slots), (gpu, self.gpu.total),
                                                        (api, self.api.total)) if cap > 0)

    def _admission_limit(self, cycle: float) -> float:
        """Trajectories in flight at which some resource reaches ``admission`` x its capacity.

        Each resource's demand per active trajectory is its unit-seconds per
        action over the cycle (LLM gap + action time). With ``admission_gpu``
        the GPUs and the API quota count as well as the CPU slots: a GPU-bound
        workload saturates GPUs long before CPU slots, and past that point more
        trajectories in flight only queue at the reward models.

        With ``admission_knee`` (the default, unless ``admission_issued`` states the CPU term) the CPU
        demand is that of every issued action at ``units.max``: under ``admission_knee`` x the slots, one
        more trajectory in flight fills idle slots; past it, it shrinks elastic actions (ACT) for the
        throughput narrower actions give. The ended trajectories' figure at ``units.min`` is read from
        the short ones and, on 32 slots, never bound.
        """
        opt = self.opt
        a_gpu = opt.admission_gpu
        a_api = opt.admission_api or a_gpu
        if (opt.admission_gpu_lean and opt.admission_model and a_gpu and 2 * self.gpu_tools > self.gpu_calls
                and self._gpu_lean()):
            # GPU-bound (most GPU calls are tools, not rewards): the per-model opening keeps the warm-up's
            # GPU queues short; past it, a looser GPU target gives the step back the throughput that the
            # smaller opening took (gpux-107: 8 GPUs). Where the GPUs serve rewards only, it would add
            # queueing for nothing (the CPU-bound half cluster of tests/test_variants.py: ACT +5%).
            a_gpu = opt.admission_gpu_lean
            if self.lulls and opt.steps_gpu_lean and opt.steps_gpu_lean < a_gpu:
                # past a whole step, the figure below holds every trajectory of it, not first the short ones
                # (which ask more of the GPUs per cycle: their reward is a larger share), and reads lower
                # (0.55 -> 0.5 with gate_runs; 0.7 -> 0.55, 0.7 x 0.79, before it)
                a_gpu = opt.steps_gpu_lean
            a_api = a_gpu  # the API tokens as the GPUs
        slots = self.cpu.slots
        # written out for three resources (CPU slots 0, GPUs 1, API tokens 2), no lists or loops:
        # recomputed after every submission while trajectories wait (a million times in the scale run)
        if a_gpu and self.ended_n >= (8 if 8 > opt.admission_warmup else opt.admission_warmup):
            # whole trajectories, their last action (the reward) included: what one in flight asks of each resource
            w = self.ended_work
            n = 1.0 if 1.0 > w[4] else w[4]
            cycle = self.gaps.mean + w[3] / n
            x0, x1, x2 = w[0] / n, w[1] / n, w[2] / n
            c2 = cycle
            if opt.api_whole and w[2] > 0:
                x2, c2 = self._api_whole(x2, c2)
        else:
            n = self.turn_time.n or 1  # max(n, 1): n is a count
            u = self.turn_units
            x0, x1, x2 = u["cpu"] / n, u["gpu"] / n, u["api"] / n
            c2 = cycle
        cap0 = opt.admission * slots
        cap1 = a_gpu * self.gpu.total if a_gpu else 0.0
        cap2 = a_api * self.api.total if a_gpu else 0.0
        c0 = cycle
        if opt.admission_issued:
            cap0 = opt.admission_issued * slots
            # The trajectories that ended first are the short ones: their tool work per action is
            # biased low (their reward is a larger share of it, their long actions had no time to be
            # issued). Every issued action, in flight or ended, says it without that bias.
            per_issued = self.turn_time.n or 1
            x0 = self.turn_units["cpu"] / per_issued
            x2 = self.turn_units["api"] / per_issued
            c0 = c2 = self.gaps.mean + self.turn_time.mean
        elif opt.admission_knee:  # admission_issued, where set, states the CPU term
            # The knee: past it the CPU cannot hold every action at its largest size, so one more trajectory
            # in flight shrinks actions (ACT) rather than filling idle slots (throughput). Every issued action
            # says it, not only those of the trajectories that ended first (the short ones).
            knee = opt.admission_knee
            if self.lulls and opt.steps_knee and opt.steps_knee < knee:
                knee = opt.steps_knee  # past a whole step (see steps_gpu_lean above)
            cap0 = knee * slots
            x0 = self.cpu_at_max / (self.turn_time.n or 1)
            c0 = self.gaps.mean + self.turn_time.mean
        limit = math.inf
        binds = -1
        other = math.inf  # the limit set by the GPUs and the API tokens alone
        d = x0 / (1e-6 if 1e-6 > c0 else c0)  # max(c0, 1e-6), as are the two below
        if d > 0 and cap0 > 0 and cap0 / d < limit:
            limit, binds = cap0 / d, 0
        for which, x, c, cap in ((1, x1, cycle, cap1), (2, x2, c2, cap2)):  # the GPUs, then the API tokens
            d = x / (1e-6 if 1e-6 > c else c)
            if d > 0 and cap > 0:
                lim = cap / d
                if lim < other:
                    other = lim
                if lim < limit:
                    limit, binds = lim, which
        self._binds, self._lim_other = binds, other
        if limit == math.inf:
            limit = opt.admission * max(slots, 1) / 1e-6
        if a_gpu and self.ended_n < opt.admission_warmup:
            # rewards come last: until whole trajectories were seen, the demand per action misses them
            limit = min(limit, self._warmup_cap())
        return limit

    def _api_whole(self, x2: float, c2: float) -> tuple[float, float]:
        """``api_whole``: a trajectory's API unit-seconds and its length in action cycles, without the bias of
        the trajectories that ended first (the short ones; ``(x2, c2)`` from them, as is, where nothing else
        is known yet).

        A trajectory is its tool turns, then its last action (the reward). The last actions are read from
        the trajectories that ended (one each, whatever their length); the tool calls from every action
        issued but those (unbiased per call); the tool turns per trajectory from the hazard of ending
        (every turn issued so far, in flight or ended, over the trajectories that ended: the estimate of a
        geometric count's mean that counts the ones still running). From the ended ones alone, on the
        ``api`` family's ``api-batch`` (2-token batched calls on the long trajectories, most of the short
        ones' work a 1-token judge) the limit read 33 trajectories at the end of the warm-up and fell to 25
        as longer ones ended; the 15 admitted at once waited 125 s in all for tokens. The GPU term keeps
        its biased figure: there the bias is a tighter gate early in the step, which the GPU-bound steps
        need (gpu ACT/ideal 1.431 -> 1.532 without it, docs/scheduling.md).
        """
        w = self.ended_work
        m = self.ended_n
        tools = self.turn_time.n - m
        if m <= 0 or tools <= 0:
            return x2, c2
        turns = tools / m
        g = self.gaps.mean
        t_tool = (self.turn_time.mean * self.turn_time.n - w[6]) / tools
        api_tool = (self.turn_units["api"] - w[5]) / tools
        return (turns * api_tool + w[5] / m) / (turns + 1.0), g + (turns * t_tool + w[6] / m) / (turns + 1.0)

    def _warmup_cap(self) -> float:
        """Before ``admission_warmup`` trajectories have ended, at most one trajectory in flight per
        unit of the scarcest resource the actions seen so far use (CPU slots, GPUs, API tokens).

        The demand per action learned until then misses the rewards (every
        trajectory's last action), so the learned limit is too high: on a
        GPU-bound step it let 73 trajectories in on 12 GPUs in the first
        10 s, and the reward models queued for 100 s once they ended.
        """
        if not self.opt.warmup_units:
            return max(self.cpu.slots, 1)
        caps = {"cpu": self.cpu.slots, "gpu": self.gpu.total, "api": self.api.total}
        seen = [caps[r] for r, x in self.turn_units.items() if x > 0 and caps[r] > 0]
        return max(min(seen, default=self.cpu.slots), 1)
