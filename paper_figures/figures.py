"""F1 (per-expert demand vs quota vs kept, from real routing) and F2 (loss curves C0-C30): PNG + PDF."""
from __future__ import annotations

from pathlib import Path

from lrmoe.files import atomic_write

from .results import FAMILY_NAMES, Results, level_name
from .tables import LEVELS


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    return plt, sns


def _save(fig, out: Path, stem: str) -> list[Path]:
    d = out / "figures"
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
    files = _save(fig, out, stem)
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
    plt, sns = _plt()
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
        ax.axhline(cap, ls="--", c="k", lw=0.8)  # waterfill's common cap; other policies have none
        ax.text(E - 0.5, cap, f" waterfill cap {cap}", va="bottom", ha="right", fontsize=8)
    ax.set_title(f"measured: {FAMILY_NAMES.get(run.family, run.family)} ({cfg.get('model')}), "
                 f"{level_name(run.drop)} {cfg.get('scorer')}/{cfg.get('quota')}, MoE layer {key}, "
                 f"step {row['step']} (sum over {cfg.get('grad_accum', 1)} micro-batch(es))", fontsize=9)
    ax.set_xlabel("expert")
    ax.set_ylabel("routed pairs")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, frameon=False)
    ex = paper["F1"]["example"]
    pdf_ = pd.DataFrame({"expert": [0, 1, 2] * 2, "pairs": ex["demand"] + ex["retained"],
                         "what": ["demand"] * 3 + ["retained"] * 3})
    sns.barplot(data=pdf_, x="expert", y="pairs", hue="what", ax=ax2, palette=["#9ecae1", "#31a354"])
    ax2.set_title("paper (illustration)", fontsize=9)
    ax2.legend(fontsize=7)
    fig.suptitle(f"{title} — preset {res.preset_name}; {res.hardware()}; replicas: none (single-process runs; "
                 f"replica counts need expert-parallel runs)", fontsize=10)
    fig.tight_layout()
    files = _save(fig, out, "F1_expert_loads")
    plt.close(fig)
    return files


# ----------------------------------------------------------------------------- F2


def make_f2(res: Results, paper: dict, out: Path) -> list[Path]:
    plt, sns = _plt()
    import pandas as pd

    seed = res.seeds("e1_seeds")[0]
    fams = res.families()
    frames = []
    for fam in fams:
        for d in LEVELS:
            r = res.find(fam, d, "lrm", seed)
            if r is None or not r.done:
                continue
            for row in r.rows:
                if row.get("loss") is None:  # a step without response tokens has no loss
                    continue
                frames.append({"family": fam, "level": level_name(d), "step": row["step"], "loss": row["loss"],
                               "ppl": row["ppl"], "steps": r.config.get("steps", 0)})
    title = "F2. Training loss by backward drop level (C0-C30, LRM scorer)"
    if not frames:
        return _placeholder(plt, out, "F2_loss_curves", title, "not run: no finished E1 run")
    df = pd.DataFrame(frames)
    order = [level_name(d) for d in LEVELS]
    palette = dict(zip(order, sns.color_palette("viridis", len(order))))
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, len(fams), figsize=(5.5 * len(fams), 7), squeeze=False)
    for j, fam in enumerate(fams):
        sub = df[df.family == fam]
        ax = axes[0][j]
        if sub.empty:
            ax.text(0.5, 0.5, "not run", ha="center", transform=ax.transAxes)
            axes[1][j].axis("off")
            continue
        sns.lineplot(data=sub, x="step", y="loss", hue="level", hue_order=[o for o in order if o in set(sub.level)],
                     palette=palette, ax=ax, lw=0.9)
        ax.set_yscale("log")
        ax.set_ylabel("training loss (response-token CE, nats; log scale)")
        ax.set_title(f"measured: {FAMILY_NAMES.get(fam, fam)} ({res.model_of(fam)}), seed {seed}", fontsize=9)
        steps = int(sub.steps.max())
        tail = sub[sub.step > steps - max(1, -(-steps // 10))]
        ax2 = axes[1][j]
        sns.lineplot(data=tail, x="step", y="ppl", hue="level", hue_order=[o for o in order if o in set(tail.level)],
                     palette=palette, ax=ax2, lw=0.9, marker=".")
        ax2.set_title("final 10 % of steps (the T1 window): per-step training PPL", fontsize=9)
        ax2.set_ylabel("perplexity")
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps
    pv = paper["T1"]["values"]
    fig.text(0.5, -0.01, "paper (Qwen3-30B-A3B, 8× Hopper, mean PPL over the final 1,000 of 10,000 steps): "
             + ", ".join(f"{k} {v:.6f}" for k, v in pv.items()), ha="center", fontsize=8)
    fig.suptitle(f"{title} — preset {res.preset_name}; {res.hardware()}; measured", fontsize=10)
    fig.tight_layout()
    files = _save(fig, out, "F2_loss_curves")
    plt.close(fig)
    return files

