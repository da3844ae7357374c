"""Action specs: a wrong spec raises SpecError at the call, naming the field and the value."""

from __future__ import annotations

import math

import pytest

import tangram_dask
from tangram_dask import ActionSpec, SpecError, TangramError, make_spec
from tangram_dask.spec import amdahl

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
    ("infinite-hint", dict(kind="k", hint_s=math.inf), "hint_s", math.inf),
    ("string-hint", dict(kind="k", hint_s="3s"), "hint_s", "3s"),
    ("parallel-fraction-above-one", dict(kind="k", units=(1, 4), speedup=1.5), "speedup.parallel_fraction", 1.5),
    ("parallel-fraction-negative", dict(kind="k", units=(1, 4), speedup=-0.1), "speedup.parallel_fraction", -0.1),
    ("zero-timeout", dict(kind="k", timeout_s=0), "timeout_s", 0),
    ("negative-restore", dict(kind="k", restore_s=-2.0), "restore_s", -2.0),
    ("affinity-without-trajectory", dict(kind="k", affinity="trajectory"), "trajectory", None),
    ("unknown-affinity", dict(kind="k", trajectory="t1", affinity="node"), "affinity", "node"),
    ("trajectory-not-a-string", dict(kind="k", trajectory=17), "trajectory", 17),
]


@pytest.mark.parametrize("kwargs, field, value", [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_raises_naming_field_and_value(kwargs, field, value):
    with pytest.raises(SpecError) as info:
        make_spec(**kwargs)
    e = info.value
    assert e.field == field
    assert e.value == value or (isinstance(value, float) and math.isnan(value))
    assert repr(field) in str(e)
    assert repr(value) in str(e)
    assert isinstance(e, ValueError) and isinstance(e, TangramError)


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
]


@pytest.mark.parametrize("d, field, value", [c[1:] for c in BAD_DICTS], ids=[c[0] for c in BAD_DICTS])
def test_from_dict_rejects_bad_annotations(d, field, value):
    with pytest.raises(SpecError) as info:
        ActionSpec.from_dict(d)
    assert info.value.field == field
    assert info.value.value == value
    assert repr(field) in str(info.value)


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


def test_action_annotates_the_tasks_submitted_inside():
    import dask

    with tangram_dask.action(kind="run_tests", units=(1, 8), speedup=0.9, hint_s=12, trajectory="t-17") as spec:
        ann = dask.get_annotations()
    assert ann[tangram_dask.ANNOTATION] == spec.to_dict()
    assert ActionSpec.from_dict(ann["tangram"]) == spec
    assert tangram_dask.ANNOTATION not in dask.get_annotations()
