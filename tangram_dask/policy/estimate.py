"""What a policy knows of an action's duration: its hint, corrected by history.

Pure: no Dask import. Per action kind it learns, from completed actions, the
distribution of the log of the true work (on ``units_min``) and of the hint's
log error. The estimate is the posterior mean of the work given the hint
(a precision-weighted blend in log space), so a kind whose hints are noisy
leans on its history and a kind whose hints are sharp leans on the hint.
Never the true duration of a pending action: only hints and what finished.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..spec import ActionSpec

MIN_SAMPLES = 8
HINT_SD_FLOOR = 1.0  # (log) the spread the hint bound assumes at least: hints all alike still let a 400x one through
LOG_MOST = math.log(1e9)  # an estimate is at most 1e9 s (the most a spec's seconds may say): never an overflow


@dataclass(slots=True)
class Welford:
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def var(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0

    def replace(self, old: float, new: float) -> None:
        """One value added before, ``old``, is ``new`` instead (the count unchanged)."""
        n = self.n
        if n <= 1:
            self.mean, self.m2 = (new, 0.0) if n == 1 else (self.mean, self.m2)
            return
        m1 = (n * self.mean - old) / (n - 1)  # without ``old``
        m2 = self.m2 - (old - self.mean) * (old - m1)
        self.n, self.mean, self.m2 = n - 1, m1, m2 if m2 > 0.0 else 0.0
        self.add(new)


@dataclass(slots=True)
class Covariance:
    """Running means, variances and covariance of pairs (Welford's update), for a correlation."""
    n: int = 0
    mx: float = 0.0
    my: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        dx = x - self.mx
        self.mx += dx / self.n
        dy = y - self.my
        self.my += dy / self.n
        self.sxx += dx * (x - self.mx)
        self.syy += dy * (y - self.my)
        self.sxy += dx * (y - self.my)

    def corr(self) -> float:
        """Pearson's correlation; 0 while either spread is 0."""
        d = self.sxx * self.syy
        return self.sxy / math.sqrt(d) if d > 0 else 0.0


@dataclass(slots=True)
class KindStats:
    work: Welford   # log of the true work on units_min
    error: Welford  # log(hint) - log(true work)
    est_cache: tuple[float, float, float, float] | None = None  # (mu, var_w of what finished, bias, var_e)
    hints: Welford | None = None  # log of the hints of every action issued (not only those that finished)
    # (hint_bound) the first MIN_SAMPLES hint logs and hint errors, kept until they are bounded together
    first_hints: list[float] | None = None
    first_errors: list[float] | None = None
    first_tags: list | None = None  # what the caller tagged each of the first hints with (issue's tag)


def _robust(xs: list[float], z: float) -> list[float]:
    """``xs`` with each value over ``z`` robust sd (1.4826 x the median absolute deviation, at least
    ``HINT_SD_FLOOR``) from their median replaced by the median."""
    ys = sorted(xs)
    n = len(ys)
    med = (ys[(n - 1) // 2] + ys[n // 2]) / 2
    dev = sorted(abs(v - med) for v in ys)
    d = z * max(1.4826 * (dev[(n - 1) // 2] + dev[n // 2]) / 2, HINT_SD_FLOOR)
    return [v if abs(v - med) <= d else med for v in xs]


def _add_first(w: Welford, buf: list[float] | None, x: float, z: float,
               out: list[tuple[int, float, float]] | None = None) -> list[float] | None:
    """Add ``x`` to ``w``, one of its first ``MIN_SAMPLES`` values (``buf``, the ones so far). When there are
    ``MIN_SAMPLES``, ``w`` is rebuilt from them as ``_robust`` keeps them: one absurd value among them moves
    neither their mean nor their spread (each one it replaced goes into ``out``, as (its place, value,
    counted as)). Returns the buffer, None once it is spent."""
    buf = [x] if buf is None else buf + [x]
    w.add(x)
    if len(buf) < MIN_SAMPLES:
        return buf
    w.n, w.mean, w.m2 = 0, 0.0, 0.0
    for i, (v, k) in enumerate(zip(buf, _robust(buf, z))):
        w.add(k)
        if k != v and out is not None:
            out.append((i, v, k))
    return None


class BoundedMean:
    """The mean of the values given (seconds), each bounded as hints are (``hint_bound``): a value whose log is
    over ``z`` sd from the logs before it, once there are ``MIN_SAMPLES`` (the first ones together, ``_robust``),
    counts as the mean so far. :meth:`add` returns the value as bounded (its log within ``z`` sd). Values of
    0 s count as given."""

    __slots__ = ("z", "logs", "n", "total", "_first")

    def __init__(self, z: float):
        self.z = z
        self.logs = Welford()
        self.n = 0
        self.total = 0.0
        self._first: list[float] | None = []  # the logs of the first values, until they are bounded together

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def bounded(self) -> bool:
        """Bounds exist: ``MIN_SAMPLES`` values were given (or ``z`` is 0, and every value is within)."""
        return not self.z or self._first is None

    def within(self, x: float) -> bool:
        """``x`` is within bounds of the values given (as :meth:`add` would count it), or too few were given."""
        if not self.z or not x > 0.0 or self._first is not None:
            return True
        lx = math.log(x)
        return _within(self.logs, lx, self.z) == lx

    def add(self, x: float) -> float:
        self.n += 1
        if not self.z or not x > 0.0:
            self.total += x
            return x
        lx = math.log(x)
        if self._first is None:
            b = _within(self.logs, lx, self.z)
            if b == lx:
                self.logs.add(lx)
                self.total += x
                return x
            self.logs.add(self.logs.mean)  # out of bounds: counted as the mean so far, in both
            self.total += self.total / (self.n - 1)
            return math.exp(b)
        self.total += x
        self._first.append(lx)
        if len(self._first) == MIN_SAMPLES:
            kept = _robust(self._first, self.z)
            for v in kept:
                self.logs.add(v)
            self.total += sum(math.exp(k) - math.exp(v) for k, v in zip(kept, self._first))
            self._first = None
        return x


def _within(w: Welford, x: float, z: float) -> float:
    """``x`` within ``z`` sd (at least ``HINT_SD_FLOOR``) of the mean of ``w`` (2 or more values). Once per
    action issued: the square root only for a value out of bounds."""
    dx = x - w.mean
    var = w.m2 / (w.n - 1)
    if var < HINT_SD_FLOOR * HINT_SD_FLOOR:
        var = HINT_SD_FLOOR * HINT_SD_FLOOR
    if dx * dx <= z * z * var:
        return x
    d = z * math.sqrt(var)
    return w.mean + d if dx > 0 else w.mean - d


class Estimator:
    """Expected work (seconds on units_min) of an action, from its hint and history."""

    def __init__(self, default_s: float = 1.0, from_hints: bool = True, hint_bound: float = 0.0):
        self.default_s = default_s
        self.from_hints = from_hints
        self.hint_bound = hint_bound
        self.kinds: dict[str, KindStats] = {}
        #: per kind, the hints counted out of bounds: (how many, the last one given (s), what it counted as (s))
        self.bounded: dict[str, tuple[int, float, float]] = {}
        #: (tag, its estimate now) for each of a kind's first hints found out of bounds when its 8th came: the
        #: caller (the policy) takes them out after each ``issue`` and puts the new estimate where it counted
        #: the old one
        self.rebounded: list[tuple[object, float]] = []

    def error_sd(self, spec: ActionSpec) -> float:
        """The sd (log) of its kind's hint errors once 8 were measured; at least ``HINT_SD_FLOOR``."""
        ks = self.kinds.get(spec.kind)
        w = ks.error if ks is not None else None
        if w is None or w.n < MIN_SAMPLES or w.m2 <= 0.0:
            return HINT_SD_FLOOR
        sd = math.sqrt(w.m2 / (w.n - 1))
        return sd if sd > HINT_SD_FLOOR else HINT_SD_FLOOR

    def _note(self, kind: str, log_h: float, counted: float) -> None:
        n = self.bounded.get(kind, (0,))[0]
        self.bounded[kind] = (n + 1, math.exp(log_h), math.exp(counted))

    def _bounded(self, ks: KindStats | None, log_h: float) -> float:
        """``hint_bound``: the hint's log within ``hint_bound`` sd (at least ``HINT_SD_FLOOR``) of the mean of its
        kind's hints, once it has ``MIN_SAMPLES``. One absurd hint (a unit slip: 1e9 s for a 12 s test run) is
        bad input: unbounded, it set its kind's spread and every figure the gate learns (the mean action, the
        demand per trajectory) for the rest of the run, and on the tight file one such hint made the step 1.21x
        the same run's without it. Lognormal hints never reach 6 sd by chance in a run. A kind's first hints
        are bounded together once there are ``MIN_SAMPLES`` (``_add_first``); other kinds say nothing of its
        scale (bounded by them, a kind 1e260 times shorter than the first one seen was read 1e260 times too
        long, and its estimate overflowed)."""
        w = ks.hints if ks is not None else None
        if w is None or w.n < MIN_SAMPLES:
            return log_h
        return _within(w, log_h, self.hint_bound)

    def issued(self, spec: ActionSpec) -> None:
        """An action was issued: its hint (all of them, long ones included, unlike what finished)."""
        self._record_hint(spec)

    def issue(self, spec: ActionSpec, tag: object = None) -> float:
        """``issued(spec)`` then ``expected(spec)``, in one call (one lookup, one log of the hint): the
        policy does both for every action it is given. ``tag``: what :attr:`rebounded` names it by."""
        ks, log_h = self._record_hint(spec, tag)
        h = spec.hint_s
        if ks is None or ks.work.n < MIN_SAMPLES:
            if log_h is not None and self.hint_bound:
                return math.exp(log_h)
            return h if h else self.default_s
        return self._posterior(ks, h, log_h)

    def _record_hint(self, spec: ActionSpec, tag: object = None) -> tuple[KindStats | None, float | None]:
        """Record the hint's log (if it has one and hints are used): the kind's stats, and that log."""
        h = spec.hint_s
        ks = self.kinds.get(spec.kind)
        if not h or h <= 0 or not self.from_hints:
            return ks, None
        if ks is None:
            ks = self.kinds[spec.kind] = KindStats(Welford(), Welford())
        if ks.hints is None:
            ks.hints = Welford()
        log_h = math.log(h)
        if not self.hint_bound:
            ks.hints.add(log_h)
        elif ks.hints.n >= MIN_SAMPLES:
            b = _within(ks.hints, log_h, self.hint_bound)
            if b == log_h:
                ks.hints.add(log_h)
            else:  # an absurd one moves neither mean nor spread
                ks.hints.add(ks.hints.mean)
                self._note(spec.kind, log_h, b)
                log_h = b
        else:  # one of its first: as given for its own estimate; its kind's figures bound them together at 8
            out: list[tuple[int, float, float]] = []
            ks.first_tags = [tag] if ks.first_tags is None else ks.first_tags + [tag]
            ks.first_hints = _add_first(ks.hints, ks.first_hints, log_h, self.hint_bound, out)
            if ks.first_hints is None:
                tags, ks.first_tags = ks.first_tags, None
                for i, v, k in out:
                    self._note(spec.kind, v, k)
                    if i < len(tags) - 1 and tags[i] is not None:  # (not this one: its estimate reads the bound)
                        e = math.exp(k) if ks.work.n < MIN_SAMPLES else self._posterior(ks, math.exp(k), k)
                        self.rebounded.append((tags[i], e))
                log_h = _within(ks.hints, log_h, self.hint_bound)
        return ks, log_h

    def hint_in_tail(self, spec: ActionSpec, z: float) -> bool:
        """The hint's log is more than ``z`` sd above the mean of its kind's hints (8 or more recorded)."""
        h = spec.hint_s
        ks = self.kinds.get(spec.kind)
        w = ks.hints if ks is not None else None
        if not h or w is None or w.n < MIN_SAMPLES:
            return False
        return math.log(h) > w.mean + z * math.sqrt(w.m2 / (w.n - 1))  # w.var, inlined

    def expected(self, spec: ActionSpec) -> float:
        ks = self.kinds.get(spec.kind)
        h = spec.hint_s
        log_h = self._bounded(ks, math.log(h)) if h and h > 0 and self.hint_bound and self.from_hints else None
        if ks is None or ks.work.n < MIN_SAMPLES:
            if log_h is not None:
                return math.exp(log_h)
            return h if h else self.default_s
        return self._posterior(ks, h, log_h)

    def _posterior(self, ks: KindStats, h: float | None, log_h: float | None) -> float:
        """The posterior mean of the work, ``h`` the hint (``log_h`` its log, if known)."""
        c = ks.est_cache
        if c is None:  # what finished changes only when an action finishes: cached until then
            var_e = ks.error.var if ks.error.n >= MIN_SAMPLES else math.inf
            var_e = 1e-6 if 1e-6 > var_e else var_e  # max(var_e, 1e-6), as below, without the call
            var_w = ks.work.var
            c = ks.est_cache = (ks.work.mean, 1e-6 if 1e-6 > var_w else var_w, ks.error.mean, var_e)
        mu, var_w, bias, var_e = c
        hs = ks.hints
        if hs is not None and hs.n >= MIN_SAMPLES and var_e != math.inf:
            # The first actions to finish are the short ones, so what finished says too little of
            # the kind's long tail for a while (15 finished run_tests at t = 9 s: spread 0.97 in
            # log, the kind's is 2.25), and a long action's hint is shrunk to a short estimate.
            # The hints of every issued action say it at once: log hint = log work + error, so
            # the work's variance is at least the hints' less the error's. (Taking the mean from
            # the hints too measured worse: the error's mean is learned from the short ones.)
            # Every issued hint moves it: read here, not cached.
            v = hs.m2 / (hs.n - 1) - var_e
            var_w = var_w if var_w > v else v  # max(v, var_w), without the call
        if not h or var_e == math.inf:
            x = mu + var_w / 2
            return math.exp(x if x < LOG_MOST else LOG_MOST)
        wh = 1.0 / var_e
        ww = 1.0 / var_w
        post_var = 1.0 / (wh + ww)
        post_mu = (mu * ww + ((math.log(h) if log_h is None else log_h) - bias) * wh) * post_var
        x = post_mu + post_var / 2
        return math.exp(x if x < LOG_MOST else LOG_MOST)

    def observe(self, spec: ActionSpec, work_s: float) -> None:
        """An action finished; ``work_s`` is its run time normalised to units_min."""
        if work_s <= 0:
            return
        ks = self.kinds.get(spec.kind)
        if ks is None:
            ks = self.kinds[spec.kind] = KindStats(Welford(), Welford())
        lw = math.log(work_s)
        ks.work.add(lw)
        h = spec.hint_s
        if h and h > 0:
            log_h = math.log(h)
            z = self.hint_bound if self.from_hints else 0.0
            if not z:
                ks.error.add(log_h - lw)
            elif self._bounded(ks, log_h) == log_h:  # (a hint out of bounds says nothing of the hints' error)
                e = log_h - lw
                if ks.error.n >= MIN_SAMPLES:
                    ks.error.add(e if _within(ks.error, e, z) == e else ks.error.mean)
                else:
                    ks.first_errors = _add_first(ks.error, ks.first_errors, e, z)
        ks.est_cache = None
