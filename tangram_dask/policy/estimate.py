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


@dataclass(slots=True)
class KindStats:
    work: Welford   # log of the true work on units_min
    error: Welford  # log(hint) - log(true work)
    est_cache: tuple[float, float, float, float] | None = None  # (mu, var_w, bias, var_e)


class Estimator:
    """Expected work (seconds on units_min) of an action, from its hint and history."""

    def __init__(self, default_s: float = 1.0):
        self.default_s = default_s
        self.kinds: dict[str, KindStats] = {}

    def expected(self, spec: ActionSpec) -> float:
        ks = self.kinds.get(spec.kind)
        h = spec.hint_s
        if ks is None or ks.work.n < MIN_SAMPLES:
            return h if h else self.default_s
        c = ks.est_cache
        if c is None:
            var_w = max(ks.work.var, 1e-6)
            var_e = max(ks.error.var, 1e-6) if ks.error.n >= MIN_SAMPLES else math.inf
            c = ks.est_cache = (ks.work.mean, var_w, ks.error.mean, var_e)
        mu, var_w, bias, var_e = c
        if not h or var_e == math.inf:
            return math.exp(mu + var_w / 2)
        wh = 1.0 / var_e
        ww = 1.0 / var_w
        post_var = 1.0 / (wh + ww)
        post_mu = (mu * ww + (math.log(h) - bias) * wh) * post_var
        return math.exp(post_mu + post_var / 2)

    def observe(self, spec: ActionSpec, work_s: float) -> None:
        """An action finished; ``work_s`` is its run time normalised to units_min."""
        if work_s <= 0:
            return
        ks = self.kinds.get(spec.kind)
        if ks is None:
            ks = self.kinds[spec.kind] = KindStats(Welford(), Welford())
        lw = math.log(work_s)
        ks.work.add(lw)
        if spec.hint_s:
            ks.error.add(math.log(spec.hint_s) - lw)
        ks.est_cache = None
