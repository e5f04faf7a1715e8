"""Expert-parallel runtime on real gloo process groups (2 and 4 processes spawned here), float64.

Each world size is spawned once (a module fixture) and runs every case; the ranks save their
outputs, gradients and records, and the tests compare the assembled results here against
* the single-process ``lrmoe_experts`` with the same weights (C0, every placement policy),
* an independent per-pair emulation of the EP selection semantics (C20, forward drops).
A separate spawn checks that configuration mismatches, out-of-memory plans and a missing peer
raise clear exceptions on every rank instead of hanging (process-group timeouts).
"""
from __future__ import annotations

import datetime
import math
import os
import pickle
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lrmoe import BackwardPolicy, lrmoe_experts
from lrmoe.quota import quota_for, retained_total
from dist_helpers import spawn
from oracle import expected_keep, moe_loop

f64 = torch.float64
H, I, E, K, HOT = 8, 4, 8, 2, 1
PG_TIMEOUT_S = 30
SPAWN_DEADLINE_S = 150

# name, placement, planner options, slots beyond E/G (None: default), tokens per rank, drop, mode, warmup, check
CASES = {
    2: [
        ("fixed-c0", "fixed", {}, None, [10, 7], 0.0, "compact", 0, "sp"),
        ("symi-c0", "symi", {"capacity_factor": None}, None, [10, 7], 0.0, "compact", 1, "sp"),
        ("ultraep-c0", "ultraep", {"min_tokens": 1}, None, [10, 7], 0.0, "compact", 0, "sp"),
        ("ultraep_greedy-c0", "ultraep_greedy", {}, None, [10, 7], 0.0, "compact", 0, "sp"),
        ("lrmoe-c0", "lrmoe", {}, None, [10, 7], 0.0, "compact", 0, "sp"),
        ("ultraep-c0-noreplica", "ultraep", {"min_tokens": 1}, 0, [10, 7], 0.0, "compact", 0, "sp"),
        ("fixed-c0-emptyrank", "fixed", {}, None, [12, 0], 0.0, "compact", 0, "sp"),
        ("fixed-c0-split", "fixed", {}, None, [10, 7], 0.0, "compact", 0, "sp"),
        ("lrmoe-c20", "lrmoe", {}, None, [10, 7], 0.2, "compact", 0, "emulate"),
        ("lrmoe-c20-noreplica", "lrmoe", {}, 0, [10, 7], 0.2, "compact", 0, "emulate"),
        ("lrmoe-c20-mask", "lrmoe", {}, None, [10, 7], 0.2, "mask", 0, "emulate"),
        ("lrmoe-c20-emptyrank", "lrmoe", {}, None, [0, 14], 0.2, "compact", 0, "emulate"),
        ("fixed-c20", "fixed", {}, None, [10, 7], 0.2, "compact", 0, "emulate"),
        ("symi-cf1-drops", "symi", {"capacity_factor": 1.0}, None, [10, 7], 0.0, "compact", 1, "emulate"),
        ("lrmoe-c0-gelu", "lrmoe", {}, None, [10, 7], 0.0, "compact", 0, "sp"),
        ("lrmoe-c0-split-gelu", "lrmoe", {}, None, [10, 7], 0.0, "compact", 0, "sp"),
        ("lrmoe-c20-gelu", "lrmoe", {}, None, [10, 7], 0.2, "compact", 0, "emulate"),
        ("ultraep-c20-mask-tanh", "ultraep", {"min_tokens": 1}, None, [10, 7], 0.2, "mask", 0, "emulate"),
        ("hf",) + (None,) * 8,
        ("hf-gelu",) + (None,) * 8,
    ],
    4: [
        ("fixed-c0", "fixed", {}, None, [6, 4, 9, 5], 0.0, "compact", 0, "sp"),
        ("symi-c0", "symi", {"capacity_factor": None}, None, [6, 4, 9, 5], 0.0, "compact", 1, "sp"),
        ("ultraep-c0", "ultraep", {"min_tokens": 1}, None, [6, 4, 9, 5], 0.0, "compact", 0, "sp"),
        ("ultraep_greedy-c0", "ultraep_greedy", {}, None, [6, 4, 9, 5], 0.0, "compact", 0, "sp"),
        ("lrmoe-c0", "lrmoe", {}, None, [6, 4, 9, 5], 0.0, "compact", 0, "sp"),
        ("lrmoe-c0-emptyrank", "lrmoe", {}, None, [6, 0, 9, 5], 0.0, "compact", 0, "sp"),
        ("lrmoe-c20", "lrmoe", {}, None, [6, 4, 9, 5], 0.2, "compact", 0, "emulate"),
        ("lrmoe-c20-noreplica", "lrmoe", {}, 0, [6, 0, 9, 5], 0.2, "compact", 0, "emulate"),
        ("symi-cf1-drops", "symi", {"capacity_factor": 1.0}, None, [6, 4, 9, 5], 0.0, "compact", 1, "emulate"),
        ("lrmoe-c20-gelu", "lrmoe", {}, None, [6, 4, 9, 5], 0.2, "compact", 0, "emulate"),
    ],
}
REPLICATING = ("symi-c0", "ultraep-c0", "ultraep_greedy-c0", "lrmoe-c0", "lrmoe-c20", "lrmoe-c0-gelu", "lrmoe-c20-gelu")
# a case whose name ends in one of these runs the experts with that activation (others: SiLU, fused);
# tanh is a plain function that nothing special-cases
ACTIVATIONS = {"gelu": torch.nn.GELU(), "tanh": torch.tanh}


def activation_of_case(name):
    return ACTIVATIONS.get(name.rsplit("-", 1)[-1])


def is_split(name):
    """A case whose budget lies between the plan of half its tokens and the whole call's."""
    return "split" in name.split("-")


def make_data(tokens, seed):
    """Full data of every rank (all ranks build the same): skewed routing, expert HOT takes half the pairs."""
    T = sum(tokens)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, dtype=f64, generator=g)
    others = torch.tensor([e for e in range(E) if e != HOT])
    idx = torch.stack([torch.full((T,), HOT), others[torch.randint(0, E - 1, (T,), generator=g)]], 1)
    w = torch.rand(T, K, dtype=f64, generator=g) + 0.1
    gu = torch.randn(E, 2 * I, H, dtype=f64, generator=g) / H**0.5
    dn = torch.randn(E, H, I, dtype=f64, generator=g) / I**0.5
    dy = torch.randn(T, H, dtype=f64, generator=g)
    return x, idx, w, gu, dn, dy


def bounds(tokens):
    off = np.cumsum([0] + list(tokens))
    return [(int(off[r]), int(off[r + 1])) for r in range(len(tokens))]


def plan_arrays(plan):
    if isinstance(plan, list):
        return [plan_arrays(p) for p in plan]
    return {"send": plan.send_GN, "quota": plan.backward_quota_GN, "expert": plan.expert_N, "rank": plan.rank_N,
            "replica": plan.is_replica_N, "dropped": plan.dropped_GE, "fallback": plan.fallback}


# ----------------------------------------------------------------------------- worker side
def run_case(case, rank, G, seed):
    from lrmoe.parallel.runtime import ExpertParallel, ExpertParallelExperts

    name, placement, options, extra, tokens, drop, mode, warmup, _ = case
    x, idx, w, gu, dn, dy = make_data(tokens, seed)
    lo, hi = bounds(tokens)[rank]
    El = E // G
    budget = float("inf")
    if is_split(name):  # a budget between the piece of 2 and the whole step: split_microbatch
        from lrmoe.planning.policies import plan_placement

        ep0 = ExpertParallel(E, None, placement, **options)
        demand = np.stack([np.bincount(idx[a:b].reshape(-1).numpy(), minlength=E) for a, b in bounds(tokens)])
        mem = plan_placement(placement, demand, ep0.cluster, ep0.dims(H, I, K, 8), float("inf")).memory
        budget = float(mem.base_G.max() + 0.6 * mem.tokens_G.max())
    ep = ExpertParallel(E, None, placement, budget_bytes=budget,
                        slots_per_rank=None if extra is None else El + extra, **options)
    module = ExpertParallelExperts.from_full(gu, dn, ep, BackwardPolicy(drop_ratio=drop, mode=mode),
                                             activation=activation_of_case(name))
    for _ in range(warmup):  # stateful policies (SYMI) plan from the previous training step
        module(x[lo:hi], idx[lo:hi], w[lo:hi])  # (a forward with gradients enabled advances the state)
    xl, wl = x[lo:hi].clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
    y = module(xl, idx[lo:hi], wl)
    y.backward(dy[lo:hi])
    rec = module.last_backward
    last_forward_bytes = dict(ep.last_forward_bytes)
    plan_s = {"record": rec.plan_seconds, "call": ep.plan_seconds, "total": ep.plan_seconds_total}
    state_eval = state_train = None
    if warmup:  # an evaluation call (no_grad, other routing) must not move the planner's state; training does
        before = pickle.dumps(ep.state)
        with torch.no_grad():
            module(x[lo:hi], (idx[lo:hi] + 1) % E, w[lo:hi])
        state_eval = pickle.dumps(ep.state) == before
        module(x[lo:hi], (idx[lo:hi] + 1) % E, w[lo:hi])
        state_train = pickle.dumps(ep.state) == before
    return {"state_unchanged_by_eval": state_eval, "state_unchanged_by_train": state_train,"y": y.detach(), "gx": xl.grad, "gw": wl.grad, "ggu": module.gate_up_proj.grad,
            "gdn": module.down_proj.grad, "kept_mask": rec.kept_mask, "scores": rec.scores, "kept": rec.kept,
            "quota": rec.quota, "demand": rec.demand, "comm": rec.comm_bytes, "plan": plan_arrays(rec.plan),
            "last_forward_bytes": last_forward_bytes, "plan_s": plan_s}


HF_VOCAB, HF_SEQS, HF_LEN = 61, 4, 10


def run_hf_case(rank, G, act="silu"):
    """A Qwen3-MoE model (``hidden_act`` act) with its experts parallelized (lrmoe placement,
    replicas) against the same model in one process: loss, every gradient after the data-parallel
    sync, the global gradient norm and the gathered state dict."""
    import lrmoe.hf as hf
    from lrmoe.hf import parallel as ep_hf

    ids = torch.randint(0, HF_VOCAB, (HF_SEQS, HF_LEN), generator=torch.Generator().manual_seed(7))
    ref = hf.build_model("qwen3-moe-tiny", vocab_size=HF_VOCAB, seed=5, dtype=f64, hidden_act=act)
    ref(input_ids=ids, labels=ids).loss.backward()
    model = hf.build_model("qwen3-moe-tiny", vocab_size=HF_VOCAB, seed=5, dtype=f64, hidden_act=act)
    eps = ep_hf.parallelize_experts(model, None, "lrmoe", policy=BackwardPolicy(0.0))
    full = ep_hf.full_state_dict(model)
    same_state = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    per = HF_SEQS // G
    mine = ids[rank * per:(rank + 1) * per]
    model(input_ids=mine, labels=mine).loss.backward()
    ep_hf.finish_grad_sync(model)
    norm = ep_hf.clip_grad_norm_(model, 1e9)
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    recs = hf.backward_records(model)
    general = [hf.activation_of(m) is not None for m in hf.experts_modules(model)]  # not the fused SiLU path
    return {"general_path": general, "grads": {n: p.grad for n, p in model.named_parameters()},
            "ref_grads": {n: p.grad for n, p in ref.named_parameters()}, "norm": norm, "ref_norm": ref_norm,
            "same_state": same_state, "records": [r is not None and r.filled for r in recs],
            "replicas": [bool(ep.last_plan.is_replica_N.any()) for ep in eps]}


def worker(rank, G, port, out_dir, cases, seed):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=G,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        for case in cases:
            try:
                if case[0].startswith("hf"):
                    res = run_hf_case(rank, G, "gelu" if case[0] == "hf-gelu" else "silu")
                else:
                    res = run_case(case, rank, G, seed)
            except Exception:
                res = {"error": traceback.format_exc()}
            torch.save(res, os.path.join(out_dir, f"{case[0]}.rank{rank}.pt"))
            if "error" in res:
                raise RuntimeError(f"case {case[0]} failed on rank {rank}:\n{res['error']}")
    finally:
        dist.destroy_process_group()


def error_worker(rank, G, port, out_dir):
    """Three failures that must raise on the ranks involved, never hang."""
    from lrmoe.parallel.collectives import EPCommunicationError
    from lrmoe.parallel.runtime import EPOutOfMemoryError, ExpertParallel, ExpertParallelExperts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=G,
                            timeout=datetime.timedelta(seconds=3))
    x, idx, w, gu, dn, dy = make_data([6, 6], 0)
    lo, hi = bounds([6, 6])[rank]
    out = {}

    def outcome(call, exc=ValueError):
        """'no error', or the exception ``call()`` raised as 'TypeName: message'."""
        try:
            call()
            return "no error"
        except exc as e:
            return f"{type(e).__name__}: {e}"

    def layer(placement="fixed", policy=None, activation=None, **options):
        return ExpertParallelExperts.from_full(gu, dn, ExpertParallel(E, None, placement, **options), policy,
                                               activation=activation)

    # 1. top_k differs between ranks -> ValueError on both (after one all_gather, no hang).
    k = 2 if rank == 0 else 1
    out["mismatch"] = outcome(lambda: layer()(x[lo:hi], idx[lo:hi, :k], w[lo:hi, :k]))
    # 1b. the backward policy's quota options differ (different plans would follow) -> ValueError.
    m = layer(policy=BackwardPolicy(0.5, quota_kwargs={"min_keep": 2 * rank}))
    out["quota_kwargs"] = outcome(lambda: m(x[lo:hi], idx[lo:hi], w[lo:hi]))
    # 1c. the planner's options differ -> ValueError.
    m = layer("ultraep", min_tokens=1 + rank)
    out["planner_options"] = outcome(lambda: m(x[lo:hi], idx[lo:hi], w[lo:hi]))
    # 1d. the activation differs -> ValueError naming both.
    m = layer(activation=None if rank == 0 else torch.nn.GELU(approximate="tanh"))
    out["activation"] = outcome(lambda: m(x[lo:hi], idx[lo:hi], w[lo:hi]))
    # 1e. SiLU spelled differently is the same activation (the fused path on both ranks); an
    # activation with parameters is refused when the module is made.
    m = layer(activation=torch.nn.SiLU() if rank == 0 else None)
    m(x[lo:hi], idx[lo:hi], w[lo:hi])
    out["silu_spellings"] = m.activation
    out["prelu"] = outcome(lambda: layer(activation=torch.nn.PReLU()))
    # 2. a plan over budget with fallback 'oom' -> EPOutOfMemoryError on both.
    m = layer(budget_bytes=1000, fallback="oom")
    out["oom"] = outcome(lambda: m(x[lo:hi], idx[lo:hi], w[lo:hi]), EPOutOfMemoryError)
    # 2b. LRMoE at C0 under memory pressure: nothing is scored, so every row is kept and the plan
    # must not count on shrunken quotas (it used to: fallback shrink_quota, kept > quota, budget exceeded).
    ep_free = ExpertParallel(E, None, "lrmoe")
    ExpertParallelExperts.from_full(gu, dn, ep_free, BackwardPolicy(0.0))(x[lo:hi], idx[lo:hi], w[lo:hi])
    mem = ep_free.last_plan.memory
    static = int((mem.base_G + mem.replicas_G).max())
    ep_b = ExpertParallel(E, None, "lrmoe", budget_bytes=static + (mem.peak - static) // 3)
    m = ExpertParallelExperts.from_full(gu, dn, ep_b, BackwardPolicy(0.0, profile=True))
    (m(x[lo:hi], idx[lo:hi], w[lo:hi]) * dy[lo:hi]).sum().backward()
    plans = ep_b.last_plan if isinstance(ep_b.last_plan, list) else [ep_b.last_plan]
    out["c0_budget"] = dict(fallbacks=[p.fallback for p in plans], pieces=len(plans),
                            quota_is_send=all(bool((p.backward_quota_GN == p.send_GN).all()) for p in plans),
                            fits=all(p.memory.peak <= ep_b.budget_bytes for p in plans),
                            kept_is_quota=m.last_backward.kept.tolist() == m.last_backward.quota.tolist(),
                            timings=sorted(m.last_backward.timings),  # summed over the pieces
                            plan_s=(m.last_backward.plan_seconds, m.last_backward.timings.get("fwd_plan"),
                                    ep_b.plan_seconds))
    # 2c. expert weights of different dtypes: a ValueError before any collective
    m = layer()
    m.down_proj.data = m.down_proj.data.float()
    out["dtypes"] = outcome(lambda: m(x[lo:hi], idx[lo:hi], w[lo:hi]))
    # 2d. bad settings fail when the layer is made, not at its first call
    out["settings"] = [outcome(lambda: ExpertParallel(E, None, "fixed", **kw)) for kw in (
        dict(budget_bytes=-1), dict(budget_bytes=float("nan")), dict(grad_bytes=-2),
        dict(optimizer_bytes_per_param=1.5), dict(fast_domains=((0,), (0, 1))), dict(slots_per_rank=0),
        dict(min_tokens=3), dict(capacity_factor=-1.0))]
    # 3. rank 1 never calls the layer: rank 0 must get EPCommunicationError from the PG timeout,
    # while rank 1 is still alive (not from rank 1 exiting and closing its connections).
    m = ExpertParallelExperts.from_full(gu, dn, ExpertParallel(E, None, "fixed"))
    raised = os.path.join(out_dir, "missing_peer.rank0.raised")
    if rank == 0:
        try:
            m(x[lo:hi], idx[lo:hi], w[lo:hi])
            out["missing_peer"] = "no error"
        except EPCommunicationError as e:
            out["missing_peer"] = f"EPCommunicationError: {e}"
        open(raised, "w").close()
    else:  # wait, alive, until rank 0 has raised (the spawn's deadline bounds a hang)
        while not os.path.exists(raised):
            time.sleep(0.05)
        out["alive_when_peer_raised"] = True
    torch.save(out, os.path.join(out_dir, f"errors.rank{rank}.pt"))
    os._exit(0)  # the group is broken on purpose: skip the teardown


# ----------------------------------------------------------------------------- test side
SEED = 1234


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for G, cases in CASES.items():
        d = tmp_path_factory.mktemp(f"ep{G}")
        spawn(worker, G, str(d), cases, SEED, deadline_s=SPAWN_DEADLINE_S)
        out[G] = d
    return out


def load(results, G, name):
    d = results[G]
    ranks = [torch.load(d / f"{name}.rank{r}.pt", weights_only=False) for r in range(G)]
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}: {res['error']}"
    return ranks


def assemble(ranks):
    cat = lambda k: torch.cat([r[k] for r in ranks])  # noqa: E731
    return {k: cat(k) for k in ("y", "gx", "gw", "ggu", "gdn", "kept_mask")}


def assert_close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{what}: {m}")


def case_of(G, name):
    return next(c for c in CASES[G] if c[0] == name)


def single_process(case):
    x, idx, w, gu, dn, dy = make_data(case[4], SEED)
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    y = lrmoe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], BackwardPolicy(drop_ratio=0.0),
                      activation=activation_of_case(case[0]))
    y.backward(dy)
    return {"y": y.detach(), "gx": leaves[0].grad, "gw": leaves[1].grad, "ggu": leaves[2].grad, "gdn": leaves[3].grad}


def emulate_buckets(idx, tokens, plan):
    """Independent per-pair emulation of the EP assignment: on source s, expert e's pairs in pair
    order fill e's instances in instance order (send[s, i] each); the rest are dropped.
    Returns the bucket (instance, or -1 for dropped) of every pair [T*K]."""
    bucket = []
    for s, (a, b) in enumerate(bounds(tokens)):
        flat = idx[a:b].reshape(-1).tolist()
        used = {}
        for e in flat:
            j = used.get(e, 0)
            used[e] = j + 1
            inst, acc = -1, 0
            for i in np.flatnonzero(plan["expert"] == e):
                acc += int(plan["send"][s, i])
                if j < acc:
                    inst = int(i)
                    break
            bucket.append(inst)
    return bucket


def emulate(case, plan):
    """The EP layer's semantics computed per pair: dropped pairs contribute nothing; in every
    (source, instance) bucket the quota best pairs by alpha^2 ||g||^2 ||h||^2 keep their
    expert gradient (ties: lower pair index)."""
    x, idx, w, gu, dn, dy = make_data(case[4], SEED)
    T = x.shape[0]
    bucket = emulate_buckets(idx, case[4], plan)
    live = torch.tensor([b >= 0 for b in bucket]).view(T, K)
    act = activation_of_case(case[0])
    _, h2 = moe_loop(x, idx, w, gu, dn, activation=act)
    scores = (w**2 * (dy**2).sum(1, keepdim=True) * h2).reshape(-1).tolist()
    keep = torch.zeros(T * K, dtype=torch.bool)
    src = [s for s, (a, b) in enumerate(bounds(case[4])) for _ in range((b - a) * K)]
    for s in range(len(case[4])):
        for i in range(len(plan["expert"])):
            members = [u for u in range(T * K) if src[u] == s and bucket[u] == i]
            members.sort(key=lambda u: (-scores[u], u))
            keep[members[:int(plan["quota"][s, i])]] = True
    keep = keep.view(T, K)
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    y, _ = moe_loop(leaves[0], idx, leaves[1] * live, leaves[2], leaves[3], keep, activation=act)
    y.backward(dy)
    ref = {"y": y.detach(), "gx": leaves[0].grad, "gw": leaves[1].grad, "ggu": leaves[2].grad, "gdn": leaves[3].grad,
           "kept_mask": keep}
    return ref, torch.tensor(scores, dtype=f64).view(T, K), live


def remote_rows(plan, counts):
    """Rows that cross the network: sum over (source s, instance i on another rank) of counts[s, i]."""
    G = counts.shape[0]
    return int(sum(counts[s, i] for s in range(G) for i in range(counts.shape[1]) if plan["rank"][i] != s))


ALL = [(G, c[0]) for G, cs in CASES.items() for c in cs if not c[0].startswith("hf")]


@pytest.mark.parametrize("G,name", ALL, ids=[f"G{G}-{n}" for G, n in ALL])
def test_ep_layer(results, G, name):
    case = case_of(G, name)
    ranks = load(results, G, name)
    ep = assemble(ranks)
    plan = ranks[0]["plan"]
    if case[-1] == "sp":
        ref = single_process(case)
        for k in ("y", "gx", "gw", "ggu", "gdn"):
            assert_close(ep[k], ref[k], f"{name} (G={G}) {k} vs single process")
        assert bool(ep["kept_mask"].all()), "C0 keeps every pair"
    else:
        ref, scores, live = emulate(case, plan)
        assert torch.equal(ep["kept_mask"], ref["kept_mask"]), "kept set differs from the emulated EP selection"
        for k in ("y", "gx", "gw", "ggu", "gdn"):
            assert_close(ep[k], ref[k], f"{name} (G={G}) {k} vs emulation")
        if case[5] > 0:
            torch.testing.assert_close(torch.cat([r["scores"] for r in ranks]).double(), scores, rtol=1e-5, atol=0)
            # The global per-expert quota is exactly the single-process one (same quota policy).
            x, idx, *_ = make_data(case[4], SEED)
            d_E = torch.bincount(idx.reshape(-1), minlength=E)
            q_E = quota_for(d_E, retained_total(int(d_E.sum()), case[5]), "waterfill")
            assert torch.equal(sum(r["kept"] for r in ranks), q_E)
            assert torch.equal(sum(r["quota"] for r in ranks), q_E)
        if "drops" in name:
            assert not bool(live.all()), "this case is meant to drop pairs over capacity"
    # Communication: only computed (forward) and kept (backward) rows cross the network.
    plans = plan if isinstance(plan, list) else [plan]
    fwd = sum(remote_rows(p, p["send"]) for p in plans)
    comm = {k: sum(r["comm"].get(k, 0) for r in ranks) for k in ranks[0]["comm"]}
    assert comm["fwd_dispatch"] == comm["fwd_combine"] == fwd * H * 8
    if case[6] == "compact":
        kept = sum(remote_rows(p, p["quota"]) for p in plans)
        assert comm["bwd_grad_rows"] == comm["bwd_dx"] == kept * H * 8
    else:  # mask mode sends every computed row
        assert comm["bwd_grad_rows"] == fwd * H * 8
    if name in REPLICATING:
        assert plan["replica"].any() and comm["fwd_weights"] > 0 and comm["bwd_weight_grads"] > 0, \
            "this case is meant to exercise replicas"
    if "noreplica" in name:
        assert not plan["replica"].any() and "fwd_weights" not in comm
    if is_split(name):
        assert isinstance(plan, list) and len(plan) >= 2


@pytest.mark.parametrize("name", ["hf", "hf-gelu"])
def test_transformers_model_with_parallel_experts(results, name):
    """SiLU (the fused path) and GELU (transformers' ``hidden_act="gelu"``: the general path)."""
    G = 2
    ranks = load(results, G, name)
    assert all(r["general_path"] == [name == "hf-gelu"] * len(r["general_path"]) for r in ranks)
    for r, res in enumerate(ranks):
        assert res["same_state"], "full_state_dict must give back the unsharded weights"
        assert all(res["records"]), "every MoE layer fills its backward record"
        # clip_grad_norm_ returns the norm as float32: equal up to that rounding
        torch.testing.assert_close(res["norm"].double(), res["ref_norm"].double(), rtol=2.0**-23, atol=0)
        for n, g in res["grads"].items():
            ref = res["ref_grads"][n]
            if g.shape != ref.shape:  # a sharded expert weight: this rank's block
                ref = ref.view(G, -1, *ref.shape[1:])[r]
            assert_close(g, ref, f"rank {r} grad of {n}")
    assert any(ranks[0]["replicas"]), "the lrmoe placement is meant to add replicas here"


def test_kept_set_distance(results):
    """How far the EP kept set is from the single-process per-expert top-quota set (reported; the
    per-expert counts are equal by construction)."""
    for G in CASES:
        case = case_of(G, "lrmoe-c20")
        ranks = load(results, G, "lrmoe-c20")
        scores = torch.cat([r["scores"] for r in ranks])
        x, idx, *_ = make_data(case[4], SEED)
        d_E = torch.bincount(idx.reshape(-1), minlength=E)
        q_E = quota_for(d_E, retained_total(int(d_E.sum()), 0.2), "waterfill")
        sp = expected_keep(scores, idx, q_E)
        ep = torch.cat([r["kept_mask"] for r in ranks])
        overlap = int((sp & ep).sum()) / int(q_E.sum())
        mass = float(scores[ep].sum() / scores[sp].sum())
        print(f"G={G}: |EP kept ∩ top-quota| / n_keep = {overlap:.3f}, score mass ratio = {mass:.4f}")
        assert 0.5 <= overlap <= 1.0 and 0.0 < mass <= 1.0 + 1e-6


@pytest.mark.parametrize("G", sorted(CASES))
def test_evaluation_leaves_the_planner_state(results, G):
    """SYMI plans from the previous training step's popularity: a no_grad evaluation call does
    not advance it, a training call (gradients enabled) does."""
    stateful = [c[0] for c in CASES[G] if not c[0].startswith("hf") and c[7]]
    assert stateful
    for name in stateful:
        for r, res in enumerate(load(results, G, name)):
            assert res["state_unchanged_by_eval"] is True, (name, r)
            assert res["state_unchanged_by_train"] is False, (name, r)


@pytest.mark.parametrize("G", sorted(CASES))
def test_last_forward_bytes_cover_the_whole_call(results, G):
    """``ep.last_forward_bytes`` equals the record's forward keys, also when the microbatch was
    split into pieces (it used to hold the last piece only)."""
    for case in CASES[G]:
        if case[0].startswith("hf"):
            continue
        for r, res in enumerate(load(results, G, case[0])):
            fwd = {k: v for k, v in res["comm"].items() if k.startswith("fwd_")}
            assert res["last_forward_bytes"] == fwd, (case[0], r)
            if is_split(case[0]):  # the case really was split, and every piece sent rows
                assert isinstance(res["plan"], list) and len(res["plan"]) > 1, (case[0], r)


@pytest.mark.parametrize("G", sorted(CASES))
def test_records_carry_the_planning_time(results, G):
    """Every call's record holds the seconds that call spent planning (> 0, finite), the same as
    ``ep.plan_seconds`` after the call (for a split microbatch: the split's plan plus every piece's);
    ``ep.plan_seconds_total`` counts every call (warm-up calls included)."""
    for case in CASES[G]:
        if case[0].startswith("hf"):
            continue
        for r, res in enumerate(load(results, G, case[0])):
            p = res["plan_s"]
            assert math.isfinite(p["record"]) and p["record"] > 0, (case[0], r, p)
            assert p["record"] == pytest.approx(p["call"], rel=1e-9), (case[0], r, p)
            assert p["total"] >= p["call"], (case[0], r, p)
            if case[7]:  # warm-up calls planned too
                assert p["total"] > p["call"], (case[0], r, p)


def test_failures_raise_not_hang(tmp_path):
    spawn(error_worker, 2, str(tmp_path), deadline_s=120)  # a hang fails the test
    r0 = torch.load(tmp_path / "errors.rank0.pt")
    r1 = torch.load(tmp_path / "errors.rank1.pt")
    for r in (r0, r1):
        assert r["mismatch"].startswith("ValueError") and "top_k: rank 0 has 2, rank 1 has 1" in r["mismatch"]
        assert r["oom"].startswith("EPOutOfMemoryError") and "budget" in r["oom"]
        assert r["quota_kwargs"].startswith("ValueError") and "quota/scorer options" in r["quota_kwargs"]
        assert "('min_keep', 0)" in r["quota_kwargs"] and "('min_keep', 2)" in r["quota_kwargs"]  # values, not CRCs
        assert r["planner_options"].startswith("ValueError") and "planner options" in r["planner_options"]
        assert "('min_tokens', 1)" in r["planner_options"] and "('min_tokens', 2)" in r["planner_options"]
        assert "fallback 'oom' could not make it fit" in r["oom"]
        assert "activation: rank 0 has silu, rank 1 has GELU(approximate='tanh')" in r["activation"], r["activation"]
        assert r["silu_spellings"] is None
        assert "activation PReLU has parameters" in r["prelu"] and "accepted: activations without parameters" in r["prelu"]
        c0 = r["c0_budget"]
        assert "shrink_quota" not in c0["fallbacks"] and c0["quota_is_send"] and c0["kept_is_quota"], c0
        assert c0["fits"] and c0["pieces"] > 1, c0  # the microbatch is split instead
        assert {"gemm", "router_grad", "fwd_dispatch", "fwd_plan"} <= set(c0["timings"]), c0
        rec_s, fwd_plan, call_s = c0["plan_s"]  # a split call: the record sums the split's plan and every piece's
        assert math.isfinite(rec_s) and rec_s > 0 and fwd_plan == rec_s and rec_s == pytest.approx(call_s, rel=1e-9), c0
        assert "must share a dtype" in r["dtypes"]
        want = ["budget_bytes must be a number > 0 (math.inf for no budget), got -1",
                "budget_bytes must be a number > 0 (math.inf for no budget), got nan",
                "ModelDims.grad_bytes must be an integer >= 0, got -2",
                "ModelDims.optimizer_bytes_per_param must be an integer >= 0, got 1.5",
                "Cluster.fast_domains must partition ranks 0..1", "slots_per_rank must be an int >= E/G",
                "placement policy 'fixed' got unknown options ['min_tokens']; accepted:", "capacity_factor"]
        assert len(r["settings"]) == len(want)
        for got, w in zip(r["settings"], want):
            assert got.startswith("ValueError: ") and w in got, (got, w)
    assert r0["missing_peer"].startswith("EPCommunicationError"), r0["missing_peer"]
    assert "all_gather (demand)" in r0["missing_peer"] and "rank 0 of 2" in r0["missing_peer"]
    assert r1.get("alive_when_peer_raised") is True  # the timeout raised it, not the peer's exit


def test_activation_keys_tell_activations_apart():
    import functools

    from lrmoe.parallel.runtime import activation_key

    keys = [activation_key(a) for a in (None, torch.nn.GELU(), torch.nn.GELU(approximate="tanh"), torch.tanh,
                                        functools.partial(torch.nn.functional.gelu, approximate="tanh"),
                                        functools.partial(torch.nn.functional.gelu, approximate="none"))]
    assert len(set(keys)) == len(keys), keys
    assert keys[0] == "silu" and keys[2] == "GELU(approximate='tanh')"


def test_needs_initialised_process_group():
    from lrmoe.parallel.runtime import ExpertParallel

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="not initialised"):
        ExpertParallel(8)
