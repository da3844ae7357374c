"""Action specs: a wrong spec raises SpecError at the call, naming the field and the value."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tangram_dask
from tangram_dask import ActionSpec, SpecError, TangramError, make_spec
from tangram_dask.errors import _show
from tangram_dask.spec import RESERVED, SPEC_KEYWORDS, UNITS_LIMIT, amdahl

HUGE = 10**400  # float(HUGE) overflows

# (id, kwargs for make_spec, field named, value named)
BAD_SPECS = [
    ("units-zero", dict(kind="k", units=0), "units.min", 0),
    ("units-min-zero-in-pair", dict(kind="k", units=(0, 4)), "units.min", 0),
    ("units-max-below-min", dict(kind="k", units=(4, 2)), "units.max", 2),
    ("units-not-whole", dict(kind="k", units=(1, 2.5)), "units.max", 2.5),
    ("units-bool", dict(kind="k", units=True), "units", True),
    ("units-triple", dict(kind="k", units=(1, 2, 3)), "units", (1, 2, 3)),
    ("unknown-resource", dict(kind="k", resource="tpu"), "resource", "tpu"),
    ("empty-kind", dict(kind=""), "kind", ""),
    ("gpu-without-model", dict(kind="judge", resource="gpu"), "model", None),
    ("model-on-cpu-action", dict(kind="k", resource="cpu", model="rm"), "model", "rm"),
    ("negative-hint", dict(kind="k", hint_s=-1.0), "hint_s", -1.0),
    # begin_trajectory / end_trajectory refuse "", so its state could only go with the TTL (session 31)
    ("empty-trajectory", dict(kind="k", trajectory=""), "trajectory", ""),
    ("infinite-hint", dict(kind="k", hint_s=math.inf), "hint_s", math.inf),
    ("string-hint", dict(kind="k", hint_s="3s"), "hint_s", "3s"),
    ("parallel-fraction-above-one", dict(kind="k", units=(1, 4), speedup=1.5), "speedup.parallel_fraction", 1.5),
    ("parallel-fraction-negative", dict(kind="k", units=(1, 4), speedup=-0.1), "speedup.parallel_fraction", -0.1),
    ("zero-timeout", dict(kind="k", timeout_s=0), "timeout_s", 0),
    ("negative-restore", dict(kind="k", restore_s=-2.0), "restore_s", -2.0),
    ("affinity-without-trajectory", dict(kind="k", affinity="trajectory"), "trajectory", None),
    ("unknown-affinity", dict(kind="k", trajectory="t1", affinity="node"), "affinity", "node"),
    ("trajectory-not-a-string", dict(kind="k", trajectory=17), "trajectory", 17),
    # every field, every kind of wrong value: huge ints, nan, inf, strings, bools, None, nested types
    ("hint-huge-int", dict(kind="k", hint_s=HUGE), "hint_s", HUGE),
    ("hint-nan", dict(kind="k", hint_s=math.nan), "hint_s", math.nan),
    # finite, but it overflowed the admission gate's sums to infinity and shut the gate (session 31)
    ("hint-past-the-seconds-limit", dict(kind="k", hint_s=1e308), "hint_s", 1e308),
    ("timeout-past-the-seconds-limit", dict(kind="k", timeout_s=2e9), "timeout_s", 2e9),
    ("hint-bool", dict(kind="k", hint_s=True), "hint_s", True),
    ("hint-list", dict(kind="k", hint_s=[1.0]), "hint_s", [1.0]),
    ("hint-complex", dict(kind="k", hint_s=1j), "hint_s", 1j),
    ("timeout-huge-int", dict(kind="k", timeout_s=HUGE), "timeout_s", HUGE),
    ("timeout-minus-inf", dict(kind="k", timeout_s=-math.inf), "timeout_s", -math.inf),
    ("timeout-string", dict(kind="k", timeout_s="60"), "timeout_s", "60"),
    ("timeout-bool", dict(kind="k", timeout_s=False), "timeout_s", False),
    ("restore-huge-int", dict(kind="k", restore_s=HUGE), "restore_s", HUGE),
    ("restore-none", dict(kind="k", restore_s=None), "restore_s", None),
    ("restore-inf", dict(kind="k", restore_s=math.inf), "restore_s", math.inf),
    ("speedup-huge-int", dict(kind="k", units=(1, 2), speedup=HUGE), "speedup.parallel_fraction", HUGE),
    ("speedup-none", dict(kind="k", speedup=None), "speedup.parallel_fraction", None),
    ("speedup-string", dict(kind="k", speedup="0.5"), "speedup.parallel_fraction", "0.5"),
    ("speedup-bool", dict(kind="k", speedup=True), "speedup.parallel_fraction", True),
    ("speedup-inf", dict(kind="k", speedup=math.inf), "speedup.parallel_fraction", math.inf),
    ("units-huge-int", dict(kind="k", units=HUGE), "units.min", HUGE),
    ("units-above-limit", dict(kind="k", units=(1, UNITS_LIMIT + 1)), "units.max", UNITS_LIMIT + 1),
    ("units-negative", dict(kind="k", units=-3), "units.min", -3),
    ("units-float-whole", dict(kind="k", units=2.0), "units", 2.0),
    ("units-string", dict(kind="k", units="2"), "units", "2"),
    ("units-none", dict(kind="k", units=None), "units", None),
    ("units-dict", dict(kind="k", units={"min": 1, "max": 2}), "units", {"min": 1, "max": 2}),
    ("units-nested-pair", dict(kind="k", units=((1,), (2,))), "units.min", (1,)),
    ("units-bool-in-pair", dict(kind="k", units=(1, True)), "units.max", True),
    ("units-numpy-float", dict(kind="k", units=np.float64(2.0)), "units", 2.0),
    ("units-numpy-zero", dict(kind="k", units=(np.int64(0), 2)), "units.min", 0),
    ("kind-none", dict(kind=None), "kind", None),
    ("kind-int", dict(kind=5), "kind", 5),
    ("kind-bytes", dict(kind=b"k"), "kind", b"k"),
    ("resource-none", dict(kind="k", resource=None), "resource", None),
    ("resource-list", dict(kind="k", resource=["cpu"]), "resource", ["cpu"]),
    ("resource-upper-case", dict(kind="k", resource="CPU"), "resource", "CPU"),
    ("model-empty-on-gpu", dict(kind="k", resource="gpu", model=""), "model", ""),
    ("model-int-on-gpu", dict(kind="k", resource="gpu", model=7), "model", 7),
    ("model-on-api-action", dict(kind="k", resource="api", model="rm"), "model", "rm"),
    ("trajectory-list", dict(kind="k", trajectory=["t"]), "trajectory", ["t"]),
    ("affinity-int", dict(kind="k", trajectory="t", affinity=1), "affinity", 1),
    ("affinity-list", dict(kind="k", trajectory="t", affinity=["trajectory"]), "affinity", ["trajectory"]),
    ("grant-is-reserved", dict(kind="k", grant={"units": 1}), "grant", {"units": 1}),
    ("unknown-keyword", dict(kind="k", colour="red"), "colour", "red"),
]


@pytest.mark.parametrize("kwargs, field, value", [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_raises_naming_field_and_value(kwargs, field, value):
    with pytest.raises(SpecError) as info:
        make_spec(**kwargs)
    e = info.value
    assert e.field == field
    assert e.value == value or (isinstance(value, float) and math.isnan(value))
    assert repr(field) in str(e)
    assert _show(value) in str(e)
    assert isinstance(e, ValueError) and isinstance(e, TangramError)


def test_a_huge_value_is_shown_shortened_and_never_breaks_the_message():
    with pytest.raises(SpecError) as info:
        make_spec("k", hint_s=10**5000)  # repr() itself raises past Python's 4300-digit limit
    assert info.value.field == "hint_s"
    assert "<int of 16610 bits>" in str(info.value)
    with pytest.raises(SpecError) as info:
        make_spec("k", hint_s=HUGE)
    assert str(info.value).startswith("action spec field 'hint_s' = 1000") and "(401 chars)" in str(info.value)


def test_parallel_fraction_nan_is_rejected():
    with pytest.raises(SpecError) as info:
        make_spec("k", units=(1, 2), speedup=math.nan)
    assert info.value.field == "speedup.parallel_fraction"
    assert "nan" in str(info.value)


BAD_DICTS = [
    ("unknown-field", {"kind": "k", "resource": "cpu", "colour": "red"}, "colour", "red"),
    ("unknown-field-named-first-sorted", {"kind": "k", "resource": "cpu", "zz": 1, "aa": 2}, "aa", 2),
    ("not-a-mapping", ["kind", "k"], "tangram", ["kind", "k"]),
    ("bad-value-through-dict", {"kind": "k", "resource": "cpu", "units_min": 0}, "units.min", 0),
    ("mixed-type-keys", {"kind": "k", "resource": "cpu", 1: "one", None: "none", "zz": 2}, "zz", 2),
    ("int-key-only", {"kind": "k", "resource": "cpu", 1: "one"}, "1", "one"),
    ("tuple-key", {"kind": "k", "resource": "cpu", ("a", 1): 0}, "('a', 1)", 0),
    ("grant-written-by-the-user", {"kind": "k", "resource": "cpu", "grant": {"units": 4}}, "grant", {"units": 4}),
    ("grant-named-before-unknown-keys", {"kind": "k", "resource": "cpu", "aa": 1, "grant": 0}, "grant", 0),
    ("missing-kind", {"resource": "cpu"}, "kind", None),
    ("missing-resource", {"kind": "k"}, "resource", None),
    ("empty", {}, "kind", None),
    ("huge-hint", {"kind": "k", "resource": "cpu", "hint_s": HUGE}, "hint_s", HUGE),
    ("nan-units", {"kind": "k", "resource": "cpu", "units_min": math.inf}, "units.min", math.inf),
    ("not-a-mapping-none", None, "tangram", None),
]


@pytest.mark.parametrize("d, field, value", [c[1:] for c in BAD_DICTS], ids=[c[0] for c in BAD_DICTS])
def test_from_dict_rejects_bad_annotations(d, field, value):
    with pytest.raises(SpecError) as info:
        ActionSpec.from_dict(d)
    assert info.value.field == field
    assert info.value.value == value
    assert repr(field) in str(info.value)


def test_grant_is_reserved_and_the_message_says_so():
    assert set(RESERVED) == {"grant"}
    with pytest.raises(SpecError, match="reserved: the tangram scheduler writes the grant"):
        ActionSpec.from_dict({"kind": "k", "resource": "cpu", "grant": {}})


# -- numpy numbers are accepted and normalised to Python int / float --------------------------
# (id, make_spec kwargs, the spec's fields expected, exactly)
NUMPY_OK = [
    ("units-int64", dict(kind="k", units=np.int64(2)), dict(units_min=2, units_max=2)),
    ("units-pair-mixed", dict(kind="k", units=(np.int32(1), np.uint8(4))), dict(units_min=1, units_max=4)),
    ("units-list", dict(kind="k", units=[1, np.int16(3)]), dict(units_min=1, units_max=3)),
    ("hint-float64", dict(kind="k", hint_s=np.float64(1.5)), dict(hint_s=1.5)),
    ("hint-int64", dict(kind="k", hint_s=np.int64(3)), dict(hint_s=3.0)),
    ("hint-int", dict(kind="k", hint_s=12), dict(hint_s=12.0)),
    ("timeout-float32", dict(kind="k", timeout_s=np.float32(2.5)), dict(timeout_s=2.5)),
    ("restore-float64", dict(kind="k", restore_s=np.float64(1.0)), dict(restore_s=1.0)),
    ("restore-int64", dict(kind="k", restore_s=np.int64(0)), dict(restore_s=0.0)),
    ("speedup-float16", dict(kind="k", units=(1, 4), speedup=np.float16(0.5)), dict(parallel_fraction=0.5)),
    ("speedup-int-one", dict(kind="k", units=(1, 4), speedup=1), dict(parallel_fraction=1.0)),
    ("kind-numpy-str", dict(kind=np.str_("k2")), dict(kind="k2")),
    ("an-int-at-the-seconds-limit", dict(kind="k", hint_s=10**9), dict(hint_s=1e9)),
]


@pytest.mark.parametrize("kwargs, expected", [c[1:] for c in NUMPY_OK], ids=[c[0] for c in NUMPY_OK])
def test_numpy_numbers_are_accepted_as_python_numbers(kwargs, expected):
    spec = make_spec(**kwargs)
    for name, want in expected.items():
        got = getattr(spec, name)
        assert got == want and type(got) is type(want), f"{name}: {got!r} ({type(got).__name__})"
    d = spec.to_dict()
    assert ActionSpec.from_dict(msgpack.unpackb(msgpack.packb(d))) == spec


def test_numpy_values_in_an_annotation_dict_are_normalised():
    spec = ActionSpec.from_dict({"kind": "k", "resource": "cpu", "units_min": np.int64(1),
                                 "units_max": np.int64(4), "hint_s": np.float64(2.0), "parallel_fraction": 0.5})
    assert [type(x) for x in (spec.units_min, spec.units_max, spec.hint_s)] == [int, int, float]
    assert msgpack.unpackb(msgpack.packb(spec.to_dict())) == spec.to_dict()


def test_a_numpy_array_is_refused_not_compared():
    for kwargs, field in ((dict(resource=np.array(["cpu", "gpu"])), "resource"),
                          (dict(trajectory="t", affinity=np.array(["trajectory"])), "affinity"),
                          (dict(hint_s=np.array([1.0, 2.0])), "hint_s")):
        with pytest.raises(SpecError) as info:
            make_spec("k", **kwargs)
        assert info.value.field == field


# -- any dict either parses or raises SpecError ------------------------------------------------
_FIELDS = list(ActionSpec.__dataclass_fields__)
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**500), max_value=10**500),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.binary(max_size=4),
    st.sampled_from(["cpu", "gpu", "api", "trajectory", "rm", "t-1", ""]),
    st.integers(-3, 10).map(np.int64), st.floats(-1, 2).map(np.float64), st.complex_numbers(max_magnitude=2),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.lists(inner, max_size=3).map(tuple),
                                                         st.dictionaries(st.text(max_size=3), inner, max_size=2)),
                       max_leaves=5)
_keys = st.one_of(st.sampled_from(_FIELDS + ["grant", "units", "speedup"]), st.text(max_size=6), st.integers(),
                  st.none(), st.tuples(st.integers(), st.text(max_size=2)), st.floats(allow_nan=False))
_BASE = {"kind": "k", "resource": "cpu"}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extra=st.dictionaries(_keys, _values, max_size=6), base=st.booleans())
def test_any_dict_parses_or_raises_spec_error(extra, base):
    d = {**_BASE, **extra} if base else extra
    try:
        spec = ActionSpec.from_dict(d)
    except SpecError as e:
        assert isinstance(e.field, str) and str(e).startswith(f"action spec field {e.field!r} = ")
        return
    # what parses is plain Python, packs with msgpack and round-trips
    for name in _FIELDS:
        assert type(getattr(spec, name)) in (int, float, str, type(None)), name
    assert ActionSpec.from_dict(msgpack.unpackb(msgpack.packb(spec.to_dict()))) == spec


_near_valid = st.fixed_dictionaries(
    {"kind": st.sampled_from(["k", "run_tests"]), "resource": st.sampled_from(["cpu", "cpu", "api", "gpu"])},
    optional={
        "units_min": st.one_of(st.integers(1, 4), st.integers(1, 4).map(np.int64), _scalars),
        "units_max": st.one_of(st.integers(4, 8), st.integers(4, 8).map(np.int32), _scalars),
        "parallel_fraction": st.one_of(st.floats(0, 1), st.floats(0, 1).map(np.float32), _scalars),
        "hint_s": st.one_of(st.none(), st.floats(0, 1e6), st.integers(0, 10**6).map(np.int64), _scalars),
        "timeout_s": st.one_of(st.none(), st.floats(0.1, 100), _scalars),
        "restore_s": st.one_of(st.floats(0, 10), st.integers(0, 5).map(np.uint16), _scalars),
        "trajectory": st.one_of(st.none(), st.text(min_size=1, max_size=4), _scalars),
        "affinity": st.one_of(st.none(), st.just("trajectory"), _scalars),
        "model": st.one_of(st.none(), st.just("rm"), _scalars),
    })


@settings(max_examples=400, deadline=None)
@given(d=_near_valid)
def test_near_valid_dicts_parse_to_plain_python_or_raise_spec_error(d):
    try:
        spec = ActionSpec.from_dict(d)
    except SpecError as e:
        assert e.field in _FIELDS or e.field in ("units.min", "units.max", "speedup.parallel_fraction")
        return
    for name in _FIELDS:
        assert type(getattr(spec, name)) in (int, float, str, type(None)), name
    assert spec.units_min == d.get("units_min", 1) and spec.hint_s == d.get("hint_s")
    assert ActionSpec.from_dict(msgpack.unpackb(msgpack.packb(spec.to_dict()))) == spec


@settings(max_examples=200, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(list(SPEC_KEYWORDS) + ["grant", "units", "kind"]), _values, max_size=4),
       units=_values)
def test_any_keywords_to_make_spec_parse_or_raise_spec_error(fields, units):
    fields.pop("units", None)
    fields.pop("kind", None)
    try:
        spec = make_spec("k", "cpu", units, **fields)
    except SpecError:
        return
    assert ActionSpec.from_dict(spec.to_dict()) == spec


def test_unknown_field_message_lists_known_fields():
    with pytest.raises(SpecError, match="known fields are .*units_max"):
        ActionSpec.from_dict({"kind": "k", "resource": "cpu", "colour": "red"})


def test_valid_spec_round_trips_through_the_annotation_dict():
    spec = make_spec("run_tests", "cpu", (1, 8), speedup=0.9, hint_s=12.0, trajectory="t-17",
                     affinity="trajectory", restore_s=3.0, timeout_s=60.0)
    assert (spec.units_min, spec.units_max, spec.parallel_fraction) == (1, 8, 0.9)
    d = spec.to_dict()
    assert "model" not in d  # None fields are left out of the wire form
    assert ActionSpec.from_dict(d) == spec


def test_gpu_spec_keeps_its_model():
    spec = make_spec("judge", "gpu", 2, model="rm-large")
    assert (spec.units_min, spec.units_max, spec.model) == (2, 2, "rm-large")


def test_scale_is_amdahl_relative_to_units_min():
    spec = make_spec("k", units=(2, 8), speedup=0.9)
    assert spec.scale(2) == 1.0
    assert spec.scale(8) == pytest.approx(amdahl(2, 0.9) / amdahl(8, 0.9))
    # S(k) = 1 / ((1 - p) + p / k): S(2) = 1/0.55, S(8) = 1/0.2125
    assert spec.scale(8) == pytest.approx(0.2125 / 0.55)
    # not elastic: no speedup on more units
    assert make_spec("k", units=(1, 4)).scale(4) == 1.0


# -- the Dask side: tangram_dask.action validates before anything is submitted ---------------
class FakeClient:
    def __init__(self):
        self.submitted = []

    def submit(self, fn, *args, **kwargs):
        self.submitted.append((fn, args, kwargs))
        return len(self.submitted)


@pytest.mark.parametrize("kwargs, field, value", [c[1:] for c in BAD_SPECS[:12]], ids=[c[0] for c in BAD_SPECS[:12]])
def test_action_context_raises_before_anything_is_submitted(kwargs, field, value):
    client = FakeClient()
    kwargs = dict(kwargs)
    with pytest.raises(SpecError) as info:
        with tangram_dask.action(**kwargs):
            client.submit(print, "never")
    assert info.value.field == field
    assert client.submitted == []


def test_submit_action_raises_before_client_submit():
    client = FakeClient()
    with pytest.raises(SpecError) as info:
        tangram_dask.submit_action(client, print, "x", kind="judge", resource="gpu", units=1)
    assert info.value.field == "model"
    assert client.submitted == []


# (id, what the caller does) -> SpecError naming 'grant', nothing submitted
def _grant_via_action(client):
    with tangram_dask.action(kind="k", grant={"units": 8}):
        client.submit(print, "never")


def _grant_via_submit_action(client):
    tangram_dask.submit_action(client, print, "x", kind="k", spec_fields={"grant": {"units": 8}})


def _unknown_via_submit_action(client):
    tangram_dask.submit_action(client, print, "x", kind="k", spec_fields={"colour": "red"})


def _non_string_key_via_submit_action(client):
    tangram_dask.submit_action(client, print, "x", kind="k", spec_fields={1: 2})


def _spec_fields_not_a_mapping(client):
    tangram_dask.submit_action(client, print, "x", kind="k", spec_fields=["hint_s", 2])


USER_SIDE = [
    ("action-grant", _grant_via_action, "grant"),
    ("submit-action-grant", _grant_via_submit_action, "grant"),
    ("submit-action-unknown", _unknown_via_submit_action, "colour"),
    ("submit-action-int-key", _non_string_key_via_submit_action, "1"),
    ("submit-action-not-a-mapping", _spec_fields_not_a_mapping, "spec_fields"),
]


@pytest.mark.parametrize("call, field", [c[1:] for c in USER_SIDE], ids=[c[0] for c in USER_SIDE])
def test_user_side_refuses_reserved_and_unknown_fields_before_submitting(call, field):
    client = FakeClient()
    with pytest.raises(SpecError) as info:
        call(client)
    assert info.value.field == field
    assert client.submitted == []


def test_a_grant_in_a_hand_made_annotation_errs_that_task_on_the_scheduler():
    import dask
    from distributed import Client, LocalCluster

    from tangram_dask import PlacementError, TangramSchedulerPlugin

    plugin = TangramSchedulerPlugin("fifo")
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, resources={"slots": 1},
                      dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]}) as cluster, \
            Client(cluster) as client:
        with dask.annotate(tangram={"kind": "k", "resource": "cpu", "grant": {"units": 1, "node": "x"}}):
            forged = client.submit(abs, -1, pure=False)
        with tangram_dask.action(kind="k", resource="cpu"):
            fine = client.submit(abs, -2, pure=False)
        with pytest.raises(PlacementError, match="'grant'.*reserved"):
            forged.result(timeout=30)
        assert fine.result(timeout=30) == 2


def test_action_annotates_the_tasks_submitted_inside():
    import dask

    with tangram_dask.action(kind="run_tests", units=(1, 8), speedup=0.9, hint_s=12, trajectory="t-17") as spec:
        ann = dask.get_annotations()
    assert ann[tangram_dask.ANNOTATION] == spec.to_dict()
    assert ActionSpec.from_dict(ann["tangram"]) == spec
    assert tangram_dask.ANNOTATION not in dask.get_annotations()


def test_instance_copies_every_field():
    """``instance`` (the simulator's per-action copy) writes each field out by hand: a field added to
    ActionSpec and forgotten there would come back unset (AttributeError) or stale. Two specs, a CPU and a
    GPU one, so that between them every field with a default is set away from it (a copy that wrote the
    default would pass otherwise: the GPU spec's model was missing until session 31)."""
    from dataclasses import MISSING, fields

    cpu = make_spec("k", "cpu", units=(2, 4), speedup=0.5, hint_s=2.0, trajectory="a",
                    affinity="trajectory", restore_s=1.5, timeout_s=9.0)
    gpu = make_spec("j", "gpu", units=(1, 2), speedup=0.3, hint_s=2.0, trajectory="a", model="rm", timeout_s=4.0)
    for f in fields(ActionSpec):
        assert f.default is MISSING or any(getattr(b, f.name) != f.default for b in (cpu, gpu)), f.name
    for base in (cpu, gpu):
        copy = base.instance(3.0, "b")
        for f in fields(ActionSpec):
            want = {"hint_s": 3.0, "trajectory": "b"}.get(f.name, getattr(base, f.name))
            assert getattr(copy, f.name) == want, (base.kind, f.name)
        assert copy == ActionSpec.from_dict({**base.to_dict(), "hint_s": 3.0, "trajectory": "b"})
