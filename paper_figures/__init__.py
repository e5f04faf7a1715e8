"""Tables and figures of the paper, regenerated from results files only.

    from paper_figures import make_all
    make_all("results/cpu", "results/cpu")   # -> tables/*.md|.tex, figures/*.png|.pdf, report.md

Inputs are the run folders written by ``lrmoe train`` / ``lrmoe reproduce`` (``summary.json``,
``metrics.jsonl``, optionally the preset's ``manifest.json``) and ``paper_numbers.json`` (every
number of the paper's "Reported results"). Nothing else is read, and nothing is made up: a cell
whose runs are missing or unfinished says "not run", and a run folder whose summary cannot be
read, or a finished run whose metrics are damaged, is named in every table, in the report and on stderr.

- :mod:`~paper_figures.results`: the results model (:class:`Results`, :class:`Run`, helpers);
- :mod:`~paper_figures.tables` (T1, T2) and :mod:`~paper_figures.figures` (F1, F2): the makers;
- :mod:`~paper_figures.makers`: the makers listed explicitly, :func:`register` for more;
- :mod:`~paper_figures.report`: :func:`make_all` and ``report.md``;
- :mod:`~paper_figures.cli`: `lrmoe figures`.
"""
from .makers import MAKERS, Maker, register, unregister
from .report import make_all
from .results import (FAMILY_NAMES, NOT_RUN, AmbiguousRuns, IncomparableRuns, Results, Run, level_name, mean_std,
                      paper_numbers, rows_per_step)

__all__ = ["AmbiguousRuns", "FAMILY_NAMES", "IncomparableRuns", "MAKERS", "Maker", "NOT_RUN", "Results", "Run",
           "level_name", "make_all", "mean_std", "paper_numbers", "register", "rows_per_step", "unregister"]
