"""What watching costs the scheduler: CPU per action with the Tangram page open and ``/metrics``
scraped every second, against nobody watching, in the same run.

A real ``dask scheduler --preload scheduler_plugin`` process and one ``dask worker``
process (2 slots); this process submits rounds of no-op CPU actions and reads the
scheduler's CPU time (user + system, from /proc through psutil) around each
round. Modes, alternated round by round so that load from elsewhere on the
machine falls on all of them alike:

- ``bare``: the dashboard's monitor plugin (action timing, decision events) taken out;
- ``idle``: installed as shipped, nobody watching (what every scheduler pays);
- ``watched``: ``idle`` plus the ``/tangram`` page open in headless chromium
  (updating every second) and ``/metrics`` scraped every second;
- with ``--split``, also ``page`` (the page alone) and ``metrics`` (the scrapes alone).

Prints the median scheduler CPU per action of each mode and the ratios
``watched / idle`` (the issue's target: under 1.10) and ``idle / bare``.

    python benchmarks/dashboard_cost.py [--actions 1500] [--rounds 5] [--split]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
from distributed import Client

import tangram_dask

ROOT = Path(__file__).resolve().parents[1]
CHROME_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", "--window-size=1500,1250")


def noop(i: int) -> int:
    return i


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _monitor(dask_scheduler, on: bool) -> bool:  # runs on the scheduler
    import tangram_dask.dashboard.monitor as m
    name = m.TangramMonitor.name
    if on and name not in dask_scheduler.plugins:
        dask_scheduler.add_plugin(dask_scheduler.tangram_bench_monitor)
    elif not on and name in dask_scheduler.plugins:
        dask_scheduler.tangram_bench_monitor = dask_scheduler.plugins[name]
        dask_scheduler.remove_plugin(name=name)
    return name in dask_scheduler.plugins


def _browser():
    from selenium import webdriver
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for a in CHROME_ARGS:
        opts.add_argument(a)
    opts.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='tangram-bench-')}")
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actions", type=int, default=1500, help="actions per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per mode")
    ap.add_argument("--split", action="store_true", help="also the page alone and /metrics alone")
    args = ap.parse_args()
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        sys.exit("chromium and chromium-driver are needed (apt-get install chromium chromium-driver)")
    port, dash = _port(), _port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    tmp = tempfile.mkdtemp(prefix="tangram-bench-")
    sched = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                              "--port", str(port), "--dashboard-address", f"127.0.0.1:{dash}",
                              "--preload", "scheduler_plugin"], env=env, cwd=tmp,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    addr = f"tcp://127.0.0.1:{port}"
    worker = None
    drv = None
    try:
        time.sleep(2)
        worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", addr, "--nthreads", "2",
                                   "--resources", "slots=2", "--no-dashboard", "--memory-limit", "0"], env=env,
                                  cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = Client(addr, timeout=30)
        client.wait_for_workers(1, timeout=30)
        proc = psutil.Process(sched.pid)
        url = f"http://127.0.0.1:{dash}"
        drv = _browser()
        scraping = threading.Event()
        stop = threading.Event()
        scrapes = [0]

        def scraper() -> None:
            while not stop.is_set():
                if scraping.is_set():
                    urllib.request.urlopen(url + "/metrics", timeout=10).read()
                    scrapes[0] += 1
                stop.wait(1.0)

        threading.Thread(target=scraper, daemon=True).start()

        def one_round() -> tuple[float, float]:
            c0 = sum(proc.cpu_times()[:2])
            t0 = time.perf_counter()
            with tangram_dask.action(kind="noop", resource="cpu", units=1, hint_s=0.001):
                futs = client.map(noop, range(args.actions), pure=False)
            client.gather(futs)
            del futs
            return (sum(proc.cpu_times()[:2]) - c0) / args.actions, time.perf_counter() - t0

        one_round()  # warm-up: imports, first sessions
        modes = ["bare", "idle", "watched"] + (["page", "metrics"] if args.split else [])
        res: dict[str, list[float]] = {m: [] for m in modes}
        walls: dict[str, list[float]] = {k: [] for k in res}
        for _ in range(args.rounds):
            for mode in res:
                client.run_on_scheduler(_monitor, on=mode != "bare")
                if mode in ("watched", "page"):
                    drv.get(url + "/tangram")
                else:
                    drv.get("about:blank")  # closes the page's session
                time.sleep(2.0)  # the page connects and starts its periodic updates, or its session closes
                if mode in ("watched", "metrics"):
                    scraping.set()
                else:
                    scraping.clear()
                cpu, wall = one_round()
                res[mode].append(cpu)
                walls[mode].append(wall)
        stop.set()
        med = {m: statistics.median(v) for m, v in res.items()}
        print(f"{args.actions} no-op actions per round, {args.rounds} rounds per mode, scheduler CPU per action "
              f"(median; all rounds in us):")
        for m in res:
            print(f"  {m:8s} {med[m] * 1e6:7.1f} us   rounds {[round(x * 1e6) for x in res[m]]}   "
                  f"wall per round {statistics.median(walls[m]):.2f} s")
        print(f"watched / idle = {med['watched'] / med['idle']:.3f}   idle / bare = {med['idle'] / med['bare']:.3f}"
              f"   (/metrics scraped {scrapes[0]} times)")
        if args.split:
            print(f"page / idle = {med['page'] / med['idle']:.3f}   "
                  f"metrics / idle = {med['metrics'] / med['idle']:.3f}")
        client.close()
    finally:
        if drv is not None:
            drv.quit()
        for p in (worker, sched):
            if p is not None:
                p.terminate()
                p.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
