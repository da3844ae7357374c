"""The scheduler plugin's index of grants by worker (found by a helper's review of session 32; the test failed
before its fix), on a stand-in scheduler."""
from __future__ import annotations

from types import SimpleNamespace

from tangram_dask import make_spec
from tangram_dask.messages import WorkerDeclaration
from tangram_dask.scheduler import GRANTED, Action, TangramSchedulerPlugin
from distributed.core import Status


class Loop:
    def add_callback(self, *a, **k):
        pass

    def call_later(self, *a, **k):
        pass


class Sched:
    def __init__(self):
        self.tasks, self.workers, self.loop, self.status = {}, {}, Loop(), Status.running
        self.plugin = None

    def transitions(self, recs, stimulus_id):
        for k, finish in recs.items():
            ts = self.tasks[k]
            start, ts.state = ts.state, finish
            self.plugin.transition(k, start, finish)

    def transition(self, key, finish, **kw):
        ts = self.tasks[key]
        start, ts.state = ts.state, finish
        self.plugin.transition(key, start, finish)
        return {}


def setup():
    p = TangramSchedulerPlugin(policy="fifo")
    s = Sched()
    s.plugin = p
    p.scheduler = s
    p.policy = p.build_policy()
    s.workers["w1"] = SimpleNamespace(resources={"slots": 2}, nthreads=2, status=Status.running, address="w1",
                                      name="w1")
    p._join("w1", WorkerDeclaration(slots=2))
    spec = make_spec("tool", "cpu", 1, hint_s=1.0)
    for k in ("k1", "k2"):
        s.tasks[k] = SimpleNamespace(state="released", annotations={"tangram": {}}, worker_restrictions=None,
                                     resource_restrictions=None, processing_on=None, loose_restrictions=False)
        p.actions[k] = Action(spec)
        s.tasks[k].state = "no-worker"
        p.transition(k, "waiting", "no-worker")
    p._flush()
    assert all(p.actions[k].state == GRANTED for k in ("k1", "k2"))
    assert set(p._granted_on["w1"]) == {"k1", "k2"}
    return p, s


def test_a_grant_that_ends_with_a_transition_error_leaves_the_index_and_revoke_works(monkeypatch):
    """A grant that ends through a transition the policy errs on, then is forgotten, leaves the index; a later
    pause of its worker revokes the others (before: the key stayed, and _revoke raised on its missing record)."""
    p, s = setup()
    orig = p.policy.finish
    monkeypatch.setattr(p.policy, "finish", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("policy bug")))
    s.tasks["k1"].state = "memory"
    p.transition("k1", "processing", "memory")
    monkeypatch.setattr(p.policy, "finish", orig)
    s.tasks["k1"].state = "forgotten"
    p.transition("k1", "memory", "forgotten")
    del s.tasks["k1"]
    assert "k1" not in p.actions
    print("index after k1 was forgotten:", p._granted_on, p._grant_worker)
    s.tasks["k2"].state = "no-worker"  # granted, not sent: the worker paused first
    s.workers["w1"].status = Status.paused
    p._revoke("w1", p.now())
    assert p.actions["k2"].state != GRANTED
