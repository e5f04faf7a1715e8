"""`lrmoe ablate GRID`: a grid's runs trained by `lrmoe reproduce`'s driver (the same run folders,
locks, resume, staleness checks, Ctrl-C/SIGTERM handling and progress), then its tables and
figures (:mod:`~lrmoe.ablate.aggregate`)."""
from __future__ import annotations

import sys
from pathlib import Path

from lrmoe.reproduce.driver import reproduce

from .grid import Grid, GridError, load_grid

GRIDS_DIR = Path(__file__).resolve().parents[2] / "ablations"


def find_grid(grid: str) -> Path:
    """A grid file: ``grid`` itself, else ``ablations/<grid>.toml`` here or in the kit's checkout."""
    path = Path(grid)
    if path.exists() or path.suffix:
        return path
    for d in (Path("ablations"), GRIDS_DIR):
        if (d / f"{grid}.toml").is_file():
            return d / f"{grid}.toml"
    known = ", ".join(sorted(q.stem for q in GRIDS_DIR.glob("*.toml"))) or "none"
    raise GridError(f"grid {grid!r}: no such file, and no ablations/{grid}.toml; the kit's grids: {known}")


#: Where a user's runs go by default (git-ignored), as ``lrmoe reproduce`` writes ``results/<preset>-local``:
#: a fresh clone's ``lrmoe ablate GRID`` trains, instead of finding the committed reference done.
LOCAL_ROOT = Path("results") / "ablations-local"


def default_out(g: Grid) -> Path:
    return LOCAL_ROOT / g.name


def ablate(grid, out_dir=None, only: str | None = None, dry_run: bool = False, data: str | None = None,
           jobs: int | None = None, progress: bool = True, figures: bool = True) -> int:
    """Run every pending run of ``grid`` (a file, a grid name, or a :class:`Grid`) into ``out_dir``
    (default ``results/ablations-local/<grid name>/``; the committed reference is
    ``results/ablations/<grid name>/``), then write its tables and (``figures``) figures. Exit codes
    and refusals are `lrmoe reproduce`'s (:func:`lrmoe.reproduce.driver.reproduce`); a bad grid or
    argument raises :class:`lrmoe.runs.UsageError` before anything is written."""
    g = grid if isinstance(grid, Grid) else load_grid(find_grid(str(grid)))
    out = Path(out_dir) if out_dir is not None else default_out(g)

    def tables(folder, runs) -> int:
        from .aggregate import write_all

        try:
            written = write_all(g, folder, warn=lambda msg: print(f"lrmoe ablate: {msg}", file=sys.stderr),
                                figures=figures)
        except OSError as e:
            print(f"lrmoe ablate: the tables were not made: {e}", file=sys.stderr)
            return 1
        print(f"tables and figures: {len(written)} files under {folder}/tables and {folder}/figures", file=sys.stderr)
        return 0

    return reproduce(g, out, only, dry_run, data, jobs, figures=tables, progress=progress, reference="none")


def tables_from(grid, runs_dir, out_dir=None, data: str | None = None, figures: bool = True) -> int:
    """The tables and figures of ``grid`` into ``out_dir`` from finished runs of the same configs
    under ``runs_dir`` (e.g. ``results/cpu`` for ablations/scorers.toml, whose runs are the cpu
    preset's E2 runs), training nothing and writing nothing under ``runs_dir``. Runs there of
    another config are refused (status 2), as a call that trains would refuse them."""
    from lrmoe.reproduce.driver import plan

    from .aggregate import write_all

    g = grid if isinstance(grid, Grid) else load_grid(find_grid(str(grid)))
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise GridError(f"--tables-from {str(runs_dir)!r} is not a folder; give a results folder holding the "
                        f"grid's runs (e.g. results/cpu for ablations/scorers.toml)")
    out = Path(out_dir) if out_dir is not None else default_out(g)
    sv = plan(g, runs_dir, None, data)["survey"]
    if sv.stale:
        print("\n".join(sv.refusal(runs_dir, "lrmoe ablate")[:1 + len(sv.stale)]), file=sys.stderr)
        return 2
    written = write_all(g, out, warn=lambda msg: print(f"lrmoe ablate: {msg}", file=sys.stderr), figures=figures,
                        runs_dir=runs_dir)
    print(f"tables and figures of {g.name} from the runs in {runs_dir}/: {len(written)} files under {out}/",
          file=sys.stderr)
    return 0
