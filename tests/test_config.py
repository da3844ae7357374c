"""The tangram: config namespace: defaults, a strict schema, validate(), and PluginOptions defined once."""

from __future__ import annotations

import copy
import math
from dataclasses import MISSING, fields, replace

import dask
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram_dask import config
from tangram_dask.cluster import ModelSpec
from tangram_dask.errors import ConfigError, TangramError
from tangram_dask.options import CODE_ONLY, PluginOptions
from tangram_dask.policy import TangramOptions
from tangram_dask.scheduler import PluginOptions as ReExported


def _leaves(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in ("models", "replicas"):
            out |= _leaves(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def _schema_leaves(node: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in node.get("properties", {}).items():
        if v.get("type") == "object" and "properties" in v:
            out |= _schema_leaves(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def _strict_objects(node: dict, path: str = "") -> list[str]:
    """Paths of schema objects with named properties that still allow unknown keys."""
    out = []
    if node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is not False:
        out.append(path or "<root>")
    for k, v in node.get("properties", {}).items():
        out += _strict_objects(v, f"{path}.{k}".lstrip("."))
    if isinstance(node.get("additionalProperties"), dict):
        out += _strict_objects(node["additionalProperties"], f"{path}.*")
    return out


@pytest.fixture
def snapshot_without_tangram():
    """dask's config as distributed's test harness leaves it: reset to a snapshot taken before tangram_dask."""
    saved = copy.deepcopy(dask.config.config)
    dask.config.config.pop("tangram", None)
    try:
        yield
    finally:
        dask.config.config.clear()
        dask.config.config.update(saved)


# -- the schema and the defaults ---------------------------------------------------------------
def test_schema_documents_every_default_and_nothing_else():
    assert _leaves(config.DEFAULTS) == _schema_leaves(config.SCHEMA)
    assert "tangram.scheduler.pipeline" in _leaves(config.DEFAULTS)


def test_schema_is_strict_every_object_with_properties_refuses_unknown_keys():
    assert _strict_objects(config.SCHEMA["properties"]["tangram"], "tangram") == []


def test_every_key_has_a_type_and_a_description():
    for section in ("scheduler", "worker"):
        for key, rule in config.SCHEMA["properties"]["tangram"]["properties"][section]["properties"].items():
            assert "type" in rule, f"tangram.{section}.{key} has no type"
            assert rule.get("description"), f"tangram.{section}.{key} has no description"


def test_shipped_defaults_are_valid():
    assert config.validate() == config.DEFAULTS["tangram"]
    assert config.validate("scheduler") == config.DEFAULTS["tangram"]["scheduler"]
    assert config.validate("worker") == config.DEFAULTS["tangram"]["worker"]


def test_defaults_are_registered_and_overridable():
    assert dask.config.get("tangram.scheduler.pipeline") == 2
    assert PluginOptions.from_config().pipeline == 2
    with dask.config.set({"tangram.scheduler.pipeline": 0, "tangram.scheduler.api-tokens": 7}):
        opts = PluginOptions.from_config()
        assert (opts.pipeline, opts.api_tokens) == (0, 7)
        assert config.validate("scheduler")["api-tokens"] == 7
    assert PluginOptions.from_config(pipeline=3).pipeline == 3


# -- validate(): bad config names the key path and the value ----------------------------------
# (id, dask config to set, section validated, key path named, words in the message)
BAD_CONFIG = [
    ("unknown-scheduler-key", {"tangram.scheduler.polcy": "fifo"}, "scheduler", "tangram.scheduler.polcy",
     "unknown key"),
    ("unknown-worker-key", {"tangram.worker.slot": 4}, "worker", "tangram.worker.slot", "unknown key"),
    ("unknown-section", {"tangram.dashbord": {"port": 1}}, None, "tangram.dashbord", "unknown key"),
    ("slots-a-word", {"tangram.worker.slots": "eight"}, "worker", "tangram.worker.slots",
     "'eight' is not an integer"),
    ("slots-fractional", {"tangram.worker.slots": 2.5}, "worker", "tangram.worker.slots", "2.5 is not an integer"),
    ("slots-bool", {"tangram.worker.slots": True}, "worker", "tangram.worker.slots", "True is not an integer"),
    ("slots-negative", {"tangram.worker.slots": -1}, "worker", "tangram.worker.slots", "below the minimum 0"),
    ("nvml-a-word", {"tangram.worker.nvml": "yes"}, "worker", "tangram.worker.nvml", "'yes' is not true or false"),
    ("gpu-groups-zero", {"tangram.worker.gpu-groups": [4, 0]}, "worker", "tangram.worker.gpu-groups[1]",
     "below the minimum 1"),
    ("gpu-groups-empty", {"tangram.worker.gpu-groups": []}, "worker", "tangram.worker.gpu-groups", "[]"),
    ("gpu-memory-zero", {"tangram.worker.gpu-memory-gb": 0}, "worker", "tangram.worker.gpu-memory-gb",
     "greater than 0"),
    ("policy-unknown", {"tangram.scheduler.policy": "static"}, "scheduler", "tangram.scheduler.policy",
     "'static' is not one of tangram, fifo"),
    ("api-tokens-negative", {"tangram.scheduler.api-tokens": -1}, "scheduler", "tangram.scheduler.api-tokens",
     "-1 is below the minimum 0"),
    ("api-tokens-underscore-spelling", {"tangram.scheduler.api_tokens": "x"}, "scheduler",
     "tangram.scheduler.api-tokens", "'x' is not an integer"),
    ("time-scale-zero", {"tangram.scheduler.time-scale": 0}, "scheduler", "tangram.scheduler.time-scale",
     "greater than 0"),
    ("time-scale-nan", {"tangram.scheduler.time-scale": math.nan}, "scheduler", "tangram.scheduler.time-scale",
     "nan is not a finite number"),
    ("ttl-infinite", {"tangram.scheduler.trajectory-ttl-s": math.inf}, "scheduler",
     "tangram.scheduler.trajectory-ttl-s", "inf is not a finite number"),
    ("slots-huge", {"tangram.worker.slots": -10**5000}, "worker", "tangram.worker.slots", "<int of 16610 bits>"),
    ("slowdown-below-one", {"tangram.scheduler.cross-group-slowdown": 0.5}, "scheduler",
     "tangram.scheduler.cross-group-slowdown", "below the minimum 1"),
    ("section-not-a-mapping", {"tangram.scheduler": "oops"}, "scheduler", "tangram.scheduler",
     "'oops' is not a mapping"),
    ("model-without-load", {"tangram.scheduler.models": {"rm": {"gpu_memory_gb": 8}}}, "scheduler",
     "tangram.scheduler.models.rm", "'load_s' is a required property"),
    ("model-unknown-field", {"tangram.scheduler.models": {"rm": {"gpu_memory_gb": 8, "load_s": 1, "gpus": 2}}},
     "scheduler", "tangram.scheduler.models.rm.gpus", "unknown key"),
    ("model-memory-zero", {"tangram.scheduler.models": {"rm": {"gpu_memory_gb": 0, "load_s": 1}}}, "scheduler",
     "tangram.scheduler.models.rm.gpu_memory_gb", "greater than 0"),
    ("replica-gpu-a-word", {"tangram.scheduler.replicas": {"g0": [["rm", ["a"]]]}}, "scheduler",
     "tangram.scheduler.replicas.g0[0][1][0]", "'a' is not an integer"),
    ("wait-for-capacity-a-word", {"tangram.scheduler.wait-for-capacity": "on"}, "scheduler",
     "tangram.scheduler.wait-for-capacity", "'on' is not true or false"),
    ("replica-not-a-pair", {"tangram.scheduler.replicas": {"g0": [["rm"]]}}, "scheduler",
     "tangram.scheduler.replicas.g0[0]", "['rm']"),
    ("policy-option-a-word", {"tangram.scheduler.policy-options": {"grow": "on"}}, "scheduler",
     "tangram.scheduler.policy-options.grow", "'on' is not a number"),
    ("policy-option-negative", {"tangram.scheduler.policy-options": {"admission": -1}}, "scheduler",
     "tangram.scheduler.policy-options.admission", "below the minimum 0"),
    ("policy-options-a-list", {"tangram.scheduler.policy-options": ["grow"]}, "scheduler",
     "tangram.scheduler.policy-options", "is not a mapping"),
]


@pytest.mark.parametrize("cfg, section, key, words", [c[1:] for c in BAD_CONFIG], ids=[c[0] for c in BAD_CONFIG])
def test_validate_names_the_key_path_and_the_value(cfg, section, key, words):
    with dask.config.set(cfg):
        with pytest.raises(ConfigError) as info:
            config.validate(section)
        if section is not None:  # the whole namespace finds it too
            with pytest.raises(ConfigError):
                config.validate()
    e = info.value
    assert e.key == key
    assert str(e).startswith(f"{key}: ")
    assert words in str(e)
    assert isinstance(e, TangramError) and isinstance(e, ValueError)


def test_a_bad_key_in_one_section_does_not_fail_the_other():
    with dask.config.set({"tangram.worker.slots": "eight"}):
        assert config.validate("scheduler")["policy"] == "tangram"
        with pytest.raises(ConfigError, match="tangram.worker.slots"):
            config.validate("worker")


def test_an_unknown_section_name_is_refused():
    with pytest.raises(ConfigError, match="tangram.dashboard: no such config section"):
        config.validate("dashboard")


def test_tuples_from_code_are_lists_to_the_schema():
    with dask.config.set({"tangram.worker.gpu-groups": (2, 2),
                          "tangram.scheduler.replicas": {"g0": (("rm", (0, 1)),)}}):
        assert config.validate("worker")["gpu-groups"] == [2, 2]
        assert config.validate("scheduler")["replicas"] == {"g0": [["rm", [0, 1]]]}


# -- the shipped defaults hold whatever dask's config holds ----------------------------------
def test_without_tangram_in_dask_config_the_shipped_defaults_apply(snapshot_without_tangram):
    assert dask.config.get("tangram", default=None) is None
    assert config.validate("scheduler") == config.DEFAULTS["tangram"]["scheduler"]
    assert config.validate("worker") == config.DEFAULTS["tangram"]["worker"]
    assert PluginOptions.from_config() == PluginOptions()


def test_without_defaults_a_partial_user_config_is_merged_over_them(snapshot_without_tangram):
    # what DASK_TANGRAM__SCHEDULER__API_TOKENS=3 leaves in a config that never had tangram's defaults
    dask.config.config["tangram"] = {"scheduler": {"api_tokens": 3, "policy": "fifo"}}
    opts = PluginOptions.from_config()
    assert (opts.api_tokens, opts.policy, opts.pipeline) == (3, "fifo", 2)
    dask.config.config["tangram"] = {"worker": {"slots": "eight"}}
    with pytest.raises(ConfigError, match=r"tangram.worker.slots: 'eight' is not an integer"):
        config.validate("worker")


def test_the_preload_installs_the_plugin_when_dask_config_lacks_tangram(snapshot_without_tangram):
    from distributed import LocalCluster

    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0",
                      scheduler_kwargs={"preload": ["scheduler_plugin"]}) as cluster:
        plugin = cluster.scheduler.plugins.get("tangram")
        assert plugin is not None, "the preload failed: the scheduler runs without the tangram plugin"
        assert plugin.options == PluginOptions()


def test_a_pod_sets_the_policys_knobs_with_an_environment_variable(snapshot_without_tangram):
    """``DASK_TANGRAM__SCHEDULER__POLICY_OPTIONS='{"grow": 1}'``, as dask reads it (``collect_env``), into a config
    that never had tangram's defaults: the key is spelled ``policy_options`` there, and still read."""
    env = dask.config.collect_env({"DASK_TANGRAM__SCHEDULER__POLICY_OPTIONS": '{"grow": 1, "admission-knee": 0.9}'})
    dask.config.config["tangram"] = env["tangram"]
    assert PluginOptions.from_config().tangram == TangramOptions(grow=1.0, admission_knee=0.9)


def test_the_preload_sets_the_policys_knobs_from_its_flags():
    """``dask scheduler --preload scheduler_plugin --tangram-option admission-knee=0.9 --tangram-option grow=1``:
    the live policy runs with them (and every other knob at its default)."""
    from distributed import LocalCluster

    argv = ["--tangram-option", "admission-knee=0.9", "--tangram-option", "grow=1"]
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0",
                      scheduler_kwargs={"preload": ["scheduler_plugin"], "preload_argv": argv}) as cluster:
        plugin = cluster.scheduler.plugins["tangram"]
        assert plugin.options.tangram == TangramOptions(admission_knee=0.9, grow=1.0)
        assert plugin.policy.opt == TangramOptions(admission_knee=0.9, grow=1.0)
        assert plugin.snapshot()["policy_options"] == {"admission_knee": 0.9, "grow": 1.0}  # what it runs with


def test_a_misspelt_preload_knob_stops_the_scheduler_naming_it():
    """``dask scheduler --preload scheduler_plugin --tangram-option admision=1`` exits at once, naming the knob,
    as a bad ``--tangram-policy`` does. Before session 34 distributed logged "Failed to start preload" and the
    scheduler served on without the plugin (a helper's newcomer review found it)."""
    import subprocess
    import sys
    from pathlib import Path

    dask_cli = Path(sys.executable).parent / "dask"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([str(dask_cli), "scheduler", "--port", "0", "--no-dashboard", "--preload", "scheduler_plugin",
                        "--tangram-option", "admision=1"], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "admision" in r.stderr and "not a knob" in r.stderr and "Failed to start preload" not in r.stderr


# -- PluginOptions: defined once --------------------------------------------------------------
def test_plugin_options_fields_are_the_scheduler_keys():
    names = {f.name for f in fields(PluginOptions)} - CODE_ONLY
    yaml_keys = {k.replace("-", "_") for k in config.DEFAULTS["tangram"]["scheduler"]}
    schema_keys = {k.replace("-", "_")
                   for k in config.SCHEMA["properties"]["tangram"]["properties"]["scheduler"]["properties"]}
    assert names == yaml_keys == schema_keys
    assert ReExported is PluginOptions


def test_plugin_options_defaults_are_the_shipped_defaults():
    shipped = config.DEFAULTS["tangram"]["scheduler"]
    for f in fields(PluginOptions):
        if f.name in CODE_ONLY:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        assert default == shipped[f.name.replace("_", "-")], f.name


def test_from_config_reads_models_and_replicas_and_types():
    with dask.config.set({"tangram.scheduler.api-tokens": 3.0, "tangram.scheduler.policy": "fifo",
                          "tangram.scheduler.models": {"rm": {"gpu_memory_gb": 16, "load_s": 5}},
                          "tangram.scheduler.replicas": {"gpu-0": [["rm", [0, 1]]]}}):
        o = PluginOptions.from_config()
    assert (o.api_tokens, o.policy, o.models["rm"]) == (3, "fifo", ModelSpec("rm", 16, 5))
    assert type(o.api_tokens) is int and type(o.time_scale) is float
    assert o.replicas == {"gpu-0": (("rm", (0, 1)),)}


@pytest.mark.parametrize("cfg, key", [
    ({"tangram.scheduler.polcy": "fifo"}, "tangram.scheduler.polcy"),
    ({"tangram.scheduler.pipeline": "two"}, "tangram.scheduler.pipeline"),
], ids=["unknown-key", "pipeline-a-word"])
def test_from_config_validates_first(cfg, key):
    with dask.config.set(cfg):
        with pytest.raises(ConfigError) as info:
            PluginOptions.from_config()
    assert info.value.key == key


def test_policy_options_set_the_tangram_policys_knobs_from_the_config():
    """``tangram.scheduler.policy-options``: knobs of the tangram policy by name, with - or _ (a pod sets them with
    ``DASK_TANGRAM__SCHEDULER__POLICY_OPTIONS='{"grow": 1}'``); the ones not named keep their defaults."""
    with dask.config.set({"tangram.scheduler.policy-options": {"admission-knee": 0.9, "grow": 1}}):
        o = PluginOptions.from_config()
    assert o.policy_options == {"admission_knee": 0.9, "grow": 1.0}
    assert o.tangram == TangramOptions(admission_knee=0.9, grow=1.0)
    assert PluginOptions.from_config().tangram is None  # none named: the policy's own defaults
    assert PluginOptions(policy_options={"admission_knee": 0.9, "grow": 1}) == o
    assert replace(o, pipeline=3).tangram == o.tangram  # both fields filled, and equal: not a clash


@pytest.mark.parametrize("knobs, tangram, key, words", [
    ({"knee": 0.9}, None, "tangram.scheduler.policy-options.knee", "'knee' is not a knob of the tangram policy"),
    ({"grow": math.inf}, None, "tangram.scheduler.policy-options.grow", "inf is not a finite number >= 0"),
    ({"grow": True}, None, "tangram.scheduler.policy-options.grow", "True is not a finite number >= 0"),
    ({"grow": 1}, TangramOptions(grow=2), "tangram.scheduler.policy-options", "given twice, and differ"),
], ids=["unknown-knob", "infinite", "a-bool", "and-tangram-from-code"])
def test_a_bad_policy_option_is_refused_naming_it(knobs, tangram, key, words):
    with pytest.raises(ConfigError) as info:
        PluginOptions(policy_options=knobs, tangram=tangram)
    assert info.value.key == key and words in str(info.value)


# (id, PluginOptions keyword, value, key named)
BAD_OPTIONS = [
    ("policy-static", "policy", "static", "tangram.scheduler.policy"),
    ("time-scale-zero", "time_scale", 0, "tangram.scheduler.time-scale"),
    ("pipeline-negative", "pipeline", -1, "tangram.scheduler.pipeline"),
    ("pipeline-fraction", "pipeline", 1.5, "tangram.scheduler.pipeline"),
    ("api-tokens-a-word", "api_tokens", "8", "tangram.scheduler.api-tokens"),
    ("ttl-nan", "trajectory_ttl_s", math.nan, "tangram.scheduler.trajectory-ttl-s"),
    ("warm-negative", "warm_start_s", -0.1, "tangram.scheduler.warm-start-s"),
    ("slowdown-below-one", "cross_group_slowdown", 0.9, "tangram.scheduler.cross-group-slowdown"),
    ("models-of-dicts", "models", {"rm": {"gpu_memory_gb": 1}}, "tangram.scheduler.models"),
    ("tangram-not-options", "tangram", {"aging": 1}, "tangram"),
    ("wait-for-capacity-a-word", "wait_for_capacity", "yes", "tangram.scheduler.wait-for-capacity"),
    ("wait-for-capacity-an-int", "wait_for_capacity", 1, "tangram.scheduler.wait-for-capacity"),
]


@pytest.mark.parametrize("name, value, key", [c[1:] for c in BAD_OPTIONS], ids=[c[0] for c in BAD_OPTIONS])
def test_plugin_options_refuse_bad_values_naming_the_key(name, value, key):
    with pytest.raises(ConfigError) as info:
        PluginOptions(**{name: value})
    assert info.value.key == key
    assert repr(value) in str(info.value) or name in ("models", "tangram")


def test_an_unknown_override_is_refused():
    with pytest.raises(ConfigError, match="not an option of the scheduler plugin"):
        PluginOptions.from_config(pipelin=3)


# -- any config either validates or raises ConfigError --------------------------------------------
_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10**30), 10**30),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                    st.sampled_from(["tangram", "fifo", "static", ""]))
_value = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=6)
_sched_keys = list(config.DEFAULTS["tangram"]["scheduler"])
_worker_keys = list(config.DEFAULTS["tangram"]["worker"])
_key = st.one_of(st.sampled_from(_sched_keys + [k.replace("-", "_") for k in _sched_keys]), st.text(max_size=5))
_model = st.fixed_dictionaries({}, optional={"gpu_memory_gb": _scalar, "load_s": _scalar, "x": _scalar})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sched=st.dictionaries(_key, _value, max_size=4),
       models=st.one_of(st.none(), st.dictionaries(st.text(min_size=1, max_size=3), _model, max_size=2)),
       worker=st.dictionaries(st.sampled_from(_worker_keys), _value, max_size=3))
def test_any_config_validates_or_raises_config_error(sched, models, worker):
    cfg = {"tangram": {"scheduler": dict(sched), "worker": worker}}
    if models is not None:
        cfg["tangram"]["scheduler"]["models"] = models
    with dask.config.set(cfg):
        for section in ("scheduler", "worker", None):
            try:
                config.validate(section)
            except ConfigError as e:
                assert str(e).startswith(f"{e.key}: ") and e.key.startswith("tangram")
        try:
            opts = PluginOptions.from_config()
        except ConfigError:
            return
    assert opts.policy in ("tangram", "fifo") and type(opts.pipeline) is int and type(opts.time_scale) is float


def test_the_plugins_wall_seconds_reach_the_policy_on_its_clock():
    """``trajectory-ttl-s`` and ``lost-wait-s`` are wall seconds; the policy's clock runs at 1 / time_scale (the
    live bench replays at 0.2), so it reads them divided by the time scale. Before session 34 the TTL was read in
    policy time: at 0.2, a fifth of what the user set."""
    from tangram_dask.scheduler import TangramSchedulerPlugin

    opts = PluginOptions.from_config(time_scale=0.2, trajectory_ttl_s=10.0, lost_wait_s=30.0)
    pol = TangramSchedulerPlugin(options=opts).build_policy()
    assert (pol.trajectory_ttl_s, pol.lost_wait_s) == pytest.approx((50.0, 150.0))
    pol = TangramSchedulerPlugin(options=PluginOptions.from_config(trajectory_ttl_s=0, lost_wait_s=0)).build_policy()
    assert (pol.trajectory_ttl_s, pol.lost_wait_s) == (None, 0.0)
