"""The resource ledger (``tangram_dask/policy/ledger.py``) as tables of named cases.

Each case builds a pool, applies a few operations and compares what the
pool then says with numbers worked out by hand in the case's comment.
"""

from __future__ import annotations

import pytest

from tangram_dask.cluster import CpuNode, GpuNode
from tangram_dask.policy.ledger import CpuPool, GpuPool, OverAllocation, TokenPool
from tangram_dask.policy.types import ReplicaSpec


# -- CpuPool ---------------------------------------------------------------------------------------
def cpu_pool(nodes: list[tuple[str, int, int]], ops: list[tuple]) -> CpuPool:
    """``nodes``: (name, slots, ahead) in join order; ``ops``: ("take"|"give", node, k) or ("remove", node)."""
    pool = CpuPool()
    for name, slots, ahead in nodes:
        pool.add(name, slots, ahead)
    for op in ops:
        getattr(pool, op[0])(*op[1:])
    return pool


def cpu_view(pool: CpuPool) -> dict:
    return {"free": dict(pool.free), "max_free": pool.max_free, "most_free": pool.most_free(),
            "total": pool.total, "total_free": pool.total_free, "slots": pool.slots, "slots_free": pool.slots_free}


CPU_CASES = [
    # a: 2 slots, nothing taken: everything free, a is the only node
    pytest.param([("a", 2, 0)], [],
                 {"free": {"a": 2}, "max_free": 2, "most_free": "a", "total": 2, "total_free": 2, "slots": 2,
                  "slots_free": 2}, id="one-idle-node"),
    # a 2, b 3; take 1 on a: a 1 free, b 3 free; the most free is b; 4 of 5 free
    pytest.param([("a", 2, 0), ("b", 3, 0)], [("take", "a", 1)],
                 {"free": {"a": 1, "b": 3}, "max_free": 3, "most_free": "b", "total": 5, "total_free": 4,
                  "slots": 5, "slots_free": 4}, id="most-free-node-wins"),
    # a 2, b 2 tie: a joined first and has been in the 2-free bucket longest
    pytest.param([("a", 2, 0), ("b", 2, 0)], [],
                 {"free": {"a": 2, "b": 2}, "max_free": 2, "most_free": "a", "total": 4, "total_free": 4,
                  "slots": 4, "slots_free": 4}, id="tie-first-joined"),
    # a 2, b 2; a takes 1 and gives it back: now b has been free-2 longer than a
    pytest.param([("a", 2, 0), ("b", 2, 0)], [("take", "a", 1), ("give", "a", 1)],
                 {"free": {"a": 2, "b": 2}, "max_free": 2, "most_free": "b", "total": 4, "total_free": 4,
                  "slots": 4, "slots_free": 4}, id="tie-longest-in-bucket"),
    # a 2 slots + 2 ahead: capacity 4, real slots 2; slots_free = total_free 4 - ahead 2 = 2
    pytest.param([("a", 2, 2)], [],
                 {"free": {"a": 4}, "max_free": 4, "most_free": "a", "total": 4, "total_free": 4, "slots": 2,
                  "slots_free": 2}, id="ahead-idle"),
    # take 2 then 2 on a (2 + 2 ahead): nothing free, no most-free node, slots_free floored at 0
    pytest.param([("a", 2, 2)], [("take", "a", 2), ("take", "a", 2)],
                 {"free": {"a": 0}, "max_free": 0, "most_free": None, "total": 4, "total_free": 0, "slots": 2,
                  "slots_free": 0}, id="ahead-full"),
    # take 2 on a (2 + 2 ahead): 2 ahead units free, no real slot: slots_free = 2 - 2 = 0
    pytest.param([("a", 2, 2)], [("take", "a", 2)],
                 {"free": {"a": 2}, "max_free": 2, "most_free": "a", "total": 4, "total_free": 2, "slots": 2,
                  "slots_free": 0}, id="ahead-only-ahead-free"),
    # a (2 + 1 ahead), b 3; take 2 on a, remove a: only b is left, its 3 free; ahead back to 0
    pytest.param([("a", 2, 1), ("b", 3, 0)], [("take", "a", 2), ("remove", "a")],
                 {"free": {"b": 3}, "max_free": 3, "most_free": "b", "total": 3, "total_free": 3, "slots": 3,
                  "slots_free": 3}, id="remove-busy-node"),
    # give on a node that left while its action ran: ignored
    pytest.param([("a", 2, 0), ("b", 1, 0)], [("take", "a", 2), ("remove", "a"), ("give", "a", 2)],
                 {"free": {"b": 1}, "max_free": 1, "most_free": "b", "total": 1, "total_free": 1, "slots": 1,
                  "slots_free": 1}, id="give-after-remove-is-a-no-op"),
    # the top bucket empties: a 4 takes 3 -> max_free falls to b's 2
    pytest.param([("a", 4, 0), ("b", 2, 0)], [("take", "a", 3)],
                 {"free": {"a": 1, "b": 2}, "max_free": 2, "most_free": "b", "total": 6, "total_free": 3,
                  "slots": 6, "slots_free": 3}, id="max-free-falls"),
    # re-adding a node after removing it starts it fresh
    pytest.param([("a", 2, 0)], [("take", "a", 1), ("remove", "a"), ("add", "a", 3)],
                 {"free": {"a": 3}, "max_free": 3, "most_free": "a", "total": 3, "total_free": 3, "slots": 3,
                  "slots_free": 3}, id="remove-then-add-again"),
]


@pytest.mark.parametrize("nodes, ops, want", CPU_CASES)
def test_cpu_pool(nodes, ops, want):
    assert cpu_view(cpu_pool(nodes, ops)) == want


FIT_CASES = [
    # join order: a first although b has more free
    pytest.param([("a", 2, 0), ("b", 4, 0)], [], 1, "a", "b", id="first-in-join-order"),
    # a has 1 free after a take: a 2-slot need skips it for b
    pytest.param([("a", 2, 0), ("b", 4, 0)], [("take", "a", 1)], 2, "b", "b", id="skips-too-full"),
    # nobody has 5
    pytest.param([("a", 2, 0), ("b", 4, 0)], [], 5, None, None, id="none-fits"),
    # a: 2 slots + 2 ahead = 4 free units, but a 3-unit action can never run on 2 real slots: b
    pytest.param([("a", 2, 2), ("b", 4, 0)], [], 3, "b", "b", id="ahead-units-do-not-make-a-node-bigger"),
    # only a, 2 slots + 2 ahead: 3 units fit nowhere
    pytest.param([("a", 2, 2)], [], 3, None, None, id="oversized-fits-nowhere"),
    # a (2 + 2 ahead) has its 2 real slots busy, 2 ahead free: a 2-unit action may be sent ahead
    pytest.param([("a", 2, 2)], [("take", "a", 2)], 2, "a", "a", id="dispatch-ahead-fits"),
]


@pytest.mark.parametrize("nodes, ops, need, first, fit", FIT_CASES)
def test_cpu_first_fit_and_fit_node(nodes, ops, need, first, fit):
    pool = cpu_pool(nodes, ops)
    assert pool.first_fit(need) == first
    assert pool.fit_node(need) == fit


CPU_ERRORS = [
    pytest.param([("a", 2, 0)], [], ("take", "a", 3), "only 2 free", id="take-more-than-free"),
    pytest.param([("a", 2, 0)], [], ("take", "a", 0), "take 0", id="take-zero"),
    pytest.param([("a", 2, 0)], [], ("take", "a", -1), "take -1", id="take-negative"),
    pytest.param([("a", 2, 2)], [], ("take", "a", 3), "has 2 slots", id="take-beyond-real-slots-with-ahead"),
    pytest.param([("a", 2, 0)], [("take", "a", 1)], ("take", "a", 2), "only 1 free", id="take-after-take"),
    pytest.param([("a", 2, 0)], [], ("give", "a", 1), "exceed capacity 2", id="give-more-than-taken"),
    pytest.param([("a", 2, 1)], [("take", "a", 1)], ("give", "a", 2), "exceed capacity 3", id="give-twice-over"),
]


@pytest.mark.parametrize("nodes, ops, bad, message", CPU_ERRORS)
def test_cpu_over_allocation(nodes, ops, bad, message):
    pool = cpu_pool(nodes, ops)
    before = cpu_view(pool)
    with pytest.raises(OverAllocation, match=message):
        getattr(pool, bad[0])(*bad[1:])
    assert cpu_view(pool) == before, "a refused change changes nothing"


@pytest.mark.parametrize("slots, ahead", [
    pytest.param(0, 0, id="zero-slots"),
    pytest.param(-1, 0, id="negative-slots"),
    pytest.param(2, -1, id="negative-ahead"),
])
def test_cpu_add_rejects(slots, ahead):
    with pytest.raises(ValueError, match="slots must be >= 1"):
        CpuPool().add("a", slots, ahead)


def test_cpu_add_twice_rejected_and_init_from_nodes():
    pool = CpuPool((CpuNode("a", 2), CpuNode("b", 1)))
    assert (pool.total, pool.limit, list(pool.order)) == (3, {"a": 2, "b": 1}, ["a", "b"])
    with pytest.raises(ValueError, match="already known"):
        pool.add("a", 2)


# -- TokenPool -------------------------------------------------------------------------------------
TOKEN_CASES = [
    # 4 tokens, take 3: 1 free
    pytest.param(4, [("take", 3)], 4, 1, id="take"),
    # take 3, give 3: all back
    pytest.param(4, [("take", 3), ("give", 3)], 4, 4, id="take-give"),
    # a give beyond what was taken is capped at the total (a double release is harmless)
    pytest.param(4, [("take", 1), ("give", 1), ("give", 1)], 4, 4, id="give-twice-capped"),
    # grow 4 -> 6 with 3 taken: 1 + 2 = 3 free
    pytest.param(4, [("take", 3), ("resize", 6)], 6, 3, id="grow-while-busy"),
    # shrink 4 -> 2 with 3 taken: 1 - 2 = -1 (one token owed until a give)
    pytest.param(4, [("take", 3), ("resize", 2)], 2, -1, id="shrink-below-used"),
    # after the shrink, giving the 3 back leaves 2 of 2 free
    pytest.param(4, [("take", 3), ("resize", 2), ("give", 3)], 2, 2, id="shrink-then-give"),
]


@pytest.mark.parametrize("tokens, ops, total, free", TOKEN_CASES)
def test_token_pool(tokens, ops, total, free):
    pool = TokenPool(tokens)
    for op, k in ops:
        getattr(pool, op)(k)
    assert (pool.total, pool.total_free) == (total, free)


@pytest.mark.parametrize("tokens, ops, k", [
    pytest.param(0, [], 1, id="no-tokens"),
    pytest.param(2, [], 3, id="more-than-held"),
    pytest.param(2, [("take", 2)], 1, id="all-taken"),
    pytest.param(2, [], 0, id="zero"),
    pytest.param(4, [("take", 3), ("resize", 2)], 1, id="owed-after-shrink"),
])
def test_token_over_allocation(tokens, ops, k):
    pool = TokenPool(tokens)
    for op, n in ops:
        getattr(pool, op)(n)
    free = pool.total_free
    with pytest.raises(OverAllocation, match="API tokens"):
        pool.take(k)
    assert pool.total_free == free


# -- GpuPool ---------------------------------------------------------------------------------------
NODE = GpuNode("g", 4, 80.0, (2, 2))  # GPUs 0,1 in group 0; 2,3 in group 1; 80 GB each


def gpu_pool(ops: list[tuple]) -> tuple[GpuPool, list[int]]:
    """ops: ("place", model, gpus, gb) | ("acquire", i) | ("release", i) | ("evict", i), i = i-th placed replica."""
    pool = GpuPool((NODE,))
    rids: list[int] = []
    for op in ops:
        if op[0] == "place":
            rids.append(pool.place(op[1], "g", op[2], op[3]))
        elif op[0] == "evict":
            pool.evict(rids[op[1]])
        else:
            getattr(pool, op[0])(rids[op[1]], 1.0)  # acquire/release take a time
    return pool, rids


def gpu_view(pool: GpuPool, rids: list[int]) -> dict:
    st = pool.nodes["g"]
    idx = {rid: i for i, rid in enumerate(rids)}
    return {"mem_free": [g.mem_free for g in st.gpus], "busy": [g.busy for g in st.gpus],
            "idle": pool.idle, "idle_in_group": list(st.idle_in_group),
            "ready": {m: sorted(idx[r] for r in rs) for m, rs in pool.ready.items()},
            "resident": sorted(idx[r] for r in pool.replicas)}


GPU_CASES = [
    # nothing resident: 4 idle GPUs, 2 per group
    pytest.param([], {"mem_free": [80, 80, 80, 80], "busy": [False] * 4, "idle": 4, "idle_in_group": [2, 2],
                      "ready": {}, "resident": []}, id="empty"),
    # A (40 GB) on GPU 0: 40 left there; ready at once
    pytest.param([("place", "A", (0,), 40.0)],
                 {"mem_free": [40, 80, 80, 80], "busy": [False] * 4, "idle": 4, "idle_in_group": [2, 2],
                  "ready": {"A": [0]}, "resident": [0]}, id="place"),
    # B (100 GB) on GPUs 2,3: 50 GB per GPU
    pytest.param([("place", "B", (2, 3), 100.0)],
                 {"mem_free": [80, 80, 30, 30], "busy": [False] * 4, "idle": 4, "idle_in_group": [2, 2],
                  "ready": {"B": [0]}, "resident": [0]}, id="place-split-across-gpus"),
    # A on 0 serves: GPU 0 busy, group 0 has 1 idle; A not ready; C beside A on GPU 0 is not ready either
    pytest.param([("place", "A", (0,), 40.0), ("place", "C", (0,), 20.0), ("acquire", 0)],
                 {"mem_free": [20, 80, 80, 80], "busy": [True, False, False, False], "idle": 3,
                  "idle_in_group": [1, 2], "ready": {"A": [], "C": []}, "resident": [0, 1]},
                 id="acquire-makes-gpu-neighbours-unready"),
    # ... and released: both ready again, GPU 0 idle
    pytest.param([("place", "A", (0,), 40.0), ("place", "C", (0,), 20.0), ("acquire", 0), ("release", 0)],
                 {"mem_free": [20, 80, 80, 80], "busy": [False] * 4, "idle": 4, "idle_in_group": [2, 2],
                  "ready": {"A": [0], "C": [1]}, "resident": [0, 1]}, id="release-makes-them-ready"),
    # a second release is a no-op
    pytest.param([("place", "A", (0,), 40.0), ("acquire", 0), ("release", 0), ("release", 0)],
                 {"mem_free": [40, 80, 80, 80], "busy": [False] * 4, "idle": 4, "idle_in_group": [2, 2],
                  "ready": {"A": [0]}, "resident": [0]}, id="release-twice"),
    # A spans GPUs 1,2 (groups 0 and 1) and serves: both groups lose an idle GPU
    pytest.param([("place", "A", (1, 2), 40.0), ("acquire", 0)],
                 {"mem_free": [80, 60, 60, 80], "busy": [False, True, True, False], "idle": 2,
                  "idle_in_group": [1, 1], "ready": {"A": []}, "resident": [0]}, id="acquire-cross-group"),
    # B on 2,3 serving does not touch A's readiness on GPU 0
    pytest.param([("place", "A", (0,), 40.0), ("place", "B", (2, 3), 100.0), ("acquire", 1)],
                 {"mem_free": [40, 80, 30, 30], "busy": [False, False, True, True], "idle": 2,
                  "idle_in_group": [2, 0], "ready": {"A": [0], "B": []}, "resident": [0, 1]},
                 id="acquire-elsewhere-keeps-ready"),
    # A on 0,1 and B on 2,3 both serve: no GPU idle, the node leaves the index of nodes with one
    pytest.param([("place", "A", (0, 1), 40.0), ("place", "B", (2, 3), 100.0), ("acquire", 0), ("acquire", 1)],
                 {"mem_free": [60, 60, 30, 30], "busy": [True] * 4, "idle": 0,
                  "idle_in_group": [0, 0], "ready": {"A": [], "B": []}, "resident": [0, 1]},
                 id="acquire-every-gpu"),
    # ... and one of them ends: back in it
    pytest.param([("place", "A", (0, 1), 40.0), ("place", "B", (2, 3), 100.0), ("acquire", 0), ("acquire", 1),
                  ("release", 1)],
                 {"mem_free": [60, 60, 30, 30], "busy": [True, True, False, False], "idle": 2,
                  "idle_in_group": [0, 2], "ready": {"A": [], "B": [1]}, "resident": [0, 1]},
                 id="release-after-every-gpu"),
    # evict A from GPU 0: its 40 GB come back, it is gone from every set
    pytest.param([("place", "A", (0,), 40.0), ("evict", 0)],
                 {"mem_free": [80, 80, 80, 80], "busy": [False] * 4, "idle": 4, "idle_in_group": [2, 2],
                  "ready": {"A": []}, "resident": []}, id="evict"),
    # exactly full: two 40 GB replicas on GPU 0
    pytest.param([("place", "A", (0,), 40.0), ("place", "A", (0,), 40.0)],
                 {"mem_free": [0, 80, 80, 80], "busy": [False] * 4, "idle": 4, "idle_in_group": [2, 2],
                  "ready": {"A": [0, 1]}, "resident": [0, 1]}, id="exactly-full"),
]


@pytest.mark.parametrize("ops, want", GPU_CASES)
def test_gpu_pool(ops, want):
    pool, rids = gpu_pool(ops)
    assert gpu_view(pool, rids) == want
    assert pool.nodes["g"].most_idle == max(want["idle_in_group"])  # what the load site search reads per node
    assert list(pool.idle_nodes) == (["g"] if want["idle"] else [])  # the nodes it visits where few are idle


def test_gpu_cross_group_flag_and_by_model():
    pool, rids = gpu_pool([("place", "A", (1, 2), 40.0), ("place", "A", (2, 3), 40.0)])
    assert [pool.replicas[r].cross_group for r in rids] == [True, False]  # 1,2 span groups; 2,3 do not
    assert list(pool.by_model["A"]) == rids
    pool.place("B", "g", (0,), 10.0)
    pool.evict(rids[0])
    assert pool.widest == {"A": 2, "B": 1}  # a bound on a model's replica size (_ready_replica), never lowered


GPU_ERRORS = [
    # 90 GB on one 80 GB GPU
    pytest.param([], ("place", "A", (0,), 90.0), "GPU 0 has 80 GB free, needs 90", id="place-too-big"),
    # 40 resident on GPU 0, 50 more does not fit; split over 0,1 the share is 25 each: that would fit, so 0 alone
    pytest.param([("place", "A", (0,), 40.0)], ("place", "B", (0,), 50.0), "GPU 0 has 40 GB free", id="place-full"),
    # 2 x 45 GB on GPUs 0,1 (share 45): GPU 1 is empty, GPU 0 holds 40 -> 40 < 45
    pytest.param([("place", "A", (0,), 40.0)], ("place", "B", (0, 1), 90.0), "GPU 0", id="place-split-one-short"),
    pytest.param([("place", "A", (0,), 40.0), ("acquire", 0)], ("acquire", 0), "is not free", id="acquire-twice"),
    # C shares GPU 0 with A, which serves: C cannot serve
    pytest.param([("place", "A", (0,), 40.0), ("place", "C", (0,), 20.0), ("acquire", 0)], ("acquire", 1),
                 "is not free", id="acquire-on-busy-gpu"),
    pytest.param([("place", "A", (0,), 40.0), ("acquire", 0)], ("evict", 0), "serving an action", id="evict-busy"),
]


@pytest.mark.parametrize("ops, bad, message", GPU_ERRORS)
def test_gpu_over_allocation(ops, bad, message):
    pool, rids = gpu_pool(ops)
    before = gpu_view(pool, rids)
    with pytest.raises(OverAllocation, match=message):
        if bad[0] == "place":
            pool.place(bad[1], "g", bad[2], bad[3])
        else:
            getattr(pool, bad[0])(rids[bad[1]], 2.0) if bad[0] == "acquire" else getattr(pool, bad[0])(rids[bad[1]])
    assert gpu_view(pool, rids) == before, "a refused change changes nothing"


EVICTION_CASES = [
    # A 40 on GPU 0, need 60 there: evicting A (first in order) frees 80
    pytest.param([("place", "A", (0,), 40.0)], (0,), 60.0, [0], [0], id="evict-one"),
    # room already: nothing to evict
    pytest.param([("place", "A", (0,), 40.0)], (0,), 40.0, [0], [], id="already-room"),
    # A 40 and C 30 on GPU 0 (10 free); need 45: order [C, A]: C first frees 30 -> 40 < 45, then A -> 80
    pytest.param([("place", "A", (0,), 40.0), ("place", "C", (0,), 30.0)], (0,), 45.0, [1, 0], [1, 0],
                 id="in-the-given-order"),
    # same, need 35: evicting C alone (10 + 30 = 40) is enough
    pytest.param([("place", "A", (0,), 40.0), ("place", "C", (0,), 30.0)], (0,), 35.0, [1, 0], [1],
                 id="stops-when-enough"),
    # A serving: it cannot be evicted; C alone frees 30 -> 40 < 70: impossible
    pytest.param([("place", "A", (0,), 40.0), ("place", "C", (0,), 30.0), ("acquire", 0)], (0,), 70.0, [0, 1],
                 None, id="busy-replica-skipped-impossible"),
    # B on GPU 3 is not on the GPUs asked for: never evicted for GPU 0
    pytest.param([("place", "A", (0,), 40.0), ("place", "B", (3,), 80.0)], (0,), 60.0, [1, 0], [0],
                 id="other-gpus-untouched"),
    # need 50 on GPUs 0 and 1: A (40 on 0) and D (70 on 1) both go
    pytest.param([("place", "A", (0,), 40.0), ("place", "D", (1,), 70.0)], (0, 1), 50.0, [0, 1], [0, 1],
                 id="two-gpus"),
    # need more than a GPU has: impossible whatever is evicted
    pytest.param([("place", "A", (0,), 40.0)], (0,), 81.0, [0], None, id="more-than-a-gpu"),
]


@pytest.mark.parametrize("ops, gpus, share, order, plan", EVICTION_CASES)
def test_eviction_plan(ops, gpus, share, order, plan):
    pool, rids = gpu_pool(ops)
    before = gpu_view(pool, rids)
    got = pool.eviction_plan("g", gpus, share, [rids[i] for i in order])
    assert (None if got is None else [rids.index(r) for r in got]) == plan
    assert gpu_view(pool, rids) == before, "planning changes nothing"


def test_gpu_remove_and_initial():
    pool = GpuPool((NODE, GpuNode("h", 2, 40.0, (2,))))
    pool.initial([ReplicaSpec("A", "g", (0,)), ReplicaSpec("A", "h", (0, 1)), ReplicaSpec("A", "gone", (0,))],
                  {"A": type("M", (), {"gpu_memory_gb": 40.0})()})
    assert len(pool.replicas) == 2  # the replica on an unknown node is skipped
    (rid_h,) = [r for r, rep in pool.replicas.items() if rep.node == "h"]
    pool.acquire(rid_h, 1.0)
    assert (pool.total, pool.idle) == (6, 4)
    assert pool.remove("h") == [rid_h]
    # h's 2 GPUs leave the total; both were busy, so idle stays 4 (g's)
    assert (pool.total, pool.idle, list(pool.by_model["A"]), list(pool.ready["A"])) == (4, 4, [0], [0])
    pool.release(rid_h, 2.0)  # the replica's node left: harmless
    assert (list(pool.idle_nodes), pool.order) == (["g"], {"g": 0})
    pool.add(GpuNode("h", 2, 40.0, (2,)))  # back: after g in node order, as in ``nodes``
    assert (list(pool.idle_nodes), pool.order, list(pool.nodes)) == (["g", "h"], {"g": 0, "h": 2}, ["g", "h"])
    with pytest.raises(ValueError, match="already known"):
        pool.add(NODE)


def test_loading_of_counts_background_loads_until_loaded_or_gone():
    """``loading_of`` (read on every GPU pass) is a count kept by ``begin_load``, ``loaded`` and ``remove``."""
    pool = GpuPool((NODE, GpuNode("h", 2, 80.0, (2,))))
    a0, a1, b0 = (pool.place("A", "g", (0,), 40.0), pool.place("A", "h", (0,), 40.0), pool.place("B", "g", (2,), 40.0))
    for rid in (a0, a1, b0):
        pool.begin_load(rid, 1.0)
    assert (pool.loading_of("A"), pool.loading_of("B"), pool.loading_of("C")) == (2, 1, 0)
    assert pool.loaded(a0, 2.0) and not pool.loaded(a0, 2.0)  # a second ``loaded`` is not a load's end
    assert pool.loading_of("A") == 1
    pool.remove("h")  # a1 was loading there
    assert (pool.loading_of("A"), pool.loading_of("B")) == (0, 1)
    assert [rid for rid, r in pool.replicas.items() if r.loading] == [b0]


def test_a_measured_model_size_resizes_its_replicas_shares():
    """``resize``: a replica placed at the declared 10 GB takes its measured 30 GB on each GPU's ledger; a GPU
    whose declared free room is no longer there reads below 0 and takes nothing more until it frees."""
    g = GpuPool((GpuNode("g", 2, 40.0, (2,)),))
    a = g.place("a", "g", (0,), 10.0)
    b = g.place("b", "g", (0,), 20.0)
    big = g.place("big", "g", (0, 1), 20.0)  # 10 GB on each GPU
    g.resize("a", 30.0)
    assert g.replicas[a].share_gb == 30.0 and g.nodes["g"].gpus[0].mem_free == pytest.approx(40 - 30 - 20 - 10)
    g.resize("big", 40.0)
    assert g.replicas[big].share_gb == 20.0 and g.nodes["g"].gpus[1].mem_free == pytest.approx(20.0)
    with pytest.raises(OverAllocation):
        g.place("c", "g", (0,), 1.0)
    g.evict(a)
    g.evict(b)
    assert g.nodes["g"].gpus[0].mem_free == pytest.approx(20.0)  # the ledger matches what is held again
    g.resize("big", 8.0)  # declared larger than it is: the room it does not take is free again
    assert g.nodes["g"].gpus[0].mem_free == pytest.approx(36.0) == g.nodes["g"].gpus[1].mem_free
    g.resize("nobody", 1.0)  # a model with no replica: nothing to do


# -- cordon (a paused worker: nothing new placed there, what runs there releases as usual) -----------------------
def test_a_cordoned_cpu_node_shows_no_room_and_holds_what_frees_there():
    pool = cpu_pool([("a", 2, 1), ("b", 3, 0)], [("take", "a", 2)])  # a: 3 units (2 slots + 1 ahead), 1 free
    assert pool.cordon("a") and not pool.cordon("a") and not pool.cordon("nope")
    # a's free unit is held: b is the only node with room, whatever is asked
    assert cpu_view(pool) == {"free": {"a": 0, "b": 3}, "max_free": 3, "most_free": "b", "total": 6,
                              "total_free": 3, "slots": 5, "slots_free": 3}  # b's 3: a's ahead unit is held
    assert pool.open_largest == 3
    assert pool.first_fit(1) == pool.fit_node(1) == "b" and pool.fit_node(1, skip={"b": None}) is None
    pool.give("a", 2)  # the action running there ends: its units go to the hold, not to placement
    assert pool.free["a"] == 0 and pool.held == {"a": 3} and pool.total_free == 3
    with pytest.raises(OverAllocation, match="would exceed capacity 3"):
        pool.give("a", 1)  # the hold counts toward capacity: no unit is counted twice
    with pytest.raises(OverAllocation):
        pool.take("a", 1)
    assert pool.uncordon("a") and not pool.uncordon("a")
    # (a tie: the node whose units freed last comes last, as after any give)
    assert cpu_view(pool) == {"free": {"a": 3, "b": 3}, "max_free": 3, "most_free": "b", "total": 6,
                              "total_free": 6, "slots": 5, "slots_free": 5}
    assert pool.open_largest == 3
    pool.cordon("b")
    assert pool.open_largest == 2 and pool.slots_free == 2
    pool.remove("b")  # a cordoned node may leave
    assert pool.held == {} and pool.total == 3 and pool.total_free == 3 and pool.slots_free == 2


def test_a_cordoned_gpu_node_has_no_ready_replica_and_no_idle_gpu_until_uncordoned():
    pool, rids = gpu_pool([("place", "A", (0,), 40.0), ("place", "B", (2, 3), 100.0), ("acquire", 1)])
    assert pool.cordon("g") and not pool.cordon("g") and not pool.cordon("nope")
    assert gpu_view(pool, rids) == {"mem_free": [40, 80, 30, 30], "busy": [True] * 4, "idle": 0,
                                    "idle_in_group": [0, 0], "ready": {"A": [], "B": []}, "resident": [0, 1]}
    assert pool.nodes["g"].most_idle == 0 and not pool.idle_nodes
    with pytest.raises(OverAllocation, match="is not free"):
        pool.acquire(rids[0], 2.0)
    pool.release(rids[1], 2.0)  # B's action ends: B is idle, its GPUs stay held
    assert not pool.replicas[rids[1]].busy
    assert gpu_view(pool, rids)["busy"] == [True] * 4 and pool.idle == 0 and pool.ready["B"] == {}
    assert pool.uncordon("g") and not pool.uncordon("g")
    assert gpu_view(pool, rids) == {"mem_free": [40, 80, 30, 30], "busy": [False] * 4, "idle": 4,
                                    "idle_in_group": [2, 2], "ready": {"A": [0], "B": [1]}, "resident": [0, 1]}
    assert pool.nodes["g"].most_idle == 2 and list(pool.idle_nodes) == ["g"]
    pool.cordon("g")
    pool.remove("g")
    assert pool.idle == 0 and pool.total == 0
