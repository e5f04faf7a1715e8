"""Checkpoints of a training run: what they hold, how they are written, how a resume checks them.

One process writes ``checkpoint.pt`` (model, optimizer, scheduler, RNG states, data position) in
one atomic write (:func:`lrmoe.files.atomic_write`: fsynced, renamed over the old file, the
temporary file removed on failure), so a run killed at any moment finds the old checkpoint or
the new one.

Under torchrun a checkpoint is a *set*: the ranks first write the weights and optimizer state of
step N with ``torch.distributed.checkpoint`` into the folder ``checkpoint.step{N}.dcp/`` (each rank
its own shards: FSDP's DTensor shards, its EP block of experts; a tensor every rank holds alike is
written once), then every rank r writes ``checkpoint.step{N}.rank{r}.pt`` (its RNG states and
planner state), then rank 0 writes ``checkpoint.pt`` (the common state: config, scheduler, data
position, the model's config), which names the folder and the rank files of its step: that write
is the commit point. Only after it are the files and folders of other steps deleted. So the
committed main file always names a complete set, however often the run is killed inside the
sequence (:func:`save_sharded`, :func:`load_rank_state`). Sets written before the DCP folder
(the full weights in ``checkpoint.pt``, each rank's optimizer state in its rank file) still resume.
``lrmoe export-hf`` turns any checkpoint into a Hugging Face model folder (:mod:`lrmoe.train.export`).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import torch

from ..files import atomic_write

MAIN = "checkpoint.pt"


def save(obj, path) -> None:
    """``torch.save`` through one atomic write."""
    atomic_write(path, lambda f: torch.save(obj, f))


def load(path, mmap: bool = False) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


# ----------------------------------------------------------------------------- RNG state


def rng_state(policy, device) -> dict:
    """torch, CUDA, python, numpy and the backward policy's generator state."""
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    gen = policy.generator(device)
    if gen is not None:
        state["policy"] = gen.get_state()
    return state


def set_rng_state(state: dict, policy, device) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "policy" in state:
        policy.generator(device).set_state(state["policy"])


# ----------------------------------------------------------------------------- resume checks


def check_resume(ck: dict, path: Path, cfg_dict: dict, data_fingerprint: str | None, data_source,
                 threads: int, device: torch.device) -> None:
    """ValueError unless the checkpoint ``ck`` can continue the run ``cfg_dict`` bit-identically:
    same config (runtime-only fields aside), same data, and on the CPU the same thread count (a
    different one changes the floating-point reduction order, so the losses would differ)."""
    from .config import config_differences

    diff = config_differences(ck["config"], cfg_dict)
    if diff:
        raise ValueError(f"{path} was written by a different config ({'; '.join(diff)}); "
                         "use a fresh output directory")
    was = ck.get("data_fingerprint")
    if was and data_fingerprint and was != data_fingerprint:  # $LRMOE_ALPACA elsewhere, or a file edited in place
        raise ValueError(f"{path} was trained on other data (content fingerprint {was[:12]}, now "
                         f"{data_fingerprint[:12]} from {data_source!r}); resume with the "
                         "same data or use a fresh output directory")
    before = ck.get("threads")  # checkpoints of older versions of the kit did not record it
    if device.type == "cpu" and before is not None and before != threads:
        raise ValueError(f"{path} was trained with {before} CPU thread(s), this process has {threads}: the "
                         f"resumed losses would differ from an uninterrupted run's; resume with --threads "
                         f"{before}, or use a fresh output directory")


# ----------------------------------------------------------------------------- sharded sets (torchrun)


def rank_file(path, step: int, rank: int) -> Path:
    path = Path(path)
    return path.with_name(f"{path.stem}.step{step}.rank{rank}{path.suffix}")


def _legacy_rank_files(path: Path, rank: int) -> list[Path]:
    """The per-rank files of the layout before step-named sets (``checkpoint.rank{r}.pt`` and its
    ``.prev.pt``), still read on resume."""
    return [path.with_name(f"{path.stem}.rank{rank}{s}{path.suffix}") for s in ("", ".prev")]


def dcp_dir(path, step: int) -> Path:
    """The ``torch.distributed.checkpoint`` folder of the set of ``step``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.step{step}.dcp")


def save_sharded(path, step: int, rank: int, rank_state: dict, main_state: Callable[[], dict] | None,
                 barrier: Callable[[], None]) -> None:
    """Write this rank's part of the checkpoint set of ``step`` (after its DCP folder, when it has
    one, is written); ``main_state`` (rank 0 only, else None) gives the main file's content. Every
    rank calls it; ``barrier`` waits for all of them."""
    path = Path(path)
    save({**rank_state, "step": step, "rank": rank}, rank_file(path, step, rank))
    barrier()  # every rank file of this step exists
    if main_state is not None:
        save({**main_state(), "step": step, "rank_files": rank_file(path, step, 0).name.replace(".rank0", ".rank{r}")},
             path)  # the commit point
    barrier()
    remove_stale_rank_files(path, rank, keep_step=step)


def remove_stale_rank_files(path, rank: int, keep_step: int) -> None:
    """Delete this rank's files of every other step (after the set of ``keep_step`` is committed);
    rank 0 also deletes the DCP folders of other steps."""
    path = Path(path)
    keep = rank_file(path, keep_step, rank)
    for f in path.parent.glob(f"{path.stem}.step*.rank{rank}{path.suffix}"):
        if f != keep:
            f.unlink(missing_ok=True)
    for f in _legacy_rank_files(path, rank):
        f.unlink(missing_ok=True)
    if rank == 0:
        keep_dir = dcp_dir(path, keep_step)
        for d in path.parent.glob(f"{path.stem}.step*.dcp"):
            if d != keep_dir and d.is_dir():
                for f in sorted(d.rglob("*"), reverse=True):  # files before their folders
                    f.rmdir() if f.is_dir() else f.unlink(missing_ok=True)
                d.rmdir()


def load_rank_state(path, ck: dict, rank: int) -> dict:
    """This rank's file of the set that the main checkpoint ``ck`` (read from ``path``) commits."""
    path = Path(path)
    pattern = ck.get("rank_files")
    if pattern and ".step" in pattern:
        candidates = [path.with_name(pattern.format(r=rank))]
    else:  # a set written before rank files were named by step
        candidates = _legacy_rank_files(path, rank)
    found = []
    for f in candidates:
        if f.exists():
            rs = load(f)
            found.append(f"{f.name}: step {rs['step']}")
            if rs["step"] == ck["step"]:
                return rs
    raise ValueError(f"{path} is at step {ck['step']} but no per-rank file of rank {rank} matches it "
                     f"({', '.join(found) or 'none found'}); copy the checkpoint together with its "
                     f"{path.stem}.step*.rank*{path.suffix} files")
