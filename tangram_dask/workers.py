"""What a worker declares to the tangram scheduler plugin, and the worker side of the plugin.

A worker offers one of:

- **sandbox slots** (a CPU node): ``dask worker --resources slots=8`` or the
  config key ``tangram.worker.slots``;
- **GPUs** (a GPU node) with their topology groups and memory: discovered
  through NVML (``pynvml``) where it is present, groups from NVLink and from
  the PCIe common-ancestor query; otherwise from config
  (``tangram.worker.gpus``, ``tangram.worker.gpu-memory-gb``,
  ``tangram.worker.gpu-groups``) or ``--resources gpus=4``, with one log line
  saying so. ``tangram.worker.nvml: false`` skips discovery (abstract GPUs);
- **API calls** (``--resources api=N`` or ``tangram.worker.api: N``): the
  worker may run that many API actions at once. The API quota itself (tokens)
  is held by the scheduler, not by workers.

:class:`TangramWorkerPlugin` is installed on every worker by the scheduler
plugin (one feature, one name: ``"tangram"``). Its ``setup`` sends the
declaration to the scheduler; its ``transition`` hook sets
``CUDA_VISIBLE_DEVICES`` for a GPU action as it starts executing.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import dask
from distributed.diagnostics.plugin import WorkerPlugin

from . import config as _config  # noqa: F401  (registers the tangram: defaults)
from .messages import DECLARE_HANDLER, WorkerDeclaration

logger = logging.getLogger("tangram_dask.workers")

#: The name shared by the scheduler plugin and its worker plugin.
PLUGIN_NAME = "tangram"

# NVML topology levels (nvmlGpuTopologyLevel_t): 0 internal, 10 single PCIe
# switch, 20 multiple switches, 30 host bridge, 40 NUMA node, 50 system.
_SAME_SWITCH = 20


def groups_from_links(n: int, linked: Callable[[int, int], bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Topology groups of ``n`` GPUs from a pairwise "well connected" test.

    Returns ``(group sizes, order)``: the policy numbers GPUs ``0..n-1`` group
    by group (``order[i]`` is the device index of policy GPU ``i``), because a
    GPU node's groups are contiguous runs of indices.
    """
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            if linked(i, j):
                parent[find(j)] = find(i)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    ordered = sorted(groups.values(), key=lambda g: g[0])
    return tuple(len(g) for g in ordered), tuple(i for g in ordered for i in g)


def discover_gpus() -> tuple[WorkerDeclaration | None, str]:
    """GPUs through NVML: ``(declaration, "")``, or ``(None, why not)``."""
    try:
        import pynvml
    except ImportError as e:  # a dependency, but a worker image may lack it
        return None, f"pynvml is not importable ({e})"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded...
        return None, f"NVML is not available ({type(e).__name__})"
    try:
        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            return None, "NVML found no GPU"
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        mem_gb = min(pynvml.nvmlDeviceGetMemoryInfo(h).total for h in handles) / 1e9
        pci = [pynvml.nvmlDeviceGetPciInfo(h).busId for h in handles]
        nvlink: set[tuple[int, int]] = set()
        for i, h in enumerate(handles):
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
                except Exception:  # no such link, or no NVLink on this GPU
                    break
                if remote in pci:
                    j = pci.index(remote)
                    nvlink.add((min(i, j), max(i, j)))

        def linked(i: int, j: int) -> bool:
            if (i, j) in nvlink:
                return True
            if nvlink:  # NVLink islands define the groups where NVLink exists
                return False
            try:
                level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
            except Exception:
                return False
            return level <= _SAME_SWITCH

        groups, order = groups_from_links(n, linked)
        return WorkerDeclaration(gpus=n, gpu_memory_gb=round(mem_gb, 2), groups=groups, source="nvml",
                                 device_ids=order), ""
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def declare(resources: dict[str, float], config: Any = None) -> WorkerDeclaration:
    """What this worker offers, from its Dask resources, NVML and the ``tangram.worker`` config."""
    raw = config if config is not None else dask.config.get("tangram.worker", default={}) or {}
    cfg = {str(k).replace("_", "-"): v for k, v in raw.items()}  # DASK_TANGRAM__WORKER__GPU_GROUPS too
    slots = int(resources.get("slots", cfg.get("slots", 0)) or 0)
    api = int(resources.get("api", cfg.get("api", 0)) or 0)
    want_gpus = int(cfg.get("gpus", resources.get("gpus", 0)) or 0)
    use_nvml = cfg.get("nvml", True)
    if use_nvml:
        found, why = discover_gpus()
        if found is not None:
            logger.info("tangram: %d GPUs from NVML, groups %s, %.0f GB each", found.gpus, list(found.groups),
                        found.gpu_memory_gb)
            return WorkerDeclaration(slots, found.gpus, found.gpu_memory_gb, found.groups, api, "nvml",
                                     found.device_ids)
    else:
        why = "tangram.worker.nvml is false"
    if not want_gpus:
        return WorkerDeclaration(slots=slots, api=api, source="resources")
    groups = tuple(int(g) for g in cfg.get("gpu-groups", None) or (want_gpus,))
    mem = float(cfg.get("gpu-memory-gb", 80.0))
    source = "config" if "gpus" in cfg else "resources"
    logger.info("tangram: %s; %d GPUs declared from %s: groups %s, %g GB each (set tangram.worker.gpus, "
                "gpu-groups, gpu-memory-gb to change)", why, want_gpus, source, list(groups), mem)
    return WorkerDeclaration(slots, want_gpus, mem, groups, api, source)


class TangramWorkerPlugin(WorkerPlugin):
    """The worker side of the tangram plugin: declares, and sets CUDA_VISIBLE_DEVICES.

    ``CUDA_VISIBLE_DEVICES`` is process-wide: it is set as a GPU action starts
    executing and is exact when one GPU action runs per worker process at a
    time (``nthreads=1``, or one worker per GPU group). With several GPU
    actions in one process, pass ``current_allocation().env()`` to the
    subprocess or server the action launches instead.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.worker: Any = None
        self.declaration: WorkerDeclaration | None = None

    async def setup(self, worker: Any) -> None:
        self.worker = worker
        self.declaration = decl = declare(dict(worker.state.total_resources))
        try:
            rpc = getattr(worker.scheduler, DECLARE_HANDLER)
            await rpc(worker=worker.contact_address, declaration=decl.to_msg())
        except Exception:  # the scheduler has no tangram plugin: nothing to declare to
            logger.warning("tangram: could not declare this worker to the scheduler", exc_info=True)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if finish != "executing" or self.declaration is None or not self.declaration.gpus:
            return
        ts = self.worker.state.tasks.get(key)
        ann = (ts.annotations or {}).get("tangram") if ts is not None else None
        grant = ann.get("grant") if isinstance(ann, dict) else None
        if grant and grant.get("gpus"):
            ids = grant.get("device_ids") or grant["gpus"]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in ids)

