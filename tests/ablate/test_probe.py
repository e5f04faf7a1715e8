"""The gradient-fidelity probe (lrmoe.ablate.probe) on a tiny float64 model: record fields, exact
values at drop 0, the dropped score share against a hand computation of R and of the top-quota
selection, LRM's optimality for the local objective, end to end == layer-local at the last layer,
sample vs top, the command end to end (files written, one-line refusals)."""
import json

import pytest
import torch
import torch.nn.functional as F

from lrmoe import hf
from lrmoe.ablate import probe
from lrmoe.data import shared_data_dir
from lrmoe.quota import compute_quota

FIELDS = ("checkpoint", "scorer", "drop_ratio", "phi", "selection", "layer", "param", "rel_err", "cosine",
          "rel_err_local", "cosine_local", "dropped_score_share", "draws")
SAMPLE_FIELDS = ("bias", "variance", "bias_floor", "bias_local", "variance_local", "bias_floor_local")


@pytest.fixture(scope="module")
def tiny():
    model = hf.build_model("qwen3-moe-tiny", vocab_size=50, dtype=torch.float64, seed=3).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 24), generator=g)
    batches = [{"input_ids": ids[i:i + 1], "labels": ids[i:i + 1], "position_ids": torch.arange(24)[None]}
               for i in range(2)]
    records = probe.probe_model(model, batches, (0.0, 0.5), ("lrm", "grad_norm", "random"), 4, 0, "init", False)
    return model, batches, records


def _one(records, **kw):
    out = [r for r in records if all(r[k] == v for k, v in kw.items())]
    return out


def test_fields_and_grid(tiny):
    _, _, records = tiny
    n_layers = len(hf.experts_modules(tiny[0]))
    variants = probe.variants(("lrm", "grad_norm", "random"))
    assert len(variants) == 3 * 2 + 2 + 1  # lrm: 3 phi x 2 rules; grad_norm: 2 rules; random: top
    assert len(records) == len(variants) * 2 * n_layers * 2
    for r in records:
        assert all(k in r for k in FIELDS)
        assert r["selection"] in ("top", "sample") and r["phi"] in ("h", "x", "both") and r["param"] in probe.PARAMS
        assert all(k in r for k in SAMPLE_FIELDS) == (r["selection"] == "sample")
        assert 0 <= r["dropped_score_share"] <= 1
    json.dumps(records)  # plain JSON values


def test_drop_zero_is_the_full_backward(tiny):
    for r in _one(tiny[2], drop_ratio=0.0):
        assert r["rel_err"] == 0 and r["rel_err_local"] == 0 and r["dropped_score_share"] == 0
        assert r["cosine"] == pytest.approx(1, abs=1e-12) and r["cosine_local"] == pytest.approx(1, abs=1e-12)
        assert r["draws"] == 1


def _hand_dropped_share(model, batches, layer, drop):
    """R = alpha^2 ||g||^2 ||h||^2 from the weights by hand (h = silu(W_g x) * W_u x), waterfill quotas,
    per expert the highest R kept; the dropped share of sum R over the batches."""
    mod = hf.experts_modules(model)[layer]
    seen = []

    def grab(_m, a, y):  # the experts' inputs, then dL/dy
        seen.append([t.detach() for t in a[:3]])
        entry = seen[-1]
        y.register_hook(lambda g: entry.append(g.detach()))

    hook = mod.register_forward_hook(grab)
    try:
        from lrmoe.train.evaluate import label_tokens, token_loss
        n = sum(label_tokens(b["labels"]) for b in batches)
        for b in batches:
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
            (token_loss(logits, b["labels"])[0] / n).backward()
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    dropped = total = 0.0
    for x, idx, w, g in seen:
        T, K = idx.shape
        R = torch.zeros(T, K, dtype=torch.float64)
        for t in range(T):
            for k in range(K):
                e = int(idx[t, k])
                gate, up = (mod.gate_up_proj[e].detach() @ x[t]).chunk(2)
                h = F.silu(gate) * up
                R[t, k] = w[t, k] ** 2 * (g[t] ** 2).sum() * (h ** 2).sum()
        quota = compute_quota(torch.bincount(idx.reshape(-1), minlength=mod.gate_up_proj.shape[0]), drop)
        for e, q in enumerate(quota.tolist()):
            pairs = sorted([(float(R[t, k]), t * K + k) for t in range(T) for k in range(K) if int(idx[t, k]) == e],
                           key=lambda p: (-p[0], p[1]))
            dropped += sum(r for r, _ in pairs[q:])
        total += float(R.sum())
    return dropped / total


def test_dropped_score_share_equals_a_hand_computation(tiny):
    model, batches, records = tiny
    for layer in range(len(hf.experts_modules(model))):
        want = _hand_dropped_share(model, batches, layer, 0.5)
        for r in _one(records, scorer="lrm", phi="h", selection="top", drop_ratio=0.5, layer=layer):
            assert r["dropped_score_share"] == pytest.approx(want, rel=1e-5)  # R in float32 in the layer


def test_lrm_minimises_the_local_objective(tiny):
    records = tiny[2]
    for r in _one(records, drop_ratio=0.5):
        best = _one(records, scorer="lrm", phi="h", selection="top", drop_ratio=0.5, layer=r["layer"],
                    param=r["param"])[0]
        assert best["dropped_score_share"] <= r["dropped_score_share"] + 1e-12, r


def test_last_layer_end_to_end_equals_layer_local(tiny):
    records = tiny[2]
    last = max(r["layer"] for r in records)
    for r in _one(records, layer=last, selection="top", drop_ratio=0.5):
        if r["scorer"] == "random":  # one generator over all layers end to end: other draws
            continue
        assert r["rel_err"] == pytest.approx(r["rel_err_local"], rel=1e-9, abs=1e-12)
        assert r["cosine"] == pytest.approx(r["cosine_local"], rel=1e-9)
    for r in _one(records, layer=0, selection="top", drop_ratio=0.5, scorer="lrm", phi="h"):
        assert r["rel_err"] != pytest.approx(r["rel_err_local"], rel=1e-6)  # below: the upper layers' selections


def test_sample_versus_top(tiny):
    records = tiny[2]
    for r in _one(records, selection="sample", drop_ratio=0.5):
        top = _one(records, scorer=r["scorer"], phi=r["phi"], selection="top", drop_ratio=0.5, layer=r["layer"],
                   param=r["param"])[0]
        assert r["draws"] == 4 and r["variance_local"] > 0 and r["variance"] > 0
        assert r["bias_floor_local"] == pytest.approx((r["variance_local"] / 4) ** 0.5)
        # the top rule keeps the best pairs: its share of sum R dropped is no larger (for lrm[h], the same R)
        if r["scorer"] == "lrm" and r["phi"] == "h":
            assert top["dropped_score_share"] <= r["dropped_score_share"] + 1e-12
        assert "bias" not in top


def test_command_end_to_end(tmp_path):
    data = shared_data_dir() / "alpaca" / "alpaca_tiny.json"
    if not data.exists():
        pytest.skip(f"offline Alpaca sample not found at {data} (set LRMOE_SHARED_DATA to the shared/data folder)")
    from lrmoe.train import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(model="qwen3-moe-tiny", data=str(data), tokenizer="bpe:300", seq_len=32, micro_batch=2,
                      steps=2, warmup_steps=0, threads=1, heldout_fraction=0.1, eval_batches=1), run, progress=False)
    out = tmp_path / "probe"
    rc = probe.main(["--out", str(out), "--run", str(run), "--drops", "0,0.5", "--scorers", "lrm,random",
                     "--checkpoints", "trained", "--draws", "2", "--batches", "1", "--rows", "1", "--no-progress"])
    assert rc == 0
    d = json.loads((out / "probe.json").read_text())
    assert {r["selection"] for r in d["records"]} == {"top", "sample"} and d["meta"]["run"] == str(run)
    for f in ("probe.md", "probe.tex", "figures/figure_a1.png", "figures/figure_a1.pdf"):
        assert (out / f).stat().st_size > 0
    assert "lrm[h]/top" in (out / "probe.md").read_text()
    assert d["meta"]["dtype"] == "float32" and d["meta"]["jobs"] == 1
    # both checkpoints in two processes give the records of one process, in the same order; float64 agrees
    args = ["--run", str(run), "--drops", "0,0.5", "--scorers", "lrm,random", "--draws", "2", "--batches", "1",
            "--rows", "1", "--no-progress"]
    recs = {}
    for jobs, dtype in ((1, "float32"), (2, "float32"), (1, "float64")):
        o = tmp_path / f"p{jobs}{dtype}"
        assert probe.main(["--out", str(o), "--jobs", str(jobs), "--threads", "1", "--dtype", dtype, *args]) == 0
        d = json.loads((o / "probe.json").read_text())
        assert d["meta"]["jobs"] == jobs and d["meta"]["dtype"] == dtype
        recs[jobs, dtype] = d["records"]
    assert recs[1, "float32"] == recs[2, "float32"] and {r["checkpoint"] for r in recs[2, "float32"]} == {"trained", "init"}
    for a, b in zip(recs[1, "float32"], recs[1, "float64"]):
        assert {k: v for k, v in a.items() if isinstance(v, str)} == {k: v for k, v in b.items() if isinstance(v, str)}
        for k in ("rel_err", "cosine", "rel_err_local", "dropped_score_share"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), k
    # the run kept as a committed reference keeps it (no checkpoint): trained again, the same records
    assert probe.load_run(run)[2] is not None
    (run / "checkpoint.pt").unlink()
    o = tmp_path / "restored"
    assert probe.main(["--out", str(o), "--jobs", "1", "--threads", "1", *args]) == 0
    d = json.loads((o / "probe.json").read_text())
    assert d["records"] == recs[1, "float32"] and (run / "checkpoint.pt").is_file()
    assert d["meta"]["run_final"] == json.loads((run / "summary.json").read_text())["final"]
    assert not list(run.glob("*.previous"))  # the same run came out: the folder's files stay


@pytest.mark.parametrize("argv,msg", [
    (["--drops", "0,1.5"], "drop ratios in [0, 1)"),
    (["--scorers", "lrm,best"], "accepted (comma-separated)"),
    (["--draws", "0"], "an integer >= 1"),
    (["--run", "/nonexistent/run"], "no such folder"),
    (["--run", ".", "--steps", "3"], "with --run the run's model is probed"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, msg):
    out = tmp_path / "o"
    assert probe.main(["--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lrmoe ablate probe: ") and msg in err and "\n" not in err
    assert not out.exists()


def test_run_without_checkpoint_is_refused(tmp_path, capsys):
    """A folder without a finished run (so none to train again) and without a checkpoint."""
    assert probe.main(["--out", str(tmp_path / "o"), "--run", str(tmp_path)]) == 2
    assert "no checkpoint.pt" in capsys.readouterr().err


def test_a_finished_run_whose_data_is_not_here_is_refused(tmp_path, capsys):
    from lrmoe.train import TrainConfig

    cfg = TrainConfig(model="qwen3-moe-tiny", data="/nonexistent/alpaca.json", tokenizer="bpe:300", seq_len=32)
    (tmp_path / "summary.json").write_text(json.dumps({"status": "done", "config": cfg.to_dict(), "final": {}}))
    assert probe.main(["--out", str(tmp_path / "o"), "--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "without its checkpoint" in err and "/nonexistent/alpaca.json, not found here" in err
