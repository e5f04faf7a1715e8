"""Whether a torchrun preset's runs fit the machine, before any of them starts (issue 28).

Each pending run's peak memory per GPU comes from :func:`lrmoe.train.estimate.estimate_memory`
(the run's real step under fake tensors). Runs that differ only in what does not change memory
(seed, scorer, schedule, logging) share one estimate: :func:`memory_key` keys the config fields
that do. Estimates are read from the committed ``results/memory/estimates.json`` (made by
``lrmoe estimate-memory ... --save``) or from ``<out>/memory_estimates.json``; a missing one is
computed (about a minute each on a server CPU) and stored in ``<out>``. A run whose estimate plus
overhead exceeds the GPU's memory, or whose offloaded state (plus a round figure per process,
:data:`HOST_PER_PROCESS_GIB`) exceeds the node's available host memory, is refused with the
estimate and where the other configurations are. ``lrmoe reproduce --dry-run`` prints the stored
estimates as a column and never computes one."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..files import atomic_write

# the config fields the memory of a step depends on
MEMORY_FIELDS = ("model", "model_overrides", "seq_len", "micro_batch", "grad_accum", "drop_ratio", "quota", "mode",
                 "phi", "selection", "dtype", "ep", "placement", "ep_budget_mib", "ep_options", "fsdp", "offload",
                 "activation_checkpointing")
ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "results" / "memory" / "estimates.json"
LOCAL = "memory_estimates.json"
GIB = 2 ** 30


def memory_config(config: dict, world: int) -> dict:
    """The part of a run's config (defaults filled in) and its world size that its memory depends on."""
    from ..train.config import TrainConfig

    full = TrainConfig.from_dict(dict(config)).to_dict()
    return {**{k: full[k] for k in MEMORY_FIELDS}, "world": int(world)}


def memory_key(config: dict, world: int) -> str:
    blob = json.dumps(memory_config(config, world), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _read(path: Path) -> dict:
    from ..files import read_json

    return read_json(path, missing={})


def stored(out: Path | None = None) -> dict:
    """Every stored estimate by key: the committed ones, then the output folder's."""
    found = dict(_read(COMMITTED))
    if out is not None:
        found.update(_read(Path(out) / LOCAL))
    return found


def save(path: Path, config: dict, world: int, res: dict, run: str | None = None) -> None:
    """Add one estimate (``res`` from estimate_memory) to the estimates file ``path``."""
    entries = _read(path)
    entries[memory_key(config, world)] = {"run": run, "config": memory_config(config, world),
                                          **{k: res[k] for k in ("peak_gib", "counted_peak_gib", "offloaded_to_host_gib",
                                                                 "overhead_gib", "categories_gib", "demand")},
                                          "estimated": "lrmoe estimate-memory (fake tensors; not measured)"}
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(entries, indent=1, sort_keys=True) + "\n").encode()
    atomic_write(path, lambda f: f.write(text))


def column(spec, world: int, estimates: dict) -> str:
    """The dry run's column: the stored estimate of a run, or how to make one."""
    e = estimates.get(memory_key(spec.config, world))
    if e is None:
        return "memory: not estimated yet (a real call estimates it before launching)"
    host = f", host {e['offloaded_to_host_gib']:.0f} GiB/GPU" if e.get("offloaded_to_host_gib") else ""
    return f"memory: {e['peak_gib']:.1f} GiB/GPU estimated{host}"


def check(pending: list, world: int, out: Path, gpu_bytes: int, host_bytes: int, *, estimate=None,
          say=print) -> list[str]:
    """Refusal lines for the pending runs that do not fit (empty: all fit). Computes and stores the
    estimates that are missing (``estimate(config_dict, world) -> result dict``)."""
    if estimate is None:
        estimate = _estimate
    known = stored(out)
    refusals, seen = [], {}
    for r in pending:
        key = memory_key(r.config, world)
        if key not in known:
            say(f"estimating the memory of {r.name} (and of the runs that share its memory config) ...")
            res = estimate(dict(r.config), world)
            save(Path(out) / LOCAL, r.config, world, res, r.name)
            known = stored(out)
        e = known[key]
        if key in seen:
            if seen[key]:
                refusals.append(f"  {r.name}: as {seen[key]}")
            continue
        gpu_gib, host_gib = gpu_bytes / GIB, host_bytes / GIB
        offloaded = e.get("offloaded_to_host_gib", 0.0)
        need_host = host_need_gib(offloaded, world)
        why = []
        if e["peak_gib"] > gpu_gib:
            why.append(f"estimated {e['peak_gib']:.1f} GiB per GPU (with {e['overhead_gib']:.0f} GiB overhead) > "
                       f"this GPU's {gpu_gib:.1f} GiB")
        if offloaded and need_host > host_gib:
            why.append(f"its offloaded state needs {need_host:.0f} GiB of host memory on this node "
                       f"({offloaded:.0f} GiB per GPU + {HOST_PER_PROCESS_GIB:.0f} GiB per process, x {world}) > "
                       f"{host_gib:.0f} GiB available here")
        seen[key] = r.name if why else None
        if why:
            alt = alternative(r.config, world, gpu_gib, host_gib, known)
            refusals.append(f"  {r.name}: " + "; ".join(why) + "; " + (alt or NO_ALTERNATIVE))
    return refusals


NO_ALTERNATIVE = ("no stored estimate of this experiment fits here; docs/memory.md lists the configurations "
                  "estimated (more GPUs, with or without offload); `lrmoe estimate-memory --save` adds one")
#: the config fields a user may change to make a run fit (the others define the experiment)
SCALE_FIELDS = ("world", "ep", "offload")


def alternative(config: dict, world: int, gpu_gib: float, host_gib: float, known: dict) -> str | None:
    """The smallest configuration among the stored estimates (``known``) that runs ``config``'s
    experiment (the same memory fields except the world size, EP size and offload) on GPUs of
    ``gpu_gib`` with ``host_gib`` of host memory per node, said as the flags that select it; None
    when no stored estimate fits. Fewer GPUs first, then no offload before offload."""
    want = {k: v for k, v in memory_config(config, world).items() if k not in SCALE_FIELDS}
    fits = []
    for e in known.values():
        c = e.get("config", {})
        if {k: v for k, v in c.items() if k not in SCALE_FIELDS} != want or e["peak_gib"] > gpu_gib:
            continue
        per_node = min(int(c["world"]), world)  # this node's GPUs, at most
        if e.get("offloaded_to_host_gib", 0.0) and \
                host_need_gib(e["offloaded_to_host_gib"], per_node) > host_gib:
            continue
        fits.append((int(c["world"]), c["offload"] != "none", c, e))
    if not fits:
        return None
    n, _, c, e = min(fits, key=lambda f: f[:2])
    return (f"the smallest stored configuration that fits: {n} GPUs (--ep {c['ep']} --offload {c['offload']}), "
            f"estimated {e['peak_gib']:.1f} GiB per GPU")


#: host memory of one training process beside its offloaded state: the CUDA context and torch's
#: libraries, the tokenised data, pinned staging buffers (a round figure, not measured on a GPU node)
HOST_PER_PROCESS_GIB = 6.0


def host_need_gib(offloaded_gib: float, processes: int) -> float:
    """Host memory a node's ``processes`` ranks need when each keeps ``offloaded_gib`` on the host
    (pinned: it cannot be swapped out). The checkpoint's pages while loading are page cache, which
    the kernel reclaims, so they are not counted."""
    return (offloaded_gib + HOST_PER_PROCESS_GIB) * processes


def _estimate(config: dict, world: int) -> dict:
    from ..train.config import TrainConfig
    from ..train.estimate import estimate_memory, run_vocab

    cfg = {k: v for k, v in config.items() if k not in ("init_from", "tokenizer", "data")}
    return estimate_memory(TrainConfig.from_dict(cfg), world, model_vocab=run_vocab(config),
                           progress=lambda line: print(f"    {line}", flush=True))


def machine_memory() -> tuple[int, int] | None:
    """(memory of GPU 0, host memory) in bytes, or None without CUDA."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory, host_available_bytes()


def host_available_bytes() -> int:
    """The host memory available now (``MemAvailable`` of /proc/meminfo; the physical memory where
    the kernel does not report it)."""
    import os

    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
