"""What a worker declares to the tangram scheduler plugin, and the worker side of the plugin.

A worker offers one of:

- **sandbox slots** (a CPU node): ``dask worker --resources slots=8`` or the
  config key ``tangram.worker.slots``;
- **GPUs** (a GPU node) with their topology groups and memory: discovered
  through NVML (``nvidia-ml-py``, module ``pynvml``) where it is present,
  restricted to the devices the worker's launch-time ``CUDA_VISIBLE_DEVICES``
  names (indices, ``GPU-`` UUIDs or ``MIG-`` UUIDs), groups from NVLink and
  from the PCIe common-ancestor query; otherwise from config
  (``tangram.worker.gpus`` with ``tangram.worker.gpu-memory-gb``, and
  ``tangram.worker.gpu-groups``) or ``--resources gpus=N`` with
  ``gpu-memory-gb``, with one log line saying so. ``tangram.worker.nvml:
  false`` skips discovery (abstract GPUs: the tests and CPU-only machines);
- **API calls** (``--resources api=N`` or ``tangram.worker.api: N``): the
  worker may run that many API actions at once. The API quota itself (tokens)
  is held by the scheduler, not by workers.

:class:`TangramWorkerPlugin` is installed on every worker by the scheduler
plugin (one feature, one name: ``"tangram"``). Its ``setup`` validates the
``tangram.worker`` config, sends the declaration to the scheduler and, on a
GPU worker, starts the reward-model residency (:mod:`tangram_dask.models`);
its ``transition`` hook sets ``CUDA_VISIBLE_DEVICES`` for a GPU action as it
starts executing and pins, loads and releases the replica the grant names.

Device numbering: NVML numbers GPUs in PCI bus order, CUDA by default
"fastest first". The plugin sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` in the
worker process (unless already set) so that the grant's device ids, which are
NVML indices, mean the same GPUs to CUDA; ``CUDA_VISIBLE_DEVICES`` is written
with the GPUs' UUIDs where NVML gave them, which needs no ordering at all.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from distributed.diagnostics.plugin import WorkerPlugin

from . import config as _config
from .annotate import ANNOTATION
from .errors import ConfigError
from .messages import DECLARE_HANDLER, GRANT_KEY, STARTED_HANDLER, UNSTARTED_HANDLER, WorkerDeclaration, granted

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


def parse_visible_devices(value: str | None) -> list[int | str] | None:
    """The launch-time ``CUDA_VISIBLE_DEVICES``: None when unset, else its entries.

    Entries are device indices or ``GPU-``/``MIG-`` UUIDs (a unique prefix of a
    UUID is enough, as for CUDA). An empty value means no GPU is visible.
    Anything else is a :class:`~tangram_dask.errors.ConfigError` naming it
    (CUDA itself would silently hide every device from that entry on).
    """
    if value is None:
        return None
    out: list[int | str] = []
    for raw in value.split(","):
        tok = raw.strip()
        if not tok:
            continue
        if tok.lstrip("-").isdigit():
            if int(tok) < 0:
                break  # CUDA: a negative index hides every device from it on
            out.append(int(tok))
        elif tok.startswith(("GPU-", "MIG-")):
            out.append(tok)
        else:
            raise ConfigError("CUDA_VISIBLE_DEVICES", value,
                              f"entry {tok!r} is neither a device index nor a GPU-/MIG- UUID "
                              f"(set it to e.g. '0,1' or 'GPU-<uuid>')")
    return out


def _key(k: Any) -> Any:
    """A task key as sent over msgpack (tuples arrive as lists) back to its own form."""
    return tuple(_key(x) for x in k) if isinstance(k, list) else k


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class GpuFacts:
    """What NVML says about the GPUs this worker process may use.

    ``declaration``: what the scheduler is told. ``cuda_ordinals[i]``: the CUDA
    ordinal of policy GPU ``i`` inside this process (its position among the
    visible devices), what ``torch.device("cuda", k)`` takes.
    ``memory_bytes[i]``: the total memory of policy GPU ``i``.
    """

    declaration: WorkerDeclaration
    cuda_ordinals: tuple[int, ...]
    memory_bytes: tuple[int, ...]
    names: tuple[str, ...] = ()


def discover(visible: str | None = None, *, nvml: Any = None, env: bool = True) -> tuple[GpuFacts | None, str]:
    """GPUs through NVML: ``(facts, "")``, or ``(None, why not)``.

    ``visible`` is the ``CUDA_VISIBLE_DEVICES`` value to honour (by default the
    process's own, read when ``env`` is true). ``nvml`` replaces the ``pynvml``
    module (tests give a fake one where no GPU exists).
    """
    if visible is None and env:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = parse_visible_devices(visible)
    if wanted == []:
        return None, f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU"
    if nvml is None:
        try:
            import pynvml as nvml  # the nvidia-ml-py package
        except ImportError as e:  # a dependency, but a worker image may lack it
            return None, f"pynvml (nvidia-ml-py) is not importable ({e})"
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded...
        return None, f"NVML is not available ({type(e).__name__})"
    try:
        n = nvml.nvmlDeviceGetCount()
        if n == 0:
            return None, "NVML found no GPU"
        all_handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        all_uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in all_handles]
        # (handle, NVML index of the physical GPU, UUID) of each visible device, in CUDA's order
        chosen: list[tuple[Any, int, str]] = []
        if wanted is None:
            chosen = [(h, i, all_uuids[i]) for i, h in enumerate(all_handles)]
        else:
            for tok in wanted:
                if isinstance(tok, int):
                    if tok >= n:
                        break  # CUDA: an index past the last device hides it and every later entry
                    chosen.append((all_handles[tok], tok, all_uuids[tok]))
                elif tok.startswith("GPU-"):
                    hits = [i for i, u in enumerate(all_uuids) if u.startswith(tok)]
                    if len(hits) != 1:
                        raise ConfigError("CUDA_VISIBLE_DEVICES", visible,
                                          f"{tok!r} matches {len(hits)} of this machine's GPUs {all_uuids}")
                    chosen.append((all_handles[hits[0]], hits[0], all_uuids[hits[0]]))
                else:  # a MIG instance: its own handle and memory; its parent's index
                    try:
                        h = nvml.nvmlDeviceGetHandleByUUID(tok.encode() if isinstance(tok, str) else tok)
                        parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
                        idx = all_handles.index(parent) if parent in all_handles else \
                            all_uuids.index(_text(nvml.nvmlDeviceGetUUID(parent)))
                    except ConfigError:
                        raise
                    except Exception as e:
                        raise ConfigError("CUDA_VISIBLE_DEVICES", visible,
                                          f"MIG device {tok!r} not found through NVML ({type(e).__name__}: {e})")
                    chosen.append((h, idx, tok))
            if len({c[2] for c in chosen}) != len(chosen):
                raise ConfigError("CUDA_VISIBLE_DEVICES", visible, "names one device twice")
            if not chosen:
                return None, f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU this machine has ({n} GPUs)"
        handles = [c[0] for c in chosen]
        k = len(chosen)
        mem = [int(nvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
        mig = [c[2].startswith("MIG-") for c in chosen]
        pci = [_text(nvml.nvmlDeviceGetPciInfo(all_handles[c[1]]).busId) for c in chosen]
        nvlink: set[tuple[int, int]] = set()
        for i, h in enumerate(handles):
            if mig[i]:
                continue
            for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(h, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
                except Exception:  # no such link, or no NVLink on this GPU
                    break
                for j in range(k):
                    if j != i and not mig[j] and pci[j] == remote:
                        nvlink.add((min(i, j), max(i, j)))

        def linked(i: int, j: int) -> bool:
            if mig[i] or mig[j]:
                return False  # a MIG instance is a group of its own
            if (i, j) in nvlink:
                return True
            if nvlink:  # NVLink islands define the groups where NVLink exists
                return False
            try:
                level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
            except Exception:
                return False
            return level <= _SAME_SWITCH

        groups, order = groups_from_links(k, linked)
        names = []
        for i in order:
            try:
                names.append(_text(nvml.nvmlDeviceGetName(handles[i])))
            except Exception:
                names.append("")
        decl = WorkerDeclaration(gpus=k, gpu_memory_gb=round(min(mem) / 1e9, 2), groups=groups, source="nvml",
                                 device_ids=tuple(chosen[i][1] for i in order),
                                 device_uuids=tuple(chosen[i][2] for i in order))
        return GpuFacts(decl, tuple(order), tuple(mem[i] for i in order), tuple(names)), ""
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def discover_gpus() -> tuple[WorkerDeclaration | None, str]:
    """GPUs through NVML (honouring ``CUDA_VISIBLE_DEVICES``): ``(declaration, "")``, or ``(None, why not)``."""
    facts, why = discover()
    return (facts.declaration if facts is not None else None), why


def _worker_config(config: Any) -> dict[str, Any]:
    if config is None:
        return _config.validate("worker")
    return {str(k).replace("_", "-"): v for k, v in dict(config).items()}  # DASK_TANGRAM__WORKER__GPU_GROUPS too


def declare_facts(resources: dict[str, float], config: Any = None, *, nvml: Any = None,
                  visible: str | None = None) -> tuple[WorkerDeclaration, GpuFacts | None]:
    """What this worker offers (and NVML's facts, when its GPUs came from NVML).

    ``config`` is the ``tangram.worker`` mapping (default: the validated dask
    config). GPUs: NVML unless ``nvml: false``; else ``tangram.worker.gpus``
    or ``--resources gpus=N``, which need ``tangram.worker.gpu-memory-gb``.
    A worker that declares sandbox slots or API tokens and no GPUs is a CPU
    worker: NVML is not asked (on a GPU host it would find the GPU workers' GPUs).
    """
    cfg = _worker_config(config)
    slots = int(resources.get("slots", 0) or cfg.get("slots", 0) or 0)
    api = int(resources.get("api", 0) or cfg.get("api", 0) or 0)
    res_gpus = int(resources.get("gpus", 0) or 0)
    cfg_gpus = int(cfg.get("gpus", 0) or 0)
    want_gpus = cfg_gpus or res_gpus
    if (slots or api) and not want_gpus:
        # A sandbox or API worker on a GPU host: NVML would find the host's GPUs on every worker there (each
        # CPU worker claiming them all, and the plugin taking each for a GPU node, its slots unused). The GPUs
        # are the GPU workers' (--resources gpus=N, tangram.worker.gpus, or a worker that declares nothing).
        logger.info("tangram: a CPU worker (%d sandbox slots, %d API tokens, no GPUs declared): NVML is not "
                    "asked for this host's GPUs", slots, api)
        return WorkerDeclaration(slots=slots, api=api, source="resources"), None
    if cfg.get("nvml", True):
        facts, why = discover(visible, nvml=nvml, env=visible is None)
        if facts is not None:
            d = facts.declaration
            frac = float(cfg.get("gpu-memory-fraction", 0.9))
            if not 0 < frac <= 1:
                raise ConfigError("tangram.worker.gpu-memory-fraction", frac, "must be in (0, 1]")
            mem = round(d.gpu_memory_gb * frac, 2)
            logger.info("tangram: %d GPUs from NVML (devices %s), groups %s, %.1f GB each, %.1f GB of it for "
                        "models (tangram.worker.gpu-memory-fraction = %g)", d.gpus, list(d.device_ids),
                        list(d.groups), d.gpu_memory_gb, mem, frac)
            if res_gpus and res_gpus != d.gpus:
                logger.warning("tangram: --resources gpus=%d but NVML finds %d usable GPUs here; the scheduler "
                               "is told %d (give --resources gpus=%d)", res_gpus, d.gpus, d.gpus, d.gpus)
            return WorkerDeclaration(slots, d.gpus, mem, d.groups, api, "nvml", d.device_ids,
                                     d.device_uuids), facts
    else:
        why = "tangram.worker.nvml is false"
    if not want_gpus:
        return WorkerDeclaration(slots=slots, api=api, source="resources"), None
    source = "config" if cfg_gpus else "resources"
    mem = cfg.get("gpu-memory-gb")
    if mem is None:
        key = "tangram.worker.gpus" if cfg_gpus else "--resources gpus"
        raise ConfigError("tangram.worker.gpu-memory-gb", None,
                          f"{key} = {want_gpus} without NVML ({why}) needs the memory of each GPU: set "
                          f"tangram.worker.gpu-memory-gb (DASK_TANGRAM__WORKER__GPU_MEMORY_GB)")
    try:
        mem = float(mem)
    except (TypeError, ValueError):
        raise ConfigError("tangram.worker.gpu-memory-gb", mem, "must be a number of GB") from None
    if not mem > 0:
        raise ConfigError("tangram.worker.gpu-memory-gb", mem, "must be > 0")
    raw_groups = cfg.get("gpu-groups") or (want_gpus,)
    groups = tuple(int(g) for g in raw_groups)
    if sum(groups) != want_gpus or min(groups) < 1:
        raise ConfigError("tangram.worker.gpu-groups", list(raw_groups),
                          f"group sizes must be >= 1 and sum to the {want_gpus} GPUs declared")
    if res_gpus and cfg_gpus and res_gpus != cfg_gpus:
        logger.warning("tangram: --resources gpus=%d but tangram.worker.gpus=%d; the scheduler is told %d",
                       res_gpus, cfg_gpus, cfg_gpus)
    logger.info("tangram: %s; %d GPUs declared from %s: groups %s, %g GB each (set tangram.worker.gpus, "
                "gpu-groups, gpu-memory-gb to change)", why, want_gpus, source, list(groups), mem)
    return WorkerDeclaration(slots, want_gpus, mem, groups, api, source), None


def abstract_gpus_warning(decl: WorkerDeclaration, count: Callable[[], int] | None = None) -> str | None:
    """Why GPUs declared by config or resources may misbehave on this machine, or None.

    The plugin writes a GPU action's ids into the worker process's ``CUDA_VISIBLE_DEVICES``.
    Where NVML sees fewer GPUs than the declared ids reach, those ids name no device, and
    distributed's own GPU monitor, which reads that variable on every tick, fails each time
    (``NVMLError_InvalidArgument``: seen with 2 GPUs declared on a 1-GPU H200 machine).
    ``count``: NVML's device count as distributed's monitor sees it (0 where it is off).
    """
    if not decl.gpus or decl.source == "nvml":
        return None
    if count is None:
        from distributed.diagnostics import nvml as dnvml
        count = dnvml.device_get_count
    try:
        n = int(count())
    except Exception:  # no NVML: nothing reads the ids but the action's own programs
        return None
    ids = decl.device_ids or tuple(range(decl.gpus))
    if n <= 0 or max(ids) < n:
        return None
    return (f"tangram: {decl.gpus} GPUs declared by {decl.source} (ids {list(ids)}), but NVML sees {n} here: "
            f"an action granted GPU {n} or above gets a CUDA_VISIBLE_DEVICES that names no device, and "
            f"distributed's GPU monitor, which reads it, fails on every tick. Let NVML declare the GPUs "
            f"(tangram.worker.nvml: true), or turn the monitor off (distributed.diagnostics.nvml: false)")


def declare(resources: dict[str, float], config: Any = None, **kw: Any) -> WorkerDeclaration:
    """What this worker offers, from its Dask resources, NVML and the ``tangram.worker`` config."""
    return declare_facts(resources, config, **kw)[0]


class TangramWorkerPlugin(WorkerPlugin):
    """The worker side of the tangram plugin: declares, sets CUDA_VISIBLE_DEVICES, keeps reward models.

    ``CUDA_VISIBLE_DEVICES`` is process-wide: it is set as a GPU action starts
    executing and is exact for subprocesses when one GPU action runs per worker
    process at a time (``nthreads=1``, or one worker per GPU group). With
    several GPU actions in one process, pass ``current_allocation().env()`` to
    the subprocess or server the action launches instead. Models loaded in
    this process (:func:`tangram_dask.reward_model`) do not depend on it: they
    are placed on the granted GPUs by CUDA ordinal.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.worker: Any = None
        self.declaration: WorkerDeclaration | None = None
        self.facts: GpuFacts | None = None
        self.residency: Any = None  # tangram_dask.models.WorkerResidency on a GPU worker
        # the scheduler takes the STARTED_HANDLER stream message (it said so when this worker declared); one
        # of an earlier release would drop this worker at a stream message it does not know
        self.report_starts = False

    async def setup(self, worker: Any) -> None:
        self.worker = worker
        worker.handlers[UNSTARTED_HANDLER] = self.unstarted
        cfg = _config.validate("worker")  # a bad key or value: ConfigError naming it
        self.declaration, self.facts = decl, facts = declare_facts(dict(worker.state.total_resources), cfg)
        if decl.source == "nvml":
            order = os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            if order != "PCI_BUS_ID":
                logger.warning("tangram: CUDA_DEVICE_ORDER=%s: grants name NVML (PCI bus) indices, so CUDA may "
                               "number these GPUs differently in subprocesses (unset it, or set PCI_BUS_ID)", order)
        why = abstract_gpus_warning(decl)
        if why:
            logger.warning("%s", why)
        if decl.gpus:
            from .models.worker import WorkerResidency  # the models package loads torch only on demand
            self.residency = WorkerResidency(worker, decl, facts, prepare=bool(cfg.get("prepare-models", True)),
                                             load_timeout_s=float(cfg.get("load-timeout-s", 1800) or 0))
            await self.residency.start()
        elif int(worker.state.total_resources.get("gpus", 0) or 0):
            logger.warning("tangram: this worker has --resources gpus but declares no GPU to tangram")
        try:
            rpc = getattr(worker.scheduler, DECLARE_HANDLER)
            msg = decl.to_msg()
            msg["starts"] = True  # this worker reports when a timed action starts (a key older schedulers ignore)
            reply = await rpc(worker=worker.contact_address, declaration=msg)
            self.report_starts = isinstance(reply, dict) and bool(reply.get("starts"))
        except Exception:  # the scheduler has no tangram plugin: nothing to declare to
            logger.warning("tangram: could not declare this worker to the scheduler", exc_info=True)

    def unstarted(self, keys: Any = ()) -> dict[str, list[int]]:
        """Of ``keys``, by position (msgpack makes a tuple key a list): ``unstarted``, the tasks this worker holds
        and has not begun executing (waiting for slots or threads), and ``unknown``, those it does not hold (one
        may still be on its way here). A paused worker begins none: the scheduler moves them."""
        tasks = self.worker.state.tasks
        out: dict[str, list[int]] = {"unstarted": [], "unknown": []}
        for i, key in enumerate(keys or ()):
            ts = tasks.get(_key(key))
            if ts is None:
                out["unknown"].append(i)
            elif ts.state in ("waiting", "ready", "constrained"):
                out["unstarted"].append(i)
        return out

    async def teardown(self, worker: Any) -> None:
        if self.residency is not None:
            self.residency.close()

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if finish == "executing" and self.report_starts:
            ts = self.worker.state.tasks.get(key)
            ann = ts.annotations if ts is not None else None
            spec = ann.get(ANNOTATION) if ann else None
            if isinstance(spec, dict) and spec.get("timeout_s") is not None and ann.get(GRANT_KEY):
                # its timeout_s counts from here: it may have waited on this worker for its slots (granted ahead,
                # or behind a thread that outlived its own timeout)
                self.worker.batched_send({"op": STARTED_HANDLER, "key": key})
        if self.declaration is None or not self.declaration.gpus:
            return
        if self.residency is not None:
            self.residency.transition(key, start, finish)
        if finish != "executing":
            return
        ts = self.worker.state.tasks.get(key)
        grant = granted(ts.annotations) if ts is not None else None
        if grant is not None and grant.gpus:
            uuids = self.declaration.device_uuids
            if uuids and all(0 <= g < len(uuids) for g in grant.gpus):
                ids: Any = [uuids[g] for g in grant.gpus]
            else:
                ids = grant.device_ids or grant.gpus
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in ids)
