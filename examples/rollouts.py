"""One RL step of rollouts, as an asyncio RL framework runs them: admission, tool calls, a reward.

    python examples/rollouts.py [--arrival-order]

The step's trajectories are queued for admission in one call (``expect_trajectories``), each with what
the framework knows of its prompt's length from the last epoch. Each rollout then waits for its
admission (``begin_trajectory``), alternates an LLM turn (here a sleep) with a tool call (an action),
ends with a reward action, and says it is over (``end_trajectory``). With ``admit_long`` the gate admits
the long ones first, so the step does not end with a long trajectory admitted last; ``--arrival-order``
runs the same step without it. Prints the order of admission (the scheduler's ``tangram-admission``
events), then the step's length.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask.policy import TangramOptions

LLM_S = 0.1  # the policy model writing its next tool call
# prompt -> its turns; the framework's record of the last epoch says how long each took
PROMPTS = {f"p{i}": 2 for i in range(9)} | {"p9": 10, "p10": 10, "p11": 10}


def run_tests(prompt: str, turn: int) -> bool:
    time.sleep(0.05)  # stands for the tool's work
    return turn % 3 == 2


def reward(prompt: str, passed: int) -> float:
    return passed / max(PROMPTS[prompt], 1)


async def rollout(client: Client, prompt: str) -> float:
    await tangram_dask.begin_trajectory(client, prompt)  # returns once the gate admits it
    passed = 0
    for turn in range(PROMPTS[prompt]):
        await asyncio.sleep(LLM_S)
        with tangram_dask.action(kind="run_tests", resource="cpu", units=1, hint_s=0.05, trajectory=prompt):
            fut = client.submit(run_tests, prompt, turn, pure=False)
        passed += await fut
    with tangram_dask.action(kind="reward", resource="cpu", units=1, hint_s=0.01, trajectory=prompt):
        fut = client.submit(reward, prompt, passed, pure=False)
    score = await fut
    await tangram_dask.end_trajectory(client, prompt)
    return score


async def main(arrival_order: bool) -> None:
    # by default (admit_long) the gate admits the long ones first and, once they go first, holds fewer in
    # flight (docs/scheduling.md); admit_long=0 ignores the expectations
    options = TangramOptions(admit_long=0) if arrival_order else TangramOptions()
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=options)
    async with LocalCluster(n_workers=2, threads_per_worker=2, resources={"slots": 2}, dashboard_address=":0",
                            asynchronous=True, scheduler_kwargs={"plugins": [plugin]}) as cluster:
        async with Client(cluster, asynchronous=True) as client:
            await client.wait_for_workers(2)
            last_epoch = {p: turns * (LLM_S + 0.05) for p, turns in PROMPTS.items()}  # seconds, per prompt
            await tangram_dask.expect_trajectories(client, last_epoch)
            t0 = time.perf_counter()
            scores = await asyncio.gather(*(rollout(client, p) for p in PROMPTS))
            step_s = time.perf_counter() - t0
            # the scheduler logs each admission (topic "tangram"), with how long the trajectory waited
            events = [m for _, m in await client.get_events("tangram") if m["action"] == "tangram-admission"]
    print("admitted in order:", " ".join(m["trajectory"] for m in events))
    print(f"step: {step_s:.2f} s for {len(scores)} trajectories, mean reward {sum(scores) / len(scores):.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arrival-order", action="store_true", help="admit in the order named (admit_long off)")
    asyncio.run(main(ap.parse_args().arrival_order))
