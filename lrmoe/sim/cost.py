"""The cost model: how long one MoE layer takes under one executed plan, per phase.

Every phase is a step of the expert-parallel runtime (:mod:`lrmoe.parallel.function`) and ends
with its slowest rank (the collectives synchronise the ranks), so a phase's time is the maximum
over ranks of that rank's time. docs/simulator.md ("Cost model") writes each term down; the
notation is the plan's: ``send[s, i]`` pairs source s sends to instance i, ``quota[s, i]`` of them
kept in backward, instances on ranks ``rank_N``; H hidden, I expert FFN, b bytes per value.

``overhead`` (both passes): the hardware's fixed host cost of one layer call (calibrated on CPUs,
0 in the GPU presets). Forward: ``demand`` (all-gather of the [G, E] counts), ``plan`` (the planner's measured host
time, given by the caller), ``weight_sync`` (replica weights, owner -> host), ``dispatch`` (token
rows to instances), ``gemm`` (gate/up and down grouped GEMMs, 6 H I FLOPs per row, + SwiGLU),
``combine`` (outputs back, + one fp32 ||h||^2 per row when the backward selects), ``rows`` (the
memory-bound row copies around them: token side, the gather of each pair's X row, the scatter of
its output into [T, K, H] and the weighted sum, 5 H b bytes per pair; expert side, the reorder of
received rows into expert groups and back, 4 H b bytes per row).
Backward: ``router_grad`` (alpha gradient of every routed pair: reads O and g), ``score_select``
(when selecting), ``grad_rows`` (kept rows to the expert side: compact sends kept rows and their
int32 positions, mask and full send every row), ``gather`` (the compact path's gathers of kept X
and GU rows; zero when the hardware fuses them into the GEMM loads), ``gemm`` (dgrad + wgrad on
the kept rows, 12 H I FLOPs per row, + the SwiGLU backward), ``dx`` (dX rows back),
``weight_grads`` (replica gradients back to their owners), ``rows`` (token side, building the
alpha*g rows and summing the returned dX per token, 5 H b bytes per row sent; expert side, the
reorder of received rows and of dX, 4 H b bytes per row).
"""
from __future__ import annotations

import numpy as np

from ..planning.plan import Cluster, ModelDims, Plan, fetched_GE
from .hardware import Hardware

FORWARD = ("overhead", "demand", "plan", "layout", "weight_sync", "dispatch", "gemm", "combine", "rows")
BACKWARD = ("overhead", "router_grad", "score_select", "grad_rows", "gather", "gemm", "dx", "weight_grads", "rows")


def _a2a(hw: Hardware, cluster: Cluster, bytes_GG: np.ndarray) -> float:
    """Slowest rank of one all-to-all whose rank s sends bytes_GG[s, t] to rank t (diagonal: local)."""
    G = bytes_GG.shape[0]
    if G == 1:
        return 0.0
    b = bytes_GG.astype(np.float64).copy()
    np.fill_diagonal(b, 0.0)
    dom = cluster.domain_G
    same = dom[:, None] == dom[None, :]
    fast = np.maximum((b * same).sum(1), (b * same).sum(0))
    net = np.maximum((b * ~same).sum(1), (b * ~same).sum(0))
    return max(hw.a2a_seconds(f, n) for f, n in zip(fast.tolist(), net.tolist()))


def _to_ranks(x_GN: np.ndarray, rank_N: np.ndarray, G: int) -> np.ndarray:
    """[G, N] per (source, instance) -> [G, G] per (source, destination rank)."""
    out = np.zeros((G, G), dtype=np.float64)
    for t in range(G):
        out[:, t] = x_GN[:, rank_N == t].sum(1)
    return out


#: bumped whenever a change here changes a cost: caches of simulated times (T3's ``sim/e3``) key on it.
#: 2: weight copies are the (rank, expert) pairs the runtime fetches; dX rows return without positions.
#: 3: the host's layout time (lrmoe.planning.layout.layout_counts, slowest rank) is charged beside planning.
COST_MODEL_VERSION = 3


def replica_bytes_GG(plan: Plan, dims: ModelDims, bytes_per_param: int) -> np.ndarray:
    """[G, G] bytes of expert weights (or their gradients, reversed) from owners to the ranks that
    fetch them: one copy per (rank, expert) the rank holds an instance of without owning it
    (:func:`lrmoe.planning.plan.fetched_GE`, what the runtime's layout fetches), not per instance
    flagged ``is_replica``."""
    G, E = plan.demand_GE.shape
    per = 3 * dims.hidden * dims.intermediate * bytes_per_param
    fetched = fetched_GE(plan.expert_N, plan.rank_N, G, E)  # [host, expert]
    owner_E = np.arange(E) // (E // G)
    out = np.zeros((G, G), dtype=np.float64)
    host, e = np.nonzero(fetched)
    np.add.at(out, (owner_E[e], host), per)
    return out


#: The runtime's all-to-all kinds (``BackwardRecord.comm_bytes``; ``lrmoe.train.ep.COMM_KEYS``), in its order.
COMM_KINDS = ("fwd_weights", "fwd_dispatch", "fwd_combine", "fwd_phi", "bwd_grad_rows", "bwd_grad_index", "bwd_dx",
              "bwd_weight_grads")


def comm_matrices(plan: Plan, dims: ModelDims, *, selects: bool, compact: bool = True) -> dict[str, np.ndarray]:
    """Per all-to-all kind of the runtime, the [G, G] bytes rank s sends to rank t (the diagonal:
    what stays on a rank) when the plan is executed: token rows and weights in ``dims.dtype_bytes``
    (the runtime sends both in the weights' dtype), phi norms as float32, kept-row positions as
    int32 (compact path only), weight gradients back to the owners. :func:`layer_cost` times these
    matrices; ``lrmoe bench simulator`` checks them against the bytes the runtime counts."""
    G = plan.demand_GE.shape[0]
    H, b = dims.hidden, dims.dtype_bytes
    send, quota, rank_N = plan.send_GN, plan.backward_quota_GN, plan.rank_N
    compacts = selects and compact and bool((quota != send).any())
    rows_GG = _to_ranks(send, rank_N, G)  # token side -> expert side, pairs
    back_GG = _to_ranks(quota, rank_N, G) if compacts else rows_GG
    weights_GG = replica_bytes_GG(plan, dims, b)
    return {"fwd_weights": weights_GG, "fwd_dispatch": rows_GG * (H * b), "fwd_combine": rows_GG.T * (H * b),
            "fwd_phi": rows_GG.T * 4 if selects else np.zeros((G, G)), "bwd_grad_rows": back_GG * (H * b),
            "bwd_grad_index": back_GG * 4 if compacts else np.zeros((G, G)), "bwd_dx": back_GG.T * (H * b),
            "bwd_weight_grads": weights_GG.T}


def comm_bytes_G(plan: Plan, dims: ModelDims, *, selects: bool, compact: bool = True) -> dict[str, np.ndarray]:
    """Per kind, the bytes each rank sends to the other ranks ([G]; the runtime's count)."""
    out = {}
    for kind, m in comm_matrices(plan, dims, selects=selects, compact=compact).items():
        off = m.copy()
        np.fill_diagonal(off, 0.0)
        out[kind] = off.sum(1)
    return out


def layer_cost(plan: Plan, cluster: Cluster, dims: ModelDims, hw: Hardware, *, selects: bool, compact: bool = True,
               plan_seconds: float = 0.0) -> dict:
    """Phase times (seconds, slowest rank each) of one executed plan (one microbatch piece):
    ``{"forward": {phase: s}, "backward": {phase: s}, "forward_s", "backward_s", "total_s",
    "pairs", "kept"}``. ``selects``: the backward scores and selects; ``compact``: the compact
    path (kept rows only cross the network and enter the GEMMs) rather than mask."""
    G = plan.demand_GE.shape[0]
    H, I, b = dims.hidden, dims.intermediate, dims.dtype_bytes
    send, quota, rank_N = plan.send_GN, plan.backward_quota_GN, plan.rank_N
    compacts = selects and compact and bool((quota != send).any())
    rows_N, kept_N = send.sum(0), quota.sum(0)
    pairs_G = send.sum(1)  # computed pairs of each rank's own tokens (over-capacity drops excluded)
    back_rows_N = kept_N if compacts else rows_N
    back_sent_G = (quota if compacts else send).sum(1)
    M = comm_matrices(plan, dims, selects=selects, compact=compact)
    has_replica = bool(fetched_GE(plan.expert_N, plan.rank_N, G, plan.demand_GE.shape[1]).any())

    def per_rank(fn) -> float:
        return max((fn(r) for r in range(G)), default=0.0)

    def on(r):
        return np.flatnonzero(rank_N == r)

    fwd = {
        "overhead": hw.forward_overhead_s,
        "demand": hw.a2a_latency_s if G > 1 else 0.0,  # [G, E] int64 counts: latency-bound
        "plan": float(plan_seconds),
        "layout": 0.0,  # the host's layout_counts: measured and charged by the simulator (lrmoe.sim.simulate)
        "weight_sync": _a2a(hw, cluster, M["fwd_weights"]) if has_replica else 0.0,
        "dispatch": _a2a(hw, cluster, M["fwd_dispatch"]),
        "gemm": per_rank(lambda r: hw.gemm_seconds(rows_N[on(r)], 6.0 * H * I, calls=2)
                         + hw.hbm_seconds(int(rows_N[on(r)].sum()) * 3 * I * b)),  # SwiGLU: read 2I, write I
        "combine": _a2a(hw, cluster, M["fwd_combine"] + M["fwd_phi"]),  # output rows (+ their phi norms)
        "rows": per_rank(lambda r: hw.row_seconds((5 * int(pairs_G[r]) + 4 * int(rows_N[on(r)].sum())) * H * b)),
    }
    bwd = {
        "overhead": hw.backward_overhead_s,
        "router_grad": per_rank(lambda r: hw.hbm_seconds(int(pairs_G[r]) * 2 * H * b)),  # O rows and g per pair
        "score_select": per_rank(lambda r: hw.hbm_seconds(int(pairs_G[r]) * 16)) if selects else 0.0,
        "grad_rows": _a2a(hw, cluster, M["bwd_grad_rows"] + M["bwd_grad_index"]),  # compact: + int32 positions
        "gather": 0.0 if (hw.fuse_gather or not compacts)
        else per_rank(lambda r: hw.row_seconds(2 * int(kept_N[on(r)].sum()) * (H + 2 * I) * b)),
        "gemm": per_rank(lambda r: hw.gemm_seconds(back_rows_N[on(r)], 12.0 * H * I, calls=4)
                         + hw.hbm_seconds(int(back_rows_N[on(r)].sum()) * 5 * I * b)),  # SwiGLU bwd: GU, dh -> dGU
        "dx": _a2a(hw, cluster, M["bwd_dx"]),  # dX rows only: no positions come back
        "weight_grads": _a2a(hw, cluster, M["bwd_weight_grads"]) if has_replica else 0.0,
        "rows": per_rank(lambda r: hw.row_seconds((5 * int(back_sent_G[r]) + 4 * int(back_rows_N[on(r)].sum()))
                                                  * H * b)),
    }
    f, k = sum(fwd.values()), sum(bwd.values())
    return {"forward": fwd, "backward": bwd, "forward_s": f, "backward_s": k, "total_s": f + k,
            "pairs": int(send.sum()), "kept": int(quota.sum())}
