"""``tangram-dask bench``: the contract's JSON keys, the table, and clear errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import kind, make_cluster, make_workload

from tangram_dask import FileFormatError, cli
from tangram_dask.bench import run

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "resources/bench/small.yaml")
LAPTOP = str(ROOT / "resources/bench/cluster-laptop.yaml")
KEYS = {"act_mean_s", "act_p50_s", "act_p99_s", "by_kind", "ideal_act_mean_s", "step_s", "ideal_step_s",
        "model_loads", "cold_starts", "restores", "utilization"}
KIND_KEYS = {"act_mean_s", "act_p50_s", "act_p99_s"}


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
    assert f is None or (0 < f <= 1 and round(f / 0.05, 6).is_integer())
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
    assert err.startswith("tangram-dask: error: ")
    assert f"{missing}: <file>: no such file" in err


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


def test_unknown_policy_is_refused():
    with pytest.raises(SystemExit, match="unknown policy 'lottery'"):
        cli.main(["bench", SMALL, LAPTOP, "--policy", "lottery"])


def test_installed_console_script(tmp_path):
    exe = Path(sys.executable).parent / "tangram-dask"
    if not exe.exists():
        pytest.skip(f"no tangram-dask console script beside {sys.executable}")
    out = subprocess.run([str(exe), "bench", "resources/bench/small.yaml", "resources/bench/cluster-laptop.yaml",
                          "--json", "--parity"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert [r["policy"] for r in results] == ["tangram", "fifo", "static"]
    assert all(KEYS <= set(r) for r in results)
    assert "capacity_for_parity" in results[0]
    bad = subprocess.run([str(exe), "bench", str(tmp_path / "none.yaml"), "resources/bench/cluster-laptop.yaml"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "none.yaml: <file>: no such file" in bad.stderr


def test_parity_skips_fractions_too_small_to_serve_an_action():
    wl = make_workload([kind("tool", dur=1.0, units=(4, 8), p=0.5)], [kind("reward", dur=1.0)], trajectories=4)
    cl = make_cluster(cpu=[{"slots": 8}], cold=1.0, warm=0.1)
    tangram = run(wl, cl, ("tangram", "static"), with_parity=True)[0]
    # 0.05 .. 0.35 give nodes of ceil(8 f) <= 3 slots: no 4-slot tool can run, those fractions fail;
    # 0.4 gives 4 slots, and there tangram's step (6.5 s) beats static's on the whole cluster (8 s)
    assert tangram["capacity_for_parity"] == 0.4
