"""The command line: one click group behind ``tangram-dask`` and ``dask tangram``.

``bench``: the contract's JSON keys, the table, and clear errors with exit status 2 (usage errors,
bad -o KEY=VALUE, missing or malformed files), the same both ways.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner
from conftest import kind, make_cluster, make_workload

from tangram_dask import cli
from tangram_dask.bench import run

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "resources/bench/small.yaml")
LAPTOP = str(ROOT / "resources/bench/cluster-laptop.yaml")
KEYS = {"act_mean_s", "act_p50_s", "act_p99_s", "by_kind", "ideal_act_mean_s", "step_s", "ideal_step_s",
        "model_loads", "cold_starts", "restores", "utilization"}
KIND_KEYS = {"act_mean_s", "act_p50_s", "act_p99_s"}
BIN = Path(sys.executable).parent


def _bench(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["bench", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_has_every_contract_key_per_policy(capsys):
    code, out, _ = _bench(capsys, SMALL, LAPTOP, "--json")
    assert code == 0
    results = json.loads(out)
    assert [r["policy"] for r in results] == ["tangram", "fifo", "static"]
    for r in results:
        assert KEYS <= set(r), f"{r['policy']} lacks {KEYS - set(r)}"
        assert set(r["utilization"]) == {"cpu", "gpu", "api"}
        assert set(r["by_kind"]) == {"code_exec", "run_tests", "web_search", "judge_small", "judge_large"}
        for k in r["by_kind"].values():
            assert KIND_KEYS <= set(k)
        assert r["act_mean_s"] >= r["ideal_act_mean_s"] > 0
        assert r["step_s"] >= r["ideal_step_s"] > 0
        assert "capacity_for_parity" not in r
    assert results[2]["cold_starts"] == 32  # static: one cold start per admitted trajectory
    assert results[2]["model_loads"] == 0


def test_parity_adds_capacity_for_parity_to_tangram(capsys):
    code, out, _ = _bench(capsys, SMALL, LAPTOP, "--json", "--parity", "--policy", "tangram,static")
    assert code == 0
    tangram, static = json.loads(out)
    f = tangram["capacity_for_parity"]
    # small.yaml on the laptop cluster reaches static's step below the whole cluster (0.55 at this writing):
    # None, a search that found nothing, is a failure here
    assert f is not None and 0 < f < 1 and round(f / 0.05, 6).is_integer(), f
    assert "capacity_for_parity" not in static
    assert tangram["static_step_s"] == static["step_s"]


def test_one_policy_prints_one_object(capsys):
    code, out, _ = _bench(capsys, SMALL, LAPTOP, "--json", "--policy", "fifo")
    assert code == 0
    r = json.loads(out)
    assert isinstance(r, dict) and r["policy"] == "fifo" and KEYS <= set(r)


def test_default_output_is_a_table(capsys):
    code, out, _ = _bench(capsys, SMALL, LAPTOP)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].startswith("workload small (")
    assert lines[1].split()[:3] == ["policy", "ACT", "mean"]
    assert [ln.split()[0] for ln in lines[2:]] == ["tangram", "fifo", "static"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_missing_file_exits_2_naming_the_file(capsys, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    code, out, err = _bench(capsys, missing, LAPTOP, "--json")
    assert code == 2 and out == ""
    assert err == f"Error: {missing}: <file>: no such file\n"


def test_bad_key_exits_2_naming_the_file_and_key(capsys, tmp_path):
    data = yaml.safe_load(open(SMALL))
    data["tools"][1]["units"] = {"min": 4, "max": 2}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    code, out, err = _bench(capsys, str(bad), LAPTOP)
    assert code == 2 and out == ""
    assert f"{bad}: tools[1].units.max: " in err


def test_unknown_cluster_key_exits_2(capsys, tmp_path):
    data = yaml.safe_load(open(LAPTOP))
    data["gpu"]["nodes"][0]["groups"] = [3, 3]
    bad = tmp_path / "cluster.yaml"
    bad.write_text(yaml.safe_dump(data))
    code, _, err = _bench(capsys, SMALL, str(bad))
    assert code == 2
    assert f"{bad}: gpu.nodes[0].groups: sizes [3, 3] must sum to gpus = 4" in err


# -- usage errors: exit status 2, click's usage line, the same through both entry points ---------
# (id, arguments after the command name, words on stderr)
USAGE_ERRORS = [
    ("unknown-policy", ["bench", SMALL, LAPTOP, "--policy", "lottery"], "unknown policy 'lottery'"),
    ("empty-policy", ["bench", SMALL, LAPTOP, "--policy", ","], "name at least one of"),
    ("unknown-option", ["bench", SMALL, LAPTOP, "--colour"], "No such option '--colour'"),
    ("missing-workload", ["bench"], "Missing argument 'WORKLOAD'"),
    ("missing-cluster", ["bench", SMALL], "Missing argument 'CLUSTER'"),
    ("extra-argument", ["bench", SMALL, LAPTOP, "more"], "Got unexpected extra argument (more)"),
    ("o-without-equals", ["bench", SMALL, LAPTOP, "-o", "admission"], "expected KEY=VALUE with KEY one of"),
    ("o-unknown-key", ["bench", SMALL, LAPTOP, "-o", "colour=1"], "'colour' is not a knob of the tangram policy"),
    ("o-negative", ["bench", SMALL, LAPTOP, "-o", "grow=-1"], "-1.0 is not a finite number >= 0"),
    ("o-dashes", ["bench", SMALL, LAPTOP, "-o", "admission-kne=1"],
     "(did you mean 'admission_knee'? knobs, with - or _: aging, price"),
    ("o-not-a-number", ["bench", SMALL, LAPTOP, "--option", "admission=lots"], "'lots' is not a number"),
    ("o-not-finite", ["bench", SMALL, LAPTOP, "-o", "aging=nan"], "is not a finite number"),
    ("time-scale-zero", ["bench", SMALL, LAPTOP, "--live", "--time-scale", "0"], "'--time-scale': 0.0 is not"),
    ("time-scale-word", ["bench", SMALL, LAPTOP, "--time-scale", "fast"], "'fast' is not a valid float"),
    # --live runs tangram and fifo by default (the issue's `bench --live small.yaml cluster-laptop.yaml --json`
    # failed on static, the default's third policy, with exit status 1); static asked for is a usage error
    ("live-static", ["bench", SMALL, LAPTOP, "--live", "--policy", "fifo,static"], "--live runs tangram and fifo"),
    ("hints-negative", ["bench", SMALL, LAPTOP, "--trajectory-hints", "-1"], "'--trajectory-hints': -1.0 is not"),
    ("unknown-command", ["benchmark"], "No such command 'benchmark'"),
    ("no-command", [], "Commands:\n  bench"),  # click prints the group's help, exit status 2
]


@pytest.mark.parametrize("args, words", [c[1:] for c in USAGE_ERRORS], ids=[c[0] for c in USAGE_ERRORS])
def test_usage_errors_exit_2_with_the_usage_line(capsys, args, words):
    code = cli.main(args)
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert words in out.err
    assert out.err.startswith("Usage: tangram-dask")
    assert "Error: " in out.err or args == []  # no command: the group's help alone


def _dask_root() -> click.Group:
    """dask's own CLI with every ``dask_cli`` entry point registered, as ``dask`` does it."""
    from dask.cli import cli as root

    for ep in entry_points(group="dask_cli"):
        if ep.name == "tangram" and "tangram" not in root.commands:
            root.add_command(ep.load())  # what `dask` does with each dask_cli entry point
    return root


def test_the_dask_cli_entry_point_is_this_group():
    eps = {ep.name: ep for ep in entry_points(group="dask_cli")}
    if "tangram" not in eps:
        pytest.skip("tangram-dask is not installed (pip install -e .): no dask_cli entry point")
    assert eps["tangram"].load() is cli.cli
    assert _dask_root().commands["tangram"] is cli.cli


@pytest.mark.parametrize("args, words", [c[1:] for c in USAGE_ERRORS], ids=[c[0] for c in USAGE_ERRORS])
def test_usage_errors_are_the_same_under_dask_tangram(args, words):
    root = _dask_root()
    if "tangram" not in root.commands:
        pytest.skip("no dask_cli entry point named tangram (pip install -e .)")
    res = CliRunner().invoke(root, ["tangram", *args], prog_name="dask")
    assert res.exit_code == 2, res.output
    assert words in res.stderr
    assert res.stderr.startswith("Usage: dask tangram")


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"], ["-h"]], ids=["group", "bench", "short"])
def test_help_names_the_program_it_was_called_as(capsys, args):
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage: tangram-dask")
    res = CliRunner().invoke(_dask_root(), ["tangram", *args], prog_name="dask")
    assert res.exit_code == 0 and res.output.startswith("Usage: dask tangram")
    if "bench" in args:
        for opt in ("--policy", "--parity", "--json", "--audit", "--time-policy", "--no-progress", "--live",
                    "--time-scale", "--option"):
            assert opt in out, opt


def test_subcommands_can_be_added_to_the_group(capsys, monkeypatch):
    @click.command(name="hello")
    @click.argument("who")
    def hello(who):
        click.echo(f"hello {who}")

    # a copy of the group, so the real one stays as it is
    monkeypatch.setattr(cli, "cli", cli.TangramGroup(name="tangram", commands=dict(cli.cli.commands)))
    cli.cli.add_command(hello)
    assert cli.main(["hello", "you"]) == 0
    assert capsys.readouterr().out == "hello you\n"
    assert cli.main(["hello"]) == 2  # its usage errors are the group's


def test_lazy_subcommands_are_listed_and_loaded_on_use(capsys, monkeypatch):
    monkeypatch.setattr(cli, "cli", cli.TangramGroup(name="tangram", commands=dict(cli.cli.commands)))
    monkeypatch.setitem(cli.LAZY_COMMANDS, "lazy-bench", "tangram_dask.cli:bench")
    assert cli.main(["--help"]) == 0
    assert "lazy-bench" in capsys.readouterr().out
    assert cli.main(["lazy-bench", SMALL, LAPTOP, "--policy", "fifo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "fifo"


# -- every option reaches what it drives ----------------------------------------------------------
# (id, extra arguments, where the run goes, keyword arguments it must receive)
PLUMBING = [
    ("defaults", [], "sim", dict(policies=("tangram", "fifo", "static"), with_parity=False, audit=False,
                                 time_policy=False, options=None, progress=True, trajectory_hints=None)),
    ("trajectory-hints", ["--trajectory-hints", "0.5", "-o", "admit_long=2"], "sim",
     dict(trajectory_hints=0.5, options={"admit_long": 2.0})),
    ("policy-parity-audit", ["--policy", "tangram,static", "--parity", "--audit"], "sim",
     dict(policies=("tangram", "static"), with_parity=True, audit=True)),
    ("time-policy-no-progress", ["--time-policy", "--no-progress"], "sim", dict(time_policy=True, progress=False)),
    ("options", ["-o", "admission=0", "--option", "aging=2.5"], "sim",
     dict(options={"admission": 0.0, "aging": 2.5})),
    ("live", ["--live", "--policy", "fifo", "--time-scale", "0.01", "-o", "price=1"], "live",
     dict(policies=("fifo",), time_scale=0.01, options={"price": 1.0})),
    ("live-defaults", ["--live"], "live", dict(policies=("tangram", "fifo"), time_scale=0.2, options=None,
                                               trajectory_hints=None)),
    ("live-hints", ["--live", "--trajectory-hints", "0.5"], "live", dict(trajectory_hints=0.5)),
]


@pytest.mark.parametrize("extra, where, want", [c[1:] for c in PLUMBING], ids=[c[0] for c in PLUMBING])
def test_every_option_reaches_the_run(capsys, monkeypatch, extra, where, want):
    import tangram_dask.bench
    import tangram_dask.live

    seen = {}

    def fake(workload, cluster, policies=("tangram", "fifo", "static"), **kw):
        seen.update(kw, where=where, policies=tuple(policies), workload=workload.name, cluster=cluster.name)
        return [{"policy": p} for p in policies]

    monkeypatch.setattr(tangram_dask.bench, "run", lambda *a, **kw: fake(*a, **kw) if where == "sim" else None)
    monkeypatch.setattr(tangram_dask.live, "run_live", lambda *a, **kw: fake(*a, **kw) if where == "live" else None)
    assert cli.main(["bench", SMALL, LAPTOP, "--json", *extra]) == 0
    assert (seen["where"], seen["workload"], seen["cluster"]) == (where, "small", "laptop")
    for key, value in want.items():
        got = seen[key]
        if key == "options" and value is not None:
            got = {k: getattr(got, k) for k in value}
        if key == "progress":
            got = got is not None
        assert got == value, key
    out = json.loads(capsys.readouterr().out)
    assert out == ([{"policy": p} for p in seen["policies"]] if len(seen["policies"]) > 1 else
                   {"policy": seen["policies"][0]})


def test_audit_and_time_policy_run_for_real(capsys):
    code, out, _ = _bench(capsys, SMALL, LAPTOP, "--json", "--policy", "tangram", "--audit", "--time-policy")
    assert code == 0
    r = json.loads(out)
    assert r["policy"] == "tangram" and r["policy_us_per_decision"] > 0 and KEYS <= set(r)


def _run(exe: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


ENTRY_POINTS = [("tangram-dask", [str(BIN / "tangram-dask")]), ("dask-tangram", [str(BIN / "dask"), "tangram"])]


@pytest.mark.parametrize("exe", [e[1] for e in ENTRY_POINTS], ids=[e[0] for e in ENTRY_POINTS])
def test_installed_commands_run_and_exit_2_on_errors(exe, tmp_path):
    if not Path(exe[0]).exists():
        pytest.skip(f"no {exe[0]} beside {sys.executable}")
    prog = " ".join(Path(x).name if i == 0 else x for i, x in enumerate(exe))
    ok = _run(exe, "bench", SMALL, LAPTOP, "--json", "--parity", "--policy", "tangram,fifo")
    assert ok.returncode == 0, ok.stderr
    results = json.loads(ok.stdout)
    assert [r["policy"] for r in results] == ["tangram", "fifo"] and all(KEYS <= set(r) for r in results)
    assert "capacity_for_parity" in results[0]
    bad = _run(exe, "bench", str(tmp_path / "none.yaml"))  # the other errors: in process, both ways, above
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith(f"Usage: {prog} bench [OPTIONS] WORKLOAD CLUSTER"), bad.stderr
    assert "Missing argument 'CLUSTER'" in bad.stderr
    if exe[0].endswith("tangram-dask"):
        missing = _run(exe, "bench", str(tmp_path / "none.yaml"), LAPTOP)
        assert missing.returncode == 2
        assert missing.stderr == f"Error: {tmp_path / 'none.yaml'}: <file>: no such file\n"


def test_a_missing_file_under_dask_tangram_exits_2(tmp_path):
    res = CliRunner().invoke(_dask_root(), ["tangram", "bench", str(tmp_path / "none.yaml"), LAPTOP], prog_name="dask")
    assert res.exit_code == 2
    assert res.stderr == f"Error: {tmp_path / 'none.yaml'}: <file>: no such file\n"


def test_parity_skips_fractions_too_small_to_serve_an_action():
    wl = make_workload([kind("tool", dur=1.0, units=(4, 8), p=0.5)], [kind("reward", dur=1.0)], trajectories=4)
    cl = make_cluster(cpu=[{"slots": 8}], cold=1.0, warm=0.1)
    tangram = run(wl, cl, ("tangram", "static"), with_parity=True)[0]
    # 0.05 .. 0.35 give nodes of ceil(8 f) <= 3 slots: no 4-slot tool can run, those fractions fail;
    # 0.4 gives 4 slots, and there tangram's step (6.5 s) beats static's on the whole cluster (8 s)
    assert tangram["capacity_for_parity"] == 0.4


def test_a_run_beyond_the_contract_says_so_beside_its_figures(capsys):
    """``grow`` loads replicas wider than WORKLOAD.md's smallest k: the table says so under the figures,
    the JSON names the option; at the defaults neither does."""
    code, out, _ = _bench(capsys, SMALL, LAPTOP, "--policy", "tangram", "-o", "grow=1", "--no-progress")
    assert code == 0 and "note: tangram ran with grow, beyond WORKLOAD.md" in out
    code, out, _ = _bench(capsys, SMALL, LAPTOP, "--policy", "tangram", "-o", "grow=1", "--json")
    assert code == 0 and json.loads(out)["beyond_contract"] == ["grow"]
    code, out, _ = _bench(capsys, SMALL, LAPTOP, "--policy", "tangram", "--no-progress")
    assert code == 0 and "beyond" not in out
    code, out, _ = _bench(capsys, SMALL, LAPTOP, "--trajectory-hints", "0.5", "-o", "admit_long=2", "--no-progress")
    assert code == 0 and "note: every trajectory began with a hint of its length (--trajectory-hints 0.5)" in out
    code, out, _ = _bench(capsys, SMALL, LAPTOP, "--policy", "tangram", "--trajectory-hints", "0", "--json")
    assert code == 0 and json.loads(out)["trajectory_hints"] == 0.0
