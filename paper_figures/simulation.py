"""Tables and figures of the cluster simulator's results (``simulation.json`` of ``lrmoe simulate``):
T4 memory, T5 backward latency, F3 throughput under pressure and the F5 sweeps, each beside the
paper's numbers and labelled simulated, with its hardware preset and trace."""
from __future__ import annotations

from pathlib import Path

from lrmoe.files import write_text

from .figures import pyplot, save_figure

PAPER_NAMES = {"fixed": "Megatron-LM", "symi": "SYMI", "ultraep": "UltraEP", "lrmoe": "LRMoE"}


def _label(result: dict) -> str:
    sc, tr, hw = result["scenario"], result["trace"], result["hardware"]["name"]
    swept = (result.get("sweep") or {}).get("field")
    budget = "no budget" if result["budget_gib"] is None else f"per-layer budget {result['budget_gib']:.2f} GiB"
    if swept == "budget":
        budget = "per-layer budget as swept"
    src = tr.get("workload") or tr.get("source", "trace")
    params = tr.get("params") or {}
    if params and swept != "sigma":
        src += " (" + ", ".join(f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in params.items()) + ")"
    ep = "EP as swept" if swept == "ranks" else f"EP{sc['ranks']}"
    shape = list(tr.get("shape") or [])
    if swept == "ranks" and len(shape) == 4:
        shape[2] = "G"
    steps_layers = f"trace: {src}, [steps, layers, ranks, experts] {shape}"
    planning = "host time (planning, layout): median included" if next(iter(result["methods"].values())).get(
        "planning_included", True) else "host time excluded"
    return (f"Simulated ({hw}; {sc['model']}, {ep}, {sc['tokens_per_rank']} tokens per GPU, {budget}; "
            f"{steps_layers}; {planning}; scenario {sc['name']})")


def _table(head, rows) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def _tex(caption: str, head, rows) -> str:
    def esc(s):
        return str(s).replace("\\", r"\textbackslash{}").replace("&", r"\&").replace("%", r"\%").replace(
            "_", r"\_").replace("#", r"\#").replace("×", r"$\times$").replace("—", "--")

    lines = [r"\begin{table}[t]", r"\centering", r"\small", rf"\begin{{tabular}}{{l{'r' * (len(head) - 1)}}}",
             r"\toprule", " & ".join(esc(h) for h in head) + r" \\", r"\midrule"]
    lines += [" & ".join(esc(c) for c in r) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{esc(caption)}}}", r"\end{table}", ""]
    return "\n".join(lines)


def _f(v, d=2):
    return "—" if v is None else f"{v:.{d}f}"


PAPER_T4_MODEL = "qwen3"  # the paper's T4 is Qwen3-30B-A3B's (its 0.42 GiB base is that model's per-layer base)


def paper_t4_applies(result: dict) -> bool:
    """The paper's T4 numbers belong beside a scenario of its model (Qwen3-30B-A3B) only."""
    return str(result["scenario"].get("model", "")).startswith(PAPER_T4_MODEL)


def t4_rows(result: dict, paper: dict) -> list[list[str]]:
    p = paper.get("T4", {}) if paper_t4_applies(result) else {}
    rows = []
    for name, m in result["methods"].items():
        mem, pn = m["memory_gib"], PAPER_NAMES.get(name, name)
        row = [name, _f(mem["base"]), _f(mem["replicas"]), _f(mem["tokens"]), _f(mem["subtotal"]),
               _f(m["memory_gib_max"]["subtotal"])]
        if p:
            row += [_f(p.get("token_buffers", {}).get(pn)), _f(p.get("subtotal", {}).get(pn))]
        rows.append(row)
    return rows


T4_HEAD = ["method", "base GiB", "replicas GiB", "tokens GiB", "subtotal GiB (median)", "subtotal GiB (max)",
           "paper tokens", "paper subtotal"]


def t4_head(result: dict) -> list[str]:
    return T4_HEAD if paper_t4_applies(result) else T4_HEAD[:-2]


def t5_rows(result: dict, paper: dict) -> list[list[str]]:
    vals = paper.get("T5", {}).get("values", {})
    rows = []
    for name, m in result["methods"].items():
        ph = m["phases_ms"]["backward"]
        paper_v = vals.get("LRMoE") if name == "lrmoe" else (vals.get("baseline") if name == "fixed" else None)
        pairs = m["pairs"]
        rows.append([name, _f(m["backward_ms_per_layer"]), _f(ph["gemm"]), _f(ph["grad_rows"] + ph["dx"]),
                     _f(ph["router_grad"] + ph["score_select"] + ph["gather"]), _f(ph["weight_grads"]),
                     _f(_without_planning(m, "forward_ms_per_layer")), _f(m["planning_ms_per_layer"]),
                     _f(100 * pairs["useful"] / pairs["routed"] if pairs["routed"] else None, 1),
                     _f(100 * pairs["kept_backward"] / pairs["routed"] if pairs["routed"] else None, 1), _f(paper_v)])
    return rows


def _without_planning(m: dict, key: str) -> float:
    """A per-layer time without the host time charged to it (planning and layout, which depend on this
    host and its load)."""
    if not m.get("planning_included", True):
        return m[key]
    return m[key] - m["planning_ms_per_layer"] - m.get("layout_ms_per_layer", 0.0)


T5_HEAD = ["method", "backward ms/layer", "GEMMs", "all-to-alls", "router grad + scoring + gathers",
           "replica grads", "forward ms/layer (host time excluded)", "planning ms (this host)", "forward pairs %", "backward pairs %",
           "paper backward"]


def fallback_summary(counts: dict) -> str:
    """{"split_microbatch:7": 3, "none": 2} -> "none 2, split 7 (3)"; splits as a range of piece counts."""
    splits = {int(k.split(":")[1]): v for k, v in counts.items() if k.startswith("split_microbatch:")}
    parts = [f"{k} {v}" for k, v in sorted(counts.items()) if not k.startswith("split_microbatch:")]
    if splits:
        lo, hi = min(splits), max(splits)
        parts.append(f"split {lo}{'' if lo == hi else f'-{hi}'} ({sum(splits.values())})")
    return ", ".join(parts)


def f3_rows(result: dict, paper: dict, key: str = "relative") -> tuple[list[str], list[list[str]]]:
    """F3 cells: ``key`` "relative" (planning's host time included) or "relative_without_planning"."""
    pressures = list(next(iter(result["methods"].values()))["throughput"])
    vals = paper.get("F3", {}).get("values", {})
    head = ["method"] + [f"{k}x (% of LRMoE)" for k in pressures] + \
        [f"backward pairs kept % ({pressures[0]}x / {pressures[-1]}x)", "fallbacks at the largest", "paper 20x"]
    rows = []
    for name, m in result["methods"].items():
        tp = m["throughput"]
        last = tp[pressures[-1]]
        fb = fallback_summary(last["fallbacks"])
        kept = [tp[k].get("kept_backward_share") for k in (pressures[0], pressures[-1])]
        kept_s = " / ".join(_f(None if v is None else 100 * v, 1) for v in kept)
        rows.append([name] + [_f(100 * tp[k][key], 1) if key in tp[k] else "—" for k in pressures] +
                    [kept_s, fb, _f(vals.get(PAPER_NAMES.get(name)), 1)])
    return head, rows


def f5_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """Per swept value: each method's mean MoE-layer time per layer (and its share of routed pairs
    computed in forward when it drops some), and LRMoE's speed-up in effective throughput (useful
    pairs per second), which charges a method that drops forward pairs (SYMI at capacity 1.0) for them."""
    sw = result["sweep"]
    names = list(sw["points"][0]["methods"])
    head = [sw["field"]] + [f"{n} ms/layer" for n in names] + \
        [f"LRMoE throughput / {n}" for n in names if n != "lrmoe"] + ["LRMoE planning ms (this host)"]
    rows = []
    for pt in sw["points"]:
        ms = pt["methods"]
        cells = [f"{pt['value']:g}"]
        for n in names:
            m = ms[n]
            c = _f(_without_planning(m, "total_ms_per_layer"))
            share = m.get("useful_share")
            if share is not None and share < 0.9995:
                c += f" ({100 * share:.0f} % pairs)"
            if m["oom"]:
                c += f" ({m['oom']} oom)"
            cells.append(c)
        key = "pairs_per_s_without_planning"
        lr = ms.get("lrmoe", {}).get(key)
        cells += [_f(lr / ms[n][key]) if lr and ms[n].get(key) else "—" for n in names if n != "lrmoe"]
        cells.append(_f(ms["lrmoe"]["planning_ms_per_layer"]) if "lrmoe" in ms else "—")
        rows.append(cells)
    return head, rows


def make_tables(result: dict, paper: dict, out: Path) -> list[Path]:
    """Markdown + LaTeX tables of one scenario's result under ``out/tables``."""
    label, name = _label(result), result["scenario"]["name"]
    tables = []
    if result.get("sweep"):
        head, rows = f5_rows(result)
        tables.append(("F5", f"F5 {name}: MoE-layer time per layer (fwd + bwd, mean over steps and layers, "
                             f"host time excluded; ms) and LRMoE's effective-throughput ratio as "
                             f"{result['sweep']['field']} varies; LRMoE's planner host time beside", head, rows))
    else:
        want = result["scenario"].get("tables", ())
        if "T4" in want:
            note = ("" if paper_t4_applies(result) else "; the paper reports T4 for Qwen3-30B-A3B only, so no paper "
                    "column here (see paper-qwen3)")
            tables.append(("T4", f"T4 {name}: memory of the executed plans per GPU and per MoE layer (GiB for one "
                                 f"MoE layer's experts and token buffers, not the whole model; worst rank; median "
                                 f"over steps and layers){note}", t4_head(result), t4_rows(result, paper)))
        if "T5" in want:
            tables.append(("T5", f"T5 {name}: time per MoE layer (mean over steps and layers; ms)", T5_HEAD,
                           t5_rows(result, paper)))
        if "F3" in want:
            head, rows = f3_rows(result, paper)
            tables.append(("F3", f"F3 {name}: effective throughput (useful pairs per second) relative to LRMoE "
                                 "at the same pressure, the host time (planning and layout) included", head, rows))
            head, rows = f3_rows(result, paper, "relative_without_planning")
            tables.append(("F3-no-planning", f"F3 {name}: the same, host time excluded (the planners' and "
                                             "layouts' host time left out of every method's step)", head, rows))
    paths = []
    d = Path(out) / "tables"
    for key, title, head, rows in tables:
        stem = f"{key}_{name}"
        label = _label(result)
        if key.endswith("no-planning") or key == "F5":
            label = label.replace("host time (planning, layout): median included", "host time excluded")
        paths.append(write_text(d / f"{stem}.md", f"**{title}**\n\n{_table(head, rows)}\n\n{label}\n"))
        paths.append(write_text(d / f"{stem}.tex", _tex(f"{title}. {label}", head, rows)))
    return paths


SWEEP_LABELS = {"drop_ratio": "LRMoE backward drop ratio (0.2 = C20; the baselines keep their full backward)",
                "budget": "per-layer memory budget per GPU (GiB)",
                "sigma": "routing skew: log-normal σ of expert popularity (0 = balanced)",
                "ranks": "expert-parallel size (GPUs)"}
METHOD_STYLE = {"fixed": ("C0", "o"), "symi": ("C1", "s"), "ultraep": ("C2", "^"), "lrmoe": ("C3", "D")}


def _method_name(n: str) -> str:
    return {"fixed": "fixed ownership (Megatron-LM)", "symi": "SYMI (capacity 1.0: drops pairs over it)", "ultraep": "UltraEP",
            "lrmoe": "LRMoE (C20)"}.get(n, n)


def make_figures(result: dict, paper: dict, out: Path) -> list[Path]:
    """F3 (relative throughput against pressure) or F5 (MoE-layer time against the swept field), PNG + PDF."""
    if result.get("sweep"):
        return _f5_figure(result, out)
    if "throughput" in next(iter(result["methods"].values())) and len(result["scenario"]["pressures"]) > 1:
        return _f3_figure(result, paper, out)
    return []


def _f5_figure(result: dict, out: Path) -> list[Path]:
    plt, sns = pyplot()
    name, sw = result["scenario"]["name"], result["sweep"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [p["value"] for p in sw["points"]]
    for n in sw["points"][0]["methods"]:
        ys = [_without_planning(p["methods"][n], "total_ms_per_layer") for p in sw["points"]]
        color, marker = METHOD_STYLE.get(n, (None, "o"))
        ax.plot(xs, ys, marker=marker, color=color, label=_method_name(n).replace(" (C20)", "" if sw["field"] ==
                                                                                  "drop_ratio" else " (C20)"))
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{v:g}" for v in xs])
    ax.set_xlabel(SWEEP_LABELS.get(sw["field"], sw["field"]))
    ax.set_ylabel("MoE-layer time per layer (ms)\nforward + backward, mean; host time excluded")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="best", frameon=True)  # (the place that hides the fewest points)
    ax.set_title(f"F5 {name}: simulated ({result['hardware']['name']}, {result['scenario']['model']}), "
                 f"not measured", fontsize=9)
    fig.tight_layout()
    paths = save_figure(fig, Path(out), f"F5_{name}")
    plt.close(fig)
    return paths


def _f3_figure(result: dict, paper: dict, out: Path) -> list[Path]:
    """Three panels: throughput relative to LRMoE with the planners' host time excluded (the paper's
    reading: its planner is not host Python) and included, and the share of routed pairs each
    method keeps in its backward (LRMoE's falls as pressure grows: that is how it keeps up)."""
    plt, sns = pyplot()
    from matplotlib.ticker import FixedLocator, NullLocator

    name, methods = result["scenario"]["name"], result["methods"]
    ks = list(next(iter(methods.values()))["throughput"])
    xs = [float(k) for k in ks]
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.0))
    vals = paper.get("F3", {}).get("values", {})
    at = paper.get("F3", {}).get("pressure", 20)
    panels = (("relative_without_planning", "(a) host time excluded"),
              ("relative", "(b) host time included (this CPU's compiled planners and layouts)"))
    for ax, (key, title) in zip(axes[:2], panels):
        for n, m in methods.items():
            if not all(key in m["throughput"][k] for k in ks):
                continue
            color, marker = METHOD_STYLE.get(n, (None, "o"))
            ax.plot(xs, [100 * m["throughput"][k][key] for k in ks], marker=marker, color=color, label=_method_name(n))
            if PAPER_NAMES.get(n) in vals:
                ax.scatter([at], [vals[PAPER_NAMES[n]]], marker="x", s=60, color=color, zorder=5, linewidths=2)
        ax.set_ylabel("effective throughput\n(% of LRMoE's at the same pressure)")
        ax.set_title(title, fontsize=9)
    ax = axes[2]
    for n, m in methods.items():
        kept = [m["throughput"][k].get("kept_backward_share") for k in ks]
        if all(v is not None for v in kept):
            color, marker = METHOD_STYLE.get(n, (None, "o"))
            ax.plot(xs, [100 * v for v in kept], marker=marker, color=color, label=_method_name(n))
    ax.set_ylabel("routed pairs kept in the backward (%)")
    ax.set_ylim(0, 105)
    ax.set_title("(c) routed pairs each method computes in its backward", fontsize=9)
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{x:g}×" for x in xs])
        ax.set_xlabel("batch-size pressure (× the unpressured batch)")
    handles, labels = axes[0].get_legend_handles_labels()
    handles.append(axes[0].scatter([], [], marker="x", color="k", linewidths=2))
    labels.append(f"paper, at {at}× (colour: its method)")
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(f"F3 {name}: simulated ({result['hardware']['name']}, {result['scenario']['model']}, "
                 f"EP{result['scenario']['ranks']}), not measured; throughput = useful routed pairs per second", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    paths = save_figure(fig, Path(out), f"F3_{name}")
    plt.close(fig)
    return paths
