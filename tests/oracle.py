"""Independent references for the tests: a per-token, per-pair loop over plain tensors."""
import torch
import torch.nn.functional as F


def expert_ref(x_H, gate_up_2IH, down_HI):
    gate, up = (gate_up_2IH @ x_H).chunk(2)
    h = F.silu(gate) * up
    return down_HI @ h, h


def moe_loop(x_TH, idx_TK, w_TK, gate_up, down, kept_TK=None):
    """y_t = sum_k w_tk * expert(x_t); pairs with kept_TK False keep their forward value and their
    router gradient but contribute nothing to the expert weights' or the inputs' gradient through
    the expert (exactly LRMoE's semantics). Returns (y_TH, h_norm2_TK)."""
    T, K = idx_TK.shape
    rows, h2 = [], torch.zeros(T, K, dtype=torch.float64)
    for t in range(T):
        acc = 0
        for k in range(K):
            e = int(idx_TK[t, k])
            o, h = expert_ref(x_TH[t], gate_up[e], down[e])
            h2[t, k] = (h.detach().double() ** 2).sum()
            if kept_TK is not None and not bool(kept_TK[t, k]):
                o = o.detach()
            acc = acc + w_TK[t, k] * o
        rows.append(acc)
    return torch.stack(rows), h2


def expected_keep(scores_TK, idx_TK, quota_E):
    """Per expert, the quota highest scores; ties to the lower pair index; non-finite first."""
    T, K = idx_TK.shape
    s = scores_TK.reshape(-1).tolist()
    s = [float("inf") if x != x or x in (float("inf"), float("-inf")) else x for x in s]
    keep = torch.zeros(T * K, dtype=torch.bool)
    for e, q in enumerate(quota_E.tolist()):
        pairs = sorted((u for u in range(T * K) if int(idx_TK.reshape(-1)[u]) == e), key=lambda u: (-s[u], u))
        keep[pairs[:q]] = True
    return keep.view(T, K)
