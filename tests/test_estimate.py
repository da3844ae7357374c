"""What the policy knows of durations (``tangram_dask/policy/estimate.py``), as tables of named cases.

Every expected number is worked out by hand in the case's comment. Notation:
``w`` = log of an observed work, ``e`` = log(hint) - w (the hint's log error);
with 8 or more observations of a kind, ``mu``/``var_w`` are the mean and
sample variance of ``w`` (variance floored at 1e-6), ``bias``/``var_e`` those
of ``e`` (used only once 8 observations had a hint), and the estimate for a
hint ``h`` is ``exp(post_mu + post_var / 2)`` with
``post_var = 1 / (1/var_w + 1/var_e)`` and
``post_mu = (mu/var_w + (log h - bias)/var_e) * post_var``.
"""

from __future__ import annotations

import math

import pytest

from conftest import standard_on_tight
from tangram_dask.policy.estimate import MIN_SAMPLES, Estimator, Welford
from tangram_dask.spec import make_spec

E = math.e


# -- Welford ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("xs, n, mean, var", [
    pytest.param([], 0, 0.0, 0.0, id="empty"),
    pytest.param([5.0], 1, 5.0, 0.0, id="one-sample-no-variance"),
    # mean 2.5; squares of deviations 2.25 + 0.25 + 0.25 + 2.25 = 5 over n - 1 = 3
    pytest.param([1.0, 2.0, 3.0, 4.0], 4, 2.5, 5 / 3, id="sample-variance"),
    # mean 5; deviations -3 -1 -1 -1 0 0 2 4: squares sum 32, over 7
    pytest.param([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0], 8, 5.0, 32 / 7, id="textbook"),
    # large offset: mean 1e9 + 10, deviations -6 -3 3 6: squares 90 over 3 = 30 (no cancellation)
    pytest.param([1e9 + 4, 1e9 + 7, 1e9 + 13, 1e9 + 16], 4, 1e9 + 10, 30.0, id="large-offset-stable"),
    pytest.param([-1.0, 1.0], 2, 0.0, 2.0, id="symmetric"),
])
def test_welford(xs, n, mean, var):
    w = Welford()
    for x in xs:
        w.add(x)
    assert (w.n, w.mean, w.var) == (n, pytest.approx(mean, rel=1e-12, abs=1e-12), pytest.approx(var, rel=1e-9))


# -- Estimator -------------------------------------------------------------------------------------
def observe_all(est: Estimator, kind: str, obs: list[tuple[float, float | None]]) -> None:
    """Each observation: (log work w, log hint or None)."""
    for w, lh in obs:
        est.observe(make_spec(kind, hint_s=None if lh is None else math.exp(lh)), math.exp(w))


ALT = [0.0, 2.0] * 4  # w: four 0s and four 2s: mu = 1, var_w = 8 x 1 / 7 = 8/7

ESTIMATE_CASES = [
    # -- before 8 completions of the kind the hint is used as is
    pytest.param({}, [], 3.0, 3.0, id="no-history-hint"),
    pytest.param({}, [], None, 1.0, id="no-history-no-hint-default"),
    pytest.param({"default_s": 2.5}, [], None, 2.5, id="no-history-custom-default"),
    # hint 0 is treated like no hint (the default), not as "instant": spec.hint_s 0 is valid
    pytest.param({}, [], 0.0, 1.0, id="no-history-zero-hint-is-default"),
    # 7 exact observations of 100 s: still below MIN_SAMPLES (8): the hint 3 is used
    pytest.param({}, [(math.log(100), math.log(100))] * 7, 3.0, 3.0, id="seven-samples-still-hint"),
    # -- 8+ observations, none with a hint: the kind's lognormal mean, hints ignored
    # w = 0,2,... : exp(mu + var_w / 2) = exp(1 + 4/7) = e^(11/7)
    pytest.param({}, [(w, None) for w in ALT], None, E ** (11 / 7), id="history-no-hint"),
    pytest.param({}, [(w, None) for w in ALT], 50.0, E ** (11 / 7), id="history-hint-errors-unknown"),
    # all 8 works = 2 s: var_w floored at 1e-6: exp(log 2 + 5e-7)
    pytest.param({}, [(math.log(2), None)] * 8, None, 2 * math.exp(5e-7), id="history-constant-floored"),
    # -- sharp, unbiased hints: var_e = 1e-6 (floor), var_w = 8/7: the estimate is the hint
    # post_var = 1/(1e6 + 7/8); post_mu = (7/8 + 3e6) post_var = 3 - 2 (7/8) post_var; ~ e^3 (rel 2e-6)
    pytest.param({}, [(w, w) for w in ALT], E ** 3, E ** 3, id="sharp-hints-follow-the-hint"),
    # -- sharp hints, always 2x the work: bias = log 2: a hint of 10 means 5
    pytest.param({}, [(w, w + math.log(2)) for w in ALT], 10.0, 5.0, id="biased-hints-corrected"),
    # -- noisy unbiased hints (e = +1, -1, ...: bias 0, var_e 8/7) on constant work 1 s (var_w 1e-6):
    # post_mu = (0 x 1e6 + 5 x 7/8) / (1e6 + 7/8) ~ 4.4e-6: ~ 1 s whatever the hint says
    pytest.param({}, [(0.0, 1.0), (0.0, -1.0)] * 4, E ** 5, 1.0, id="noisy-hints-lean-on-history"),
    # -- equal weights: w = 0,2,.. (var_w 8/7) and e = +1,-1,.. (bias 0, var_e 8/7):
    # post_var = 4/7, post_mu = (1 + 3) / 2 = 2 for a hint e^3: exp(2 + 2/7) = e^(16/7)
    pytest.param({}, [(w, w + (1.0 if i % 2 == 0 else -1.0)) for i, w in enumerate(ALT)], E ** 3, E ** (16 / 7),
                 id="blend-equal-precision"),
    # the same history, no hint for the pending action: exp(mu + var_w/2) = e^(11/7)
    pytest.param({}, [(w, w + (1.0 if i % 2 == 0 else -1.0)) for i, w in enumerate(ALT)], None, E ** (11 / 7),
                 id="blend-history-no-hint"),
    # 8 works but only 7 had a hint: var_e unknown (7 < 8): the hint is ignored -> exp(log 2 + 5e-7)
    pytest.param({}, [(math.log(2), math.log(2))] * 7 + [(math.log(2), None)], 40.0, 2 * math.exp(5e-7),
                 id="seven-hinted-errors-not-used"),
]


@pytest.mark.parametrize("kw, obs, hint, want", ESTIMATE_CASES)
def test_expected(kw, obs, hint, want):
    est = Estimator(**kw)
    observe_all(est, "k", obs)
    assert est.expected(make_spec("k", hint_s=hint)) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("work", [
    pytest.param(0.0, id="zero"),
    pytest.param(-1.0, id="negative"),
])
def test_non_positive_work_is_ignored(work):
    est = Estimator()
    est.observe(make_spec("k", hint_s=1.0), work)
    assert "k" not in est.kinds


def test_kinds_are_separate_and_cache_follows_new_observations():
    est = Estimator()
    observe_all(est, "a", [(math.log(2), None)] * MIN_SAMPLES)
    # kind b has no history: its hint is used as is, a's history does not leak into it
    assert est.expected(make_spec("b", hint_s=7.0)) == 7.0
    assert est.expected(make_spec("a")) == pytest.approx(2.0, rel=1e-5)
    # 8 more observations of 8 s: w = log 2 (x8), 3 log 2 (x8): mu = 2 log 2 = log 4; every deviation is
    # +-log 2: var_w = 16 (log 2)^2 / 15
    observe_all(est, "a", [(math.log(8), None)] * MIN_SAMPLES)
    var_w = 16 * math.log(2) ** 2 / 15
    assert est.expected(make_spec("a")) == pytest.approx(math.exp(math.log(4) + var_w / 2), rel=1e-9)


def test_issue_is_issued_then_expected():
    """``issue`` (the policy's one call per action) records the hint and estimates exactly as the two calls do."""
    import random

    rng = random.Random(5)
    one, two = Estimator(), Estimator()
    for i in range(300):
        kind = "ab"[i % 2]
        hint = rng.choice([None, 0.0, rng.lognormvariate(0, 1.5)])
        s = make_spec(kind, hint_s=hint)
        two.issued(s)
        assert one.issue(s) == two.expected(s)
        if i % 3 == 0:
            work = rng.lognormvariate(0.5, 1.0)
            one.observe(s, work)
            two.observe(s, work)


# -- a hint's place among its kind's hints (``elephant_hint``) ----------------------------------------
# Eight hints e^0, e^0, e^1, e^1, e^2, e^2, e^3, e^3 of kind "t": their logs have mean 1.5 and sample
# variance (4 x 2.25 + 4 x 0.25) / 7 = 10/7 (sd 1.195); z = 2 puts the tail above log h = 3.890.
@pytest.mark.parametrize("issued, hint, kind, want", [
    pytest.param(8, E ** 4.0, "t", True, id="4.0-above-3.89"),
    pytest.param(8, E ** 3.8, "t", False, id="3.8-below-3.89"),
    pytest.param(7, E ** 10.0, "t", False, id="fewer-than-8-hints"),
    pytest.param(8, E ** 10.0, "other", False, id="another-kind-has-none"),
    pytest.param(8, None, "t", False, id="no-hint"),
])
def test_hint_in_tail(issued, hint, kind, want):
    est = Estimator()
    for x in [0, 0, 1, 1, 2, 2, 3, 3][:issued]:
        est.issued(make_spec("t", hint_s=E ** x))
    assert est.hint_in_tail(make_spec(kind, hint_s=hint), 2.0) is want


# -- an absurd hint is bounded (bad input; session 33) --------------------------------------------------------
def _hinted(est, hints, kind="t"):
    for h in hints:
        est.issue(make_spec(kind, "cpu", 1, hint_s=h))


@pytest.mark.parametrize("bound, hint, want", [
    # 8 hints of e^2 and e^4 alternately: log mean 3, sample sd sqrt(8 / 7) = 1.069 (over the 1.0 floor); nothing
    # finished, so the estimate is the (bounded) hint itself
    pytest.param(6.0, 1e9, math.exp(3 + 6 * math.sqrt(8 / 7)), id="absurd-high-clipped-at-6-sd"),
    pytest.param(6.0, 1e-9, math.exp(3 - 6 * math.sqrt(8 / 7)), id="absurd-low-clipped-at-6-sd"),
    pytest.param(6.0, E ** 8, E ** 8, id="5-sd-kept"),
    pytest.param(0.0, 1e9, 1e9, id="bound-off"),
])
def test_an_absurd_hint_counts_at_most_bound_sd_from_its_kinds(bound, hint, want):
    est = Estimator(hint_bound=bound)
    _hinted(est, [E ** 2, E ** 4] * 4)
    got = est.issue(make_spec("t", "cpu", 1, hint_s=hint))
    assert got == pytest.approx(want, rel=1e-9)
    # and what the kind's spread learned is the bounded hint, not the absurd one
    hs = est.kinds["t"].hints
    assert hs.n == 9 and (bound == 0 or max(abs(hs.mean), hs.m2) < 100)


def test_the_bound_has_a_spread_floor_and_leaves_a_kinds_first_hints_alone():
    est = Estimator(hint_bound=6.0)
    _hinted(est, [10.0] * 8, kind="a")  # all alike: spread 0, floored at 1 (log)
    assert est.issue(make_spec("a", "cpu", 1, hint_s=1e6)) == pytest.approx(10.0 * E ** 6)
    est = Estimator(hint_bound=6.0)
    _hinted(est, [10.0] * 8, kind="a")
    assert est.issue(make_spec("a", "cpu", 1, hint_s=300.0)) == pytest.approx(300.0)  # a 30x hint is kept
    # another kind's first hints are its own: 1e-200 s is not read as "a" (other kinds say nothing of its scale)
    assert est.issue(make_spec("b", "cpu", 1, hint_s=1e-200)) == pytest.approx(1e-200)


def test_an_estimate_never_overflows():
    """Hints spread over 1e-300 .. 1e9 s (a kind's first ones are not bounded), hints that were exact for what
    finished: the hints' spread less the errors' makes the work's variance about 1e5 (in log), and an action without
    a hint was estimated exp(1e5 / 2): OverflowError inside the policy. An estimate is at most 1e9 s."""
    est = Estimator()
    for i in range(12):
        est.issue(make_spec("k", "cpu", 1, hint_s=1e-300 if i % 2 else 1e9))
    for _ in range(8):
        est.observe(make_spec("k", "cpu", 1, hint_s=1.0), 1.0)  # exact hints: the error's spread is 0
    assert est.expected(make_spec("k", "cpu", 1)) == pytest.approx(1e9)
    assert 0 < est.issue(make_spec("k", "cpu", 1, hint_s=5.0)) <= 1e9


def _absurd_hint_runs(kind: str, nth: int, hint: float, **opts) -> float:
    """The standard workload's 128 trajectories on the tight cluster, simulated with and without one absurd hint
    on the ``nth`` action of ``kind`` to be issued (its true duration unchanged): the step with it over the step
    without, both under the options ``opts``."""

    import numpy as np

    from tangram_dask.bench import simulate
    from tangram_dask.policy import TangramOptions, make_policy
    from tangram_dask.sim import Simulator
    from tangram_dask.workload import generate

    wl, cl = standard_on_tight()
    options = TangramOptions(**opts)
    gen = generate(wl)
    res = Simulator(gen, cl, make_policy("tangram", cl, wl, options=options)).run()
    kinds = [k.kind for k in wl.kinds]
    of_kind = [i for i in range(gen.n_actions) if kinds[gen.kind[i]] == kind]
    aid = of_kind[int(np.argsort(res.issue[of_kind], kind="stable")[nth])]
    base = simulate(gen, cl, "tangram", options=options)["step_s"]
    gen.hint[aid] = hint
    return simulate(gen, cl, "tangram", options=options)["step_s"] / base


@pytest.mark.parametrize("kind, nth", [("run_tests", 30), ("run_tests", 0), ("web_search", 0), ("code_exec", 3)])
def test_one_absurd_hint_does_not_slow_the_step_of_the_others(kind, nth):
    """One action's hint set to 1e9 s (its true duration unchanged), late in its kind (the 31st test run issued,
    which hint_bound bounds) or among the first of its kind (which only its run replacing its estimate,
    turn_runs, undoes): the step of the others within 2% of the same run's without it. With neither (as before
    session 33) it was 1.10-1.42x."""
    unprotected = _absurd_hint_runs(kind, nth, 1e9, hint_bound=0.0, turn_runs=0.0)
    ratio = _absurd_hint_runs(kind, nth, 1e9)
    print(f"{kind} #{nth} hinted 1e9 s: step / step without it: {unprotected:.3f} unprotected, {ratio:.3f} now")
    assert unprotected > 1.05  # the harm is there without the two
    assert abs(ratio - 1.0) < 0.02


def test_a_bounded_mean_keeps_an_absurd_value_out_of_its_mean():
    from tangram_dask.policy.estimate import BoundedMean

    for where in (0, 3, 20):  # among the first 8 (bounded together at 8) or later (bounded as it comes)
        m, plain = BoundedMean(6.0), BoundedMean(0.0)
        for i in range(40):
            x = 1e9 if i == where else 100.0 * E ** ((i % 5) - 2) / 10
            m.add(x)
            plain.add(x)
        print(where, m.mean, plain.mean)
        assert m.n == plain.n == 40 and 20.0 < m.mean < 30.0 < 1e6 < plain.mean  # the others average 23.2


def test_a_kinds_first_eight_hints_are_bounded_together():
    """The first of a kind's hints is 1e9 s (a slip), the next seven about 10 s: when the 8th comes they are bounded
    together, and the kind's hint figures read as if the slip were the median (before, it set their mean and
    spread for good: a later 12 s hint was estimated far off)."""
    est = Estimator(hint_bound=6.0)
    for i in range(8):
        est.issue(make_spec("k", "cpu", 1, hint_s=1e9 if i == 0 else 10.0 * E ** ((i % 3) - 1) / 2))
    hs = est.kinds["k"].hints
    print("hints after the 8th:", hs, est.bounded)
    assert abs(hs.mean - math.log(5.0)) < 1.0 and hs.var < 1.0 and est.bounded["k"][0] == 1
