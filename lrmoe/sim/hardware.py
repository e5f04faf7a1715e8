"""Hardware models of the cluster simulator: what one GPU and its interconnects do per second.

A :class:`Hardware` holds every constant the cost model (:mod:`lrmoe.sim.cost`) reads; each
preset's constants and their sources are listed in docs/simulator.md ("Hardware model").
Presets: ``h100-sxm``, ``h200-sxm`` (published figures) and the ones users add with
:func:`register_hardware` (a calibrated preset is one such, e.g. from a JSON file:
:func:`hardware_from_dict`).

The grouped-GEMM model: an expert group of m rows computes in ``ceil(m / tile_rows)`` row tiles at
``gemm_tflops`` (the rate grouped GEMMs reach when no tile is partly empty), plus
``gemm_call_s`` per grouped-GEMM call. Memory-bound work (SwiGLU, the router gradient, scoring,
row gathers) moves its bytes at ``hbm_bytes_per_s``; indexed row copies at ``row_bytes_per_s`` where
a calibration measured it (random-access gathers and index adds run slower than a streaming copy on
CPUs). An all-to-all takes
``a2a_latency_s + max(bytes sent, bytes received) / bandwidth`` per rank, with the fast domain's
bandwidth for peers inside it and ``net_bytes_per_s`` for the others (both directions at once).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from ..files import read_json


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its interconnects (every field documented in docs/simulator.md)."""

    name: str
    gemm_tflops: float  # achieved bf16 grouped-GEMM rate on full row tiles, TFLOP/s
    tile_rows: int  # rows per GEMM tile: a group of m rows costs ceil(m / tile_rows) tiles
    gemm_call_s: float  # fixed cost of one grouped-GEMM call (launch, scheduling), seconds
    hbm_bytes_per_s: float  # achieved HBM bandwidth of memory-bound kernels, bytes/s
    fast_bytes_per_s: float  # all-to-all bandwidth per GPU per direction inside a fast domain (NVLink)
    net_bytes_per_s: float  # per GPU per direction between domains (inter-node network)
    a2a_latency_s: float  # fixed cost of one all-to-all collective, seconds
    memory_bytes: float  # GPU memory, bytes
    forward_overhead_s: float = 0.0  # fixed host cost of one layer call's forward (Python, small kernels)
    backward_overhead_s: float = 0.0  # and of its backward (0 in the GPU presets: not modelled there)
    fuse_gather: bool = True  # compaction gathers fused into the GEMM loads (the Triton path on GPUs)
    row_bytes_per_s: float = 0.0  # row gathers/scatters (index_select, index_add) bytes/s; 0: hbm_bytes_per_s
    source: str = ""  # where the constants come from (a preset's docs section or a calibration file)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("float", "int") and (isinstance(v, bool) or not isinstance(v, (int, float))
                                               or not math.isfinite(v) or v < 0):
                raise ValueError(f"hardware {self.name!r}: {f.name} must be a finite number >= 0, got {v!r}")
        for f in ("gemm_tflops", "tile_rows", "hbm_bytes_per_s", "fast_bytes_per_s", "net_bytes_per_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"hardware {self.name!r}: {f} must be > 0, got {getattr(self, f)!r}")

    def gemm_seconds(self, rows_M, flops_per_row: float, calls: int = 1) -> float:
        """Time of ``calls`` grouped GEMMs over groups of ``rows_M`` rows (sequence of ints),
        ``flops_per_row`` FLOPs per row in all of them together."""
        tiles = sum(-(-int(m) // self.tile_rows) for m in rows_M)
        return tiles * self.tile_rows * flops_per_row / (self.gemm_tflops * 1e12) + calls * self.gemm_call_s

    def hbm_seconds(self, nbytes: float) -> float:
        return nbytes / self.hbm_bytes_per_s

    def row_seconds(self, nbytes: float) -> float:
        """Indexed row copies (gathers, scatters, index adds): their own rate where calibrated."""
        return nbytes / (self.row_bytes_per_s or self.hbm_bytes_per_s)

    def a2a_seconds(self, fast_bytes: float, net_bytes: float) -> float:
        """One rank's all-to-all: the larger of its sent and received bytes per link class."""
        return self.a2a_latency_s + max(fast_bytes / self.fast_bytes_per_s, net_bytes / self.net_bytes_per_s)


GIB = 1024**3

# Constants and their sources: docs/simulator.md, "Hardware model".
_H100 = Hardware(
    name="h100-sxm",
    gemm_tflops=242.0,  # torch _grouped_mm at the Qwen3-30B-A3B expert shape, 2,048 rows per expert (VeOmni PR #460)
    tile_rows=128,  # CUTLASS/Triton Hopper grouped-GEMM row tile (docs/kernels.md configs: BLOCK_M 128)
    gemm_call_s=10e-6,  # assumption: a kernel launch + persistent-scheduler start, ~10 us
    hbm_bytes_per_s=0.8 * 3.35e12,  # HBM3 3.35 TB/s (NVIDIA H100 datasheet) x 0.8 achieved (assumption)
    fast_bytes_per_s=370e9,  # NCCL all-to-all on 8 x H100 NVLink 4: ~370 GB/s per GPU (NVIDIA/nccl-tests #212)
    net_bytes_per_s=0.8 * 50e9,  # one 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100) x 0.8 achieved (assumption)
    a2a_latency_s=30e-6,  # assumption: NCCL all-to-all launch + synchronisation, tens of us at 8 GPUs
    memory_bytes=80 * GIB,
    source="published figures (docs/simulator.md)")
_H200 = dataclasses.replace(_H100, name="h200-sxm", hbm_bytes_per_s=0.8 * 4.8e12, memory_bytes=141e9)

_PRESETS: dict[str, Hardware] = {h.name: h for h in (_H100, _H200)}


def register_hardware(hw: Hardware, *, override: bool = False) -> Hardware:
    if not isinstance(hw, Hardware):
        raise ValueError(f"register_hardware takes a Hardware, got {type(hw).__name__}")
    if hw.name in _PRESETS and not override and _PRESETS[hw.name] != hw:
        raise ValueError(f"hardware {hw.name!r} is already registered; pass override=True to replace it")
    _PRESETS[hw.name] = hw
    return hw


def hardware_names() -> list[str]:
    return sorted(_PRESETS)


#: Where ``lrmoe bench simulator`` writes the ``cpu-local`` calibration (relative to the working folder).
CPU_LOCAL = Path("results/sim/cpu-local.json")


def get_hardware(name: str | Hardware) -> Hardware:
    """A preset by name, ``cpu-local`` (the calibration file :data:`CPU_LOCAL`), a measured GPU
    preset ``<gpu>-measured`` whose file lies beside it (:mod:`lrmoe.sim.measured`), or a
    calibration file's path (``*.json`` with a ``hardware`` entry)."""
    if isinstance(name, Hardware):
        return name
    if name in _PRESETS:
        return _PRESETS[name]
    measured = CPU_LOCAL.parent / f"{name}.json"  # a calibrated preset: cpu-local, <gpu>-measured
    if name == "cpu-local" or str(name).endswith(".json") or (str(name).endswith("-measured") and measured.exists()):
        path = Path(name) if str(name).endswith(".json") else measured
        d = read_json(path)
        if d is None:
            raise ValueError(f"hardware {name!r}: {path} does not exist; `lrmoe simulate calibrate` calibrates this "
                             f"machine and writes it")
        if not isinstance(d, dict) or not isinstance(d.get("hardware"), dict):
            raise ValueError(f"hardware {name!r}: {path} has no 'hardware' object")
        return hardware_from_dict(d["hardware"])
    raise ValueError(f"unknown hardware {name!r}; known: {hardware_names() + ['cpu-local']}, a measured preset "
                     f"in {CPU_LOCAL.parent}/<name>-measured.json, or a calibration *.json")


def hardware_from_dict(d: dict) -> Hardware:
    """A Hardware from a JSON object (a calibration file's ``hardware`` entry); unknown keys refused."""
    names = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown hardware fields {unknown}; accepted: {sorted(names)}")
    return Hardware(**d)
