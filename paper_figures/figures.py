"""F1 (per-expert demand vs quota vs kept, from real routing) and F2 (loss curves C0-C30): PNG + PDF."""
from __future__ import annotations

from pathlib import Path

from lrmoe.files import atomic_write

from .results import FAMILY_NAMES, Results, level_name
from .tables import LEVELS


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    return plt, sns


def save_figure(fig, out: Path, stem: str, sub: str = "figures") -> list[Path]:
    """``<out>/<sub>/<stem>.png`` (150 dpi) and ``.pdf``, each written atomically."""
    d = out / sub if sub else out
    d.mkdir(parents=True, exist_ok=True)
    png, pdf = d / f"{stem}.png", d / f"{stem}.pdf"
    for path, kw in ((png, {"dpi": 150}), (pdf, {})):  # atomic: a temporary file, then a rename
        atomic_write(path, lambda f: fig.savefig(f, format=path.suffix[1:], bbox_inches="tight", **kw))
    return [png, pdf]


def _placeholder(plt, out: Path, stem: str, title: str, message: str) -> list[Path]:
    fig, ax = plt.subplots(figsize=(6, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True)
    ax.set_title(title)
    files = save_figure(fig, out, stem)
    plt.close(fig)
    return files


# ----------------------------------------------------------------------------- F1


def f1_source(res: Results):
    """(run, layer key, step row) for F1: the first family's C20 LRM run of the first E1 seed, its first
    sampled MoE layer, at the run's final step (falls back to any finished run with a drop)."""
    seeds = res.seeds("e1_seeds")
    candidates = [res.find(f, 0.2, "lrm", seeds[0]) for f in res.families()]
    candidates += sorted((r for r in res.runs.values() if r.drop > 0), key=lambda r: r.name)
    for run in candidates:
        if run is None or not run.done or not run.rows:
            continue
        row = run.rows[-1]
        if row.get("layers"):
            key = sorted(row["layers"], key=int)[0]
            return run, key, row
    return None, None, None


def make_f1(res: Results, paper: dict, out: Path) -> list[Path]:
    plt, sns = pyplot()
    import pandas as pd

    run, key, row = f1_source(res)
    title = "F1. Per-expert demand vs backward quota vs kept pairs"
    if run is None:
        return _placeholder(plt, out, "F1_expert_loads", title, "not run: no finished run with a drop ratio > 0")
    st = row["layers"][key]
    E = len(st["demand"])
    df = pd.DataFrame({"expert": list(range(E)) * 3,
                       "pairs": st["demand"] + st["quota"] + st["kept"],
                       "what": ["routed demand (forward)"] * E + ["backward quota"] * E + ["kept in backward"] * E})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [4, 1]})
    sns.barplot(data=df, x="expert", y="pairs", hue="what", ax=ax, palette=["#9ecae1", "#fdae6b", "#31a354"])
    cfg = run.config
    cap = max(st["quota"])
    if sum(st["quota"]) < sum(st["demand"]) and cfg.get("quota", "waterfill") == "waterfill":
        # waterfill's common cap (other policies have none), named in the legend, not on the bars
        ax.axhline(cap, ls="--", c="k", lw=0.8, label=f"waterfill cap ({cap} pairs)")
    ax.set_title(f"measured: {FAMILY_NAMES.get(run.family, run.family)} ({cfg.get('model')}), "
                 f"{level_name(run.drop)} {cfg.get('scorer')}/{cfg.get('quota')}, MoE layer {key}, "
                 f"step {row['step']}\n(sum over the step's {cfg.get('grad_accum', 1)} micro-batch(es))", fontsize=9)
    ax.set_xlabel("expert")
    ax.set_ylabel("routed pairs")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, frameon=False)
    ex = paper["F1"]["example"]
    pdf_ = pd.DataFrame({"expert": [0, 1, 2] * 2, "pairs": ex["demand"] + ex["retained"],
                         "what": ["demand"] * 3 + ["retained"] * 3})
    sns.barplot(data=pdf_, x="expert", y="pairs", hue="what", ax=ax2, palette=["#9ecae1", "#31a354"])
    ax2.set_title("paper (illustration)", fontsize=9)
    ax2.legend(fontsize=7)
    fig.suptitle(_wrap(f"{title} — preset {res.preset_name}; {res.hardware()}; replicas: none (single-process "
                       f"runs; replica counts need expert-parallel runs)", fig), fontsize=10)
    fig.tight_layout()
    files = save_figure(fig, out, "F1_expert_loads")
    plt.close(fig)
    return files


# ----------------------------------------------------------------------------- F2
def f2_bands(res: Results) -> dict:
    """{(family, level): {"seeds": [...], "steps": [...], "loss_mean"/"loss_min"/"loss_max",
    "ppl_mean"/"ppl_min"/"ppl_max": [...], "run_steps": n}}: per step, the mean and the range over
    every seed that has a finished LRM run at that level (C0 and C20 have the E2 seeds too); only
    steps every one of those seeds logged a loss."""
    seeds = sorted({*res.seeds("e1_seeds"), *res.seeds("e2_seeds", default=())})
    out = {}
    for fam in res.families():
        for d in LEVELS:
            runs = {}
            for s in seeds:
                r = res.find(fam, d, "lrm" if d > 0 else None, s)
                if r is not None and r.done:
                    runs[s] = {row["step"]: row for row in r.rows if row.get("loss") is not None}
            if not runs:
                continue
            steps = sorted(set.intersection(*(set(v) for v in runs.values())))
            band = {"seeds": sorted(runs), "steps": steps,
                    "run_steps": max(int(res.find(fam, d, "lrm" if d > 0 else None, s).config.get("steps", 0))
                                     for s in runs)}
            for key in ("loss", "ppl"):
                vals = [[runs[s][t][key] for s in runs] for t in steps]
                band[f"{key}_mean"] = [sum(v) / len(v) for v in vals]
                band[f"{key}_min"] = [min(v) for v in vals]
                band[f"{key}_max"] = [max(v) for v in vals]
            out[(fam, level_name(d))] = band
    return out


def _seed_label(level: str, seeds: list[int]) -> str:
    return f"{level} (seed {seeds[0]})" if len(seeds) == 1 else f"{level} (mean, band: range of {len(seeds)} seeds)"


def make_f2(res: Results, paper: dict, out: Path) -> list[Path]:
    plt, sns = pyplot()
    bands = f2_bands(res)
    fams = res.families()
    title = "F2. Training loss by backward drop level (C0-C30, LRM scorer)"
    if not bands:
        return _placeholder(plt, out, "F2_loss_curves", title, "not run: no finished E1 run")
    order = [level_name(d) for d in LEVELS]
    palette = dict(zip(order, sns.color_palette("viridis", len(order))))
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, len(fams), figsize=(5.5 * len(fams), 7.4), squeeze=False)
    for j, fam in enumerate(fams):
        ax, ax2 = axes[0][j], axes[1][j]
        mine = [(lv, bands[(fam, lv)]) for lv in order if (fam, lv) in bands]
        if not mine:
            ax.text(0.5, 0.5, "not run", ha="center", transform=ax.transAxes)
            ax2.axis("off")
            continue
        steps = max(b["run_steps"] for _, b in mine)
        first_tail = steps - max(1, -(-steps // 10))  # the T1 window: the final 10 % of steps
        for lv, b in mine:
            c = palette[lv]
            ax.plot(b["steps"], b["loss_mean"], color=c, lw=0.9, label=_seed_label(lv, b["seeds"]))
            tail = [i for i, t in enumerate(b["steps"]) if t > first_tail]
            ts = [b["steps"][i] for i in tail]
            ax2.plot(ts, [b["ppl_mean"][i] for i in tail], color=c, lw=0.9, marker=".", ms=3,
                     label=_seed_label(lv, b["seeds"]))
            if len(b["seeds"]) > 1:
                ax.fill_between(b["steps"], b["loss_min"], b["loss_max"], color=c, alpha=0.2, lw=0)
                ax2.fill_between(ts, [b["ppl_min"][i] for i in tail], [b["ppl_max"][i] for i in tail], color=c,
                                 alpha=0.15, lw=0)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (response-token CE, nats; log scale)")
        ax.set_title(f"measured: {FAMILY_NAMES.get(fam, fam)} ({res.model_of(fam)})", fontsize=9)
        ax.legend(fontsize=7)
        ax2.set_title("final 10 % of steps (the T1 window): per-step training PPL", fontsize=9)
        ax2.set_xlabel("step")
        ax2.set_ylabel("perplexity")
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps
        ax2.legend(fontsize=7)
    pv = paper["T1"]["values"]
    fig.text(0.5, -0.01, "paper (Qwen3-30B-A3B, 8× Hopper, mean PPL over the final 1,000 of 10,000 steps): "
             + ", ".join(f"{k} {v:.6f}" for k, v in pv.items()), ha="center", fontsize=8)
    fig.suptitle(_wrap(f"{title} — preset {res.preset_name}; {res.hardware()}; measured; shaded: the range over "
                       f"the seeds that exist", fig), fontsize=10)
    fig.tight_layout()
    files = save_figure(fig, out, "F2_loss_curves")
    plt.close(fig)
    return files


def _wrap(text: str, fig, fontsize: float = 10) -> str:
    """``text`` broken into lines no wider than the figure (about 0.55 em per character)."""
    import textwrap

    width = int(fig.get_figwidth() * 72 / (0.55 * fontsize))
    return textwrap.fill(text, width=width)
