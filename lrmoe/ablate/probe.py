"""`lrmoe ablate probe`: how close the selective backward's expert weight gradients are to the full
backward's, per scorer x drop ratio x phi x selection rule, per MoE layer and expert weight.

On fixed batches of a model (a trained checkpoint, and the same model at initialisation) the
full backward (drop ratio 0) gives G_full for every MoE layer's ``gate_up_proj`` and
``down_proj``. Then, for every policy variant:

- *end to end* (``rel_err``, ``cosine``): the whole model's backward with the policy at every MoE
  layer, as training computes it (a layer's incoming gradient already carries the selections of
  the layers above it): ||G - G_full||_F / ||G_full||_F and cos(G, G_full);
- *layer-local* (``rel_err_local``, ``cosine_local``): this layer's selection only, on the incoming
  gradient of the full backward (the experts function re-run on the captured inputs);
- ``dropped_score_share``: the paper's local objective, the share of sum_u R_u over the pairs the
  layer-local selection drops, with R_u = alpha_u^2 ||g_t||^2 ||h_u||^2 (the paper's phi, whatever
  the scorer) on the full backward's gradient, summed over the batches;
- for ``selection == "sample"``, over ``draws`` draws: the mean of the per-draw errors, and
  ``bias`` = ||mean_d G_d - G_full|| / ||G_full|| and ``variance`` = mean_d ||G_d - mean G||^2 /
  ||G_full||^2 (unbiased over draws), end to end and layer-local (``bias_local``,
  ``variance_local``), with ``bias_floor`` = sqrt(variance / draws), the bias an unbiased
  estimator shows from the finite number of draws alone. For ``top``, bias = rel_err, variance 0.

Writes ``DIR/probe.json`` (``records`` and ``meta``), ``DIR/probe.md`` / ``probe.tex`` (tables) and
``DIR/figures/figure_a1.png/.pdf`` (:mod:`paper_figures.probe`). With no ``--run``, a small model is
first trained briefly on the sample data (``DIR/model``, an `lrmoe train` run folder; reused when
already there). docs/ablations.md ("The gradient-fidelity probe") describes the choices and costs."""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from lrmoe.environment import cpu_model, environment
from lrmoe.interrupts import blocked_in_children, ignore_sigint, run_command

PHIS = ("h", "x", "both")
SCORERS = ("lrm", "grad_norm", "abs_grad", "random")
DROPS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
CHECKPOINTS = ("trained", "init")
PARAMS = ("gate_up", "down")
DTYPES = ("float32", "float64")
# the briefly trained default model: the cpu preset's Qwen3 family and data, fewer steps
DEFAULT_TRAIN = dict(model="qwen3-moe-small", steps=60, warmup_steps=6, eval_interval=0, eval_batches=1,
                     checkpoint_interval=0)


class ProbeError(ValueError):
    """Bad input to the probe (one line, exit 2)."""


def variants(scorers) -> list[tuple[str, str, str]]:
    """(scorer, phi, selection) of every policy probed: phi varies for lrm (the scorer that reads
    it); sample for every scorer but random (whose sqrt(uniform) weights would be meaningless)."""
    out = []
    for s in scorers:
        for phi in (PHIS if s == "lrm" else ("h",)):
            for sel in (("top",) if s == "random" else ("top", "sample")):
                out.append((s, phi, sel))
    return out


def _train_config(fields: dict):
    """A TrainConfig from a run's recorded fields (keys another kit version wrote are left out)."""
    from lrmoe.train import TrainConfig

    return TrainConfig(**{k: v for k, v in fields.items() if k in TrainConfig.__dataclass_fields__})


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"probe: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ model and batches

def train_default(out: Path, data: str | None, steps: int | None, model: str | None, progress: bool) -> Path:
    """The default model: trained briefly in ``out/model`` (an existing finished run is reused)."""
    from lrmoe.reproduce.presets import PRESETS, resolve_data
    from lrmoe.train import train

    preset = PRESETS["cpu"]
    src, why = resolve_data(preset, data)
    if why:
        raise ProbeError(why)
    fields = {**preset.base, **DEFAULT_TRAIN, "data": src}
    if steps is not None:
        fields.update(steps=steps, warmup_steps=min(DEFAULT_TRAIN["warmup_steps"], steps // 10))
    if model is not None:
        fields["model"] = model
    cfg = _train_config(fields)
    run = out / "model"
    if _finished_without_checkpoint(run):
        restore(cfg, run, progress)
    else:
        _log(f"training the default model ({cfg.model}, {cfg.steps} steps) in {run}", progress)
        train(cfg, run, progress=False)
    return run


def _finished_without_checkpoint(run: Path) -> bool:
    from lrmoe.run_folder import CHECKPOINT, read_summary

    if not run.is_dir() or (run / CHECKPOINT).is_file():
        return False
    summary = read_summary(run)  # a summary that cannot be read is refused (CorruptFileError) by the caller
    return summary is not None and summary.get("status") == "done"


def restore(cfg, run: Path, progress: bool) -> None:
    """The finished run ``run`` (of ``cfg``) without its checkpoint, as the committed references keep
    them: trained again for one (:func:`lrmoe.train.retrain.restore_checkpoint`). Said on stderr, and
    a retrained run whose final metrics differ from the folder's is said even without progress."""
    from lrmoe.train.retrain import restore_checkpoint

    _log(f"{run} is a finished run without its checkpoint (committed results keep none): training it again "
         f"({cfg.model}, {cfg.steps} steps) to get one", progress)
    r = restore_checkpoint(cfg, run)
    if not r["same"]:
        print(f"probe: the retrained {run} differs from the folder's run ({'; '.join(r['differences'][:3])}); its "
              f"summary.json and metrics.jsonl now describe the checkpoint (the previous ones: *.previous)",
              file=sys.stderr)


def run_config(run: Path):
    """The TrainConfig of the finished run folder ``run`` from its summary.json (for :func:`restore`)."""
    from lrmoe.run_folder import read_summary

    cfg = _train_config(read_summary(run)["config"])
    if cfg.data and Path(cfg.data).is_absolute() and not Path(cfg.data).exists():  # a local file of another machine
        raise ProbeError(f"--run {run}: a finished run without its checkpoint; training it again needs its data "
                         f"{cfg.data}, not found here (train the run again with `lrmoe train` or `lrmoe reproduce` "
                         f"on this machine, then probe that folder)")
    return cfg


def read_run(run: Path):
    """(checkpoint, config) of an `lrmoe train` run folder the probe can read; ProbeError otherwise."""
    from lrmoe.train import checkpoint

    path = Path(run) / checkpoint.MAIN
    if not path.is_file():
        raise ProbeError(f"--run {run}: no {checkpoint.MAIN}; give the folder of an `lrmoe train` run (single "
                         f"process) with a checkpoint")
    ck = checkpoint.load(path)
    if not isinstance(ck, dict) or "model" not in ck or "config" not in ck:
        raise ProbeError(f"--run {run}: {path} is not an lrmoe train checkpoint (no model or config entry)")
    cfg = _train_config(ck["config"])
    if cfg.init_from or cfg.ep > 1:
        raise ProbeError(f"--run {run}: the probe rebuilds single-process preset models (this run has "
                         f"{'init_from' if cfg.init_from else 'ep > 1'})")
    return ck, cfg


def load_run(run: Path, dtype: torch.dtype = torch.float32, progress: bool = True):
    """(trained model, model at initialisation, config, train set) of an `lrmoe train` run folder,
    in ``dtype`` (``progress``: progress bars if the data must be tokenised first)."""
    from lrmoe import hf
    from lrmoe.train import load_data

    ck, cfg = read_run(run)
    train_set, _, stats = load_data(cfg, progress)
    # built in float32 as training builds it, then cast: the same initialisation in either dtype (a
    # float64 build would draw other initial weights from the same seed)
    make = lambda: hf.build_model(cfg.model, seed=cfg.seed, vocab_size=int(stats["vocab_size"]),  # noqa: E731
                                  dtype=torch.float32, **cfg.model_overrides).to(dtype)
    trained, init = make(), make()
    trained.load_state_dict({k: v.to(dtype) for k, v in ck["model"].items()})
    return trained.eval(), init.eval(), cfg, train_set


def fixed_batches(train_set, rows: int, batches: int, seed: int) -> list[dict]:
    """``batches`` micro-batches of ``rows`` rows each, drawn once by ``seed`` (without replacement
    while the split lasts)."""
    t = train_set.tensors
    n = t["input_ids"].shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    idx = order.repeat((rows * batches) // n + 1)[: rows * batches].view(batches, rows)
    return [{k: t[k][i] for k in ("input_ids", "labels", "position_ids")} for i in idx]


# ------------------------------------------------------------------------------ gradients

def _loss(model, batch, n_label: int):
    from lrmoe.train.loss import causal_lm_loss  # the training loss (plain at the CPU presets' sizes)

    return causal_lm_loss(model, batch["input_ids"], batch["position_ids"], batch["labels"])[0] / max(1, n_label)


def _expert_params(model):
    from lrmoe import hf

    return [(m.gate_up_proj, m.down_proj) for m in hf.experts_modules(model)]


def end_to_end(model, batches, policy, draws: int) -> list[list[torch.Tensor]]:
    """Per draw, per MoE layer and weight: the model gradient of the batches' mean token loss with
    ``policy`` at every MoE layer (one forward per batch; each backward draws anew)."""
    from lrmoe import hf
    from lrmoe.train.evaluate import label_tokens

    before = hf.get_policies(model)
    hf.set_policy(model, policy)
    params = _expert_params(model)
    flat = [p for pair in params for p in pair]
    n_label = sum(label_tokens(b["labels"]) for b in batches)
    out = [[torch.zeros_like(p) for p in flat] for _ in range(draws)]
    try:
        for b in batches:
            loss = _loss(model, b, n_label)
            for d in range(draws):
                gs = torch.autograd.grad(loss, flat, retain_graph=d < draws - 1, allow_unused=True)
                for acc, g in zip(out[d], gs):
                    if g is not None:
                        acc += g
    finally:
        hf.set_policy(model, before)  # the model's own policies again
    return out


def capture(model, batches) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """The full backward: (its expert weight gradients per layer and weight, flattened; per layer,
    per batch: the experts' inputs and incoming gradient (hidden, index, weights, dL/dy))."""
    from lrmoe import BackwardPolicy, hf

    mods = hf.experts_modules(model)
    seen: list[list[list]] = [[] for _ in mods]

    def grab(i):
        def hook(_mod, args, kwargs, y):
            h, idx, w = (list(args) + [kwargs.get(k) for k in ("hidden_states", "top_k_index", "top_k_weights")
                                       ][len(args):])[:3]
            entry = [h.detach(), idx.detach(), w.detach(), None]
            seen[i].append(entry)
            y.register_hook(lambda g, entry=entry: entry.__setitem__(3, g.detach()))
        return hook

    handles = [m.register_forward_hook(grab(i), with_kwargs=True) for i, m in enumerate(mods)]
    try:
        full = end_to_end(model, batches, BackwardPolicy(0.0), 1)[0]
    finally:
        for h in handles:
            h.remove()
    return full, [[tuple(e) for e in layer] for layer in seen]


def local(gate_up, down, captured_layer, policy, draws: int, R_list) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Layer-local: per draw, this layer's (dW_gu, dW_d) summed over the batches with ``policy``'s
    selection on the full backward's incoming gradient; and per draw the dropped share of sum R."""
    from lrmoe import BackwardRecord, lrmoe_experts

    gu, dn = gate_up.detach().requires_grad_(), down.detach().requires_grad_()
    grads = [[torch.zeros_like(gu), torch.zeros_like(dn)] for _ in range(draws)]
    dropped, total = [0.0] * draws, 0.0
    for (h, idx, w, g), R in zip(captured_layer, R_list):
        rec = BackwardRecord()
        y = lrmoe_experts(h, idx, w, gu, dn, policy, rec)
        total += float(R.sum())
        for d in range(draws):
            a, b = torch.autograd.grad(y, [gu, dn], g, retain_graph=d < draws - 1)
            grads[d][0] += a
            grads[d][1] += b
            dropped[d] += float(R[~rec.kept_mask].sum())
    return grads, [x / total if total > 0 else 0.0 for x in dropped]


def paper_scores(gate_up, down, captured_layer) -> list[torch.Tensor]:
    """R_u = alpha^2 ||g||^2 ||h||^2 per pair of every batch (the lrm scorer's scores, phi = h)."""
    from lrmoe import BackwardPolicy, BackwardRecord, lrmoe_experts

    out = []
    for h, idx, w, g in captured_layer:
        rec = BackwardRecord()
        gu, dn = gate_up.detach().requires_grad_(), down.detach().requires_grad_()
        y = lrmoe_experts(h, idx, w, gu, dn, BackwardPolicy(0.5, scorer="lrm"), rec)
        torch.autograd.grad(y, [gu], g)
        out.append(rec.scores.double())
    return out


def _stats(draws: list[torch.Tensor], full: torch.Tensor) -> dict:
    """rel_err / cosine (means over draws), bias, variance (relative to ||full||^2) and its floor."""
    fn = full.norm()
    if fn == 0:
        return dict(rel_err=0.0, cosine=1.0, bias=0.0, variance=0.0, bias_floor=0.0)
    errs = [float((d - full).norm() / fn) for d in draws]
    cos = [float(torch.nn.functional.cosine_similarity(d.reshape(1, -1), full.reshape(1, -1)).item()) for d in draws]
    stack = torch.stack([d.reshape(-1) for d in draws])
    mean = stack.mean(0)
    n = len(draws)
    var = float(((stack - mean) ** 2).sum() / (n - 1) / fn**2) if n > 1 else 0.0
    return dict(rel_err=sum(errs) / n, cosine=sum(cos) / n, bias=float((mean - full.reshape(-1)).norm() / fn),
                variance=var, bias_floor=(var / n) ** 0.5)


def probe_model(model, batches, drops, scorers, draws: int, seed: int, label: str, progress: bool) -> list[dict]:
    """Every record of one model (module docstring)."""
    from lrmoe import BackwardPolicy

    t0 = time.perf_counter()
    full, captured = capture(model, batches)
    params = _expert_params(model)
    R = [paper_scores(gu, dn, captured[i]) for i, (gu, dn) in enumerate(params)]
    todo = [(v, rho) for v in variants(scorers) for rho in drops]
    records, at_zero = [], None
    for j, ((scorer, phi, sel), rho) in enumerate(todo):
        n = draws if (sel == "sample" and rho > 0) else 1
        if rho == 0 and at_zero is not None:  # every policy keeps every pair at drop 0: computed once
            e2e, locs = at_zero
        else:
            policy = BackwardPolicy(rho, scorer=scorer, phi=phi, selection=sel, seed=seed)
            e2e = end_to_end(model, batches, policy, n)
            locs = [local(gu, dn, captured[i], BackwardPolicy(rho, scorer=scorer, phi=phi, selection=sel, seed=seed),
                          n, R[i]) for i, (gu, dn) in enumerate(params)]
            if rho == 0:
                at_zero = e2e, locs
        for i, (gu, dn) in enumerate(params):
            loc, shares = locs[i]
            for k, name in enumerate(PARAMS):
                s_e = _stats([d[2 * i + k] for d in e2e], full[2 * i + k])
                s_l = _stats([d[k] for d in loc], full[2 * i + k])
                rec = dict(checkpoint=label, scorer=scorer, drop_ratio=rho, phi=phi, selection=sel, layer=i,
                           param=name, rel_err=s_e["rel_err"], cosine=s_e["cosine"],
                           rel_err_local=s_l["rel_err"], cosine_local=s_l["cosine"],
                           dropped_score_share=sum(shares) / n, draws=n)
                if sel == "sample":
                    rec.update(bias=s_e["bias"], variance=s_e["variance"], bias_floor=s_e["bias_floor"],
                               bias_local=s_l["bias"], variance_local=s_l["variance"],
                               bias_floor_local=s_l["bias_floor"])
                records.append(rec)
        _log(f"{label}: {scorer}/phi={phi}/{sel} drop {rho:g} ({j + 1}/{len(todo)}, "
             f"{time.perf_counter() - t0:.0f} s)", progress)
    return records


def probe_checkpoint(w: dict) -> list[dict]:
    """Every record of one checkpoint (``w["label"]``: trained or init) of the run ``w["run"]``, on the
    run's fixed batches; a process of its own may run it (everything it needs is in ``w``)."""
    torch.set_num_threads(w["threads"])
    trained, init, _, train_set = load_run(Path(w["run"]), getattr(torch, w["dtype"]), w["progress"])
    batches = fixed_batches(train_set, w["rows"], w["batches"], w["seed"])
    model = trained if w["label"] == "trained" else init
    return probe_model(model, batches, w["drops"], w["scorers"], w["draws"], w["seed"], w["label"], w["progress"])


# ------------------------------------------------------------------------------ command line

def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1), got {text!r}") from None
    if not vals or any(not 0 <= v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated drop ratios in [0, 1), got {text!r}")
    return vals


def _names(accepted):
    def parse(text: str) -> tuple[str, ...]:
        vals = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [v for v in vals if v not in accepted]
        if not vals or bad:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: accepted (comma-separated): {list(accepted)}")
        return vals
    return parse


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise ProbeError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lrmoe ablate probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/ablations-local/probe",
                   help="results folder (default: %(default)s, git-ignored; the committed reference is results/ablations/probe)")
    p.add_argument("--run", default=None, help="an `lrmoe train` run folder whose checkpoint is probed (default: a "
                                               "small model trained briefly in OUT/model)")
    p.add_argument("--data", default=None, help="Alpaca source of the default model (default: the cpu preset's sample)")
    p.add_argument("--model", default=None, help="model preset of the default model (default: qwen3-moe-small)")
    p.add_argument("--steps", type=_positive, default=None, help="training steps of the default model (default: 60)")
    p.add_argument("--drops", type=_floats, default=DROPS, help="drop ratios (default: 0,0.1,0.2,0.3,0.5,0.7,0.9)")
    p.add_argument("--scorers", type=_names(SCORERS), default=SCORERS, help="scorers (default: all four)")
    p.add_argument("--checkpoints", type=_names(CHECKPOINTS), default=CHECKPOINTS,
                   help="trained, init (the same model at initialisation) (default: both)")
    p.add_argument("--batches", type=_positive, default=2, help="fixed micro-batches (default: 2)")
    p.add_argument("--rows", type=_positive, default=4, help="rows per micro-batch (default: 4)")
    p.add_argument("--draws", type=_positive, default=8, help="draws of each sampled selection (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batches and of the policies' generators")
    p.add_argument("--jobs", type=_positive, default=None,
                   help="checkpoints probed in parallel, one process each (default: one per checkpoint, at most the "
                        "CPU count)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch CPU threads per process (default: the CPU count / jobs)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="precision of the model and its gradients (default: %(default)s; float64 is slower on a CPU "
                        "and agrees with float32 to within 3e-5 relative on top-quota records, docs/ablations.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument("--redraw", action="store_true",
                   help="probe nothing: the tables and Figure A1 again from --out's probe.json")
    return p


def _run_final(run: Path) -> dict | None:
    """The probed run's final metrics (its summary.json), by which `lrmoe reproduce` knows the probe
    is of this run (:func:`lrmoe.reproduce.probe.up_to_date`)."""
    from lrmoe.run_folder import read_summary

    return (read_summary(run) or {}).get("final")


def run_probe(a) -> dict:
    from paper_figures.probe import write_outputs

    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ProbeError(f"--out {out}: not a folder")
    progress = not a.no_progress
    if a.run is not None and (a.data or a.model or a.steps):
        raise ProbeError("--data, --model and --steps choose the default model; with --run the run's model is probed")
    if a.run is not None and not Path(a.run).is_dir():
        raise ProbeError(f"--run {a.run}: no such folder; give an `lrmoe train` run folder")
    jobs = a.jobs or min(len(a.checkpoints), os.cpu_count() or 1)
    threads = a.threads or max(1, (os.cpu_count() or 1) // jobs)
    torch.set_num_threads(threads)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    if a.run is not None and _finished_without_checkpoint(Path(a.run)):
        restore(run_config(Path(a.run)), Path(a.run), progress)
    run = Path(a.run) if a.run is not None else train_default(out, a.data, a.steps, a.model, progress)
    cfg = read_run(run)[1]  # refused here, in this process, if the run folder is not one the probe reads
    work = [dict(run=str(run), dtype=a.dtype, label=label, rows=a.rows, batches=a.batches, seed=a.seed, drops=a.drops,
                 scorers=a.scorers, draws=a.draws, threads=threads, progress=progress) for label in a.checkpoints]
    if jobs > 1 and len(work) > 1:  # one process per checkpoint (each with `threads` torch threads)
        parts = _in_workers(work, min(jobs, len(work)))
    else:
        parts = [probe_checkpoint(w) for w in work]
    records = [r for part in parts for r in part]
    meta = dict(run=str(run), model=cfg.model, model_overrides=cfg.model_overrides, steps=cfg.steps,
                checkpoints=list(a.checkpoints), batches=a.batches, rows=a.rows, seq_len=cfg.seq_len,
                tokens=a.batches * a.rows * cfg.seq_len, draws=a.draws, seed=a.seed, drops=list(a.drops),
                scorers=list(a.scorers), dtype=a.dtype, seconds=round(time.perf_counter() - t0, 1),
                jobs=min(jobs, len(work)),
                machine=f"{cpu_model() or platform.machine()}, {min(jobs, len(work))} process(es) x {threads} torch "
                        f"thread(s), load average "
                        f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
                run_final=_run_final(run), environment=environment(),
                argv=list(a.argv), command=shlex.join(["lrmoe", "ablate", "probe", *a.argv]))
    files = write_outputs(out, records, meta)
    _log(f"wrote {', '.join(str(f) for f in files)} ({meta['seconds']} s)", progress)
    return {"records": records, "meta": meta}


def _in_workers(work: list[dict], jobs: int) -> list[list[dict]]:
    """:func:`probe_checkpoint` of each item of ``work`` in ``jobs`` spawned processes. They ignore
    Ctrl-C; this process ends them on one (their records are written only when all are done)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ex = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=ignore_sigint)
    try:
        with blocked_in_children():
            futs = [ex.submit(probe_checkpoint, w) for w in work]
        return [f.result() for f in futs]
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        for child in mp.active_children():
            child.terminate()
        raise
    finally:
        ex.shutdown(wait=True)


def main(argv: list[str] | None = None) -> int:
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        a = parser().parse_args(argv)
        a.argv = argv
        if a.redraw:
            from paper_figures.probe import from_json

            src = Path(a.out) / "probe.json"
            if not src.is_file():
                raise ProbeError(f"--redraw: no {src}; run the probe into --out first")
            for f in from_json(src):
                print(f)
            return 0
        run_probe(a)
    except ProbeError as e:
        print(f"lrmoe ablate probe: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a bad run folder, data or config: one line
        print(f"lrmoe ablate probe: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # `lrmoe reproduce` runs the probe so; after Ctrl-C it says what stopped, not the probe
    sys.exit(run_command(main, "lrmoe ablate probe", None))
