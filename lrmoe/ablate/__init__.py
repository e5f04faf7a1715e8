"""`lrmoe ablate`: ablation grids (``ablations/*.toml``) over every choice of the method.

- :mod:`~lrmoe.ablate.grid`: a grid file as a checked list of runs, each paired with its baseline;
- :mod:`~lrmoe.ablate.runner`: the runs trained by `lrmoe reproduce`'s driver (:mod:`lrmoe.runs`),
  so run folders, resume, staleness checks and Ctrl-C behave the same;
- :mod:`~lrmoe.ablate.metrics`, :mod:`~lrmoe.ablate.aggregate`: paired differences against the
  baseline of the same seed and family, 95 % intervals (:mod:`lrmoe.stats`), resolved orderings,
  tables (Markdown + LaTeX, JSON) and figures (PNG + PDF) from the run files only;
- ``lrmoe ablate probe``: the gradient-fidelity probe (:mod:`lrmoe.ablate.probe`, when installed).

docs/ablations.md describes the grid format, every axis and the statistics."""
