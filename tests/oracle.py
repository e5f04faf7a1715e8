"""Independent references for the tests: a per-token, per-pair loop over plain tensors."""
import torch
import torch.nn.functional as F

f64 = torch.float64


def expert_ref(x_H, gate_up_2IH, down_HI, activation=None):
    gate, up = (gate_up_2IH @ x_H).chunk(2)
    h = (F.silu if activation is None else activation)(gate) * up
    return down_HI @ h, h


def moe_loop(x_TH, idx_TK, w_TK, gate_up, down, kept_TK=None, scale_TK=None, activation=None):
    """y_t = sum_k w_tk * expert(x_t); pairs with kept_TK False keep their forward value and their
    router gradient but contribute nothing to the expert weights' or the inputs' gradient through
    the expert (exactly LRMoE's semantics); a kept pair's gradient through the expert is multiplied
    by ``scale_TK`` when given (the 1/pi of a sampled selection); ``activation`` None is SiLU.
    Returns (y_TH, h_norm2_TK)."""
    T, K = idx_TK.shape
    rows, h2 = [], torch.zeros(T, K, dtype=torch.float64)
    for t in range(T):
        acc = 0
        for k in range(K):
            e = int(idx_TK[t, k])
            o, h = expert_ref(x_TH[t], gate_up[e], down[e], activation)
            h2[t, k] = (h.detach().double() ** 2).sum()
            if kept_TK is not None and not bool(kept_TK[t, k]):
                o = o.detach()
            elif scale_TK is not None:  # value o, gradient scale * do
                o = o * float(scale_TK[t, k]) + (o * (1 - float(scale_TK[t, k]))).detach()
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


def make_case(T, H, I, E, K, *, hot=None, empty=(), seed=None):
    """Random float64 routing case (x, top-k index, weights, gate_up, down, dy): distinct experts per
    token; ``empty`` experts get no pair; ``hot`` sits in most tokens' first slot; ``seed`` None:
    drawn from torch's global RNG (seeded per test)."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ())))
    x = torch.randn(T, H, dtype=f64, generator=g)
    allowed = [e for e in range(E) if e not in empty]
    idx = torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)])
    if hot is not None:  # one expert in most tokens' first slot
        for t in range(T):
            if torch.rand((), generator=g) < 0.8 and hot not in idx[t]:
                idx[t, 0] = hot
    w = torch.rand(T, K, dtype=f64, generator=g) + 0.1
    gu = torch.randn(E, 2 * I, H, dtype=f64, generator=g) / H**0.5
    dn = torch.randn(E, H, I, dtype=f64, generator=g) / I**0.5
    dy = torch.randn(T, H, dtype=f64, generator=g)
    return x, idx, w, gu, dn, dy


# --- runners shared by the core tests: the same case through lrmoe and through the loop -----------

def run_lrmoe(case, policy):
    """(y, [grad of x, weights, gate_up, down], record) of ``lrmoe_experts`` on a make_case case."""
    from lrmoe import BackwardRecord, lrmoe_experts

    x, idx, w, gu, dn, dy = case
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    rec = BackwardRecord()
    y = lrmoe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], policy, rec)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves], rec


def run_loop(case, kept=None, scale=None):
    """(y, [grad of x, weights, gate_up, down], ||h||^2) of :func:`moe_loop` on the same case."""
    x, idx, w, gu, dn, dy = case
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    y, h2 = moe_loop(leaves[0], idx, leaves[1], leaves[2], leaves[3], kept, scale)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves], h2


def assert_close_all(a, b, what):
    for name, u, v in zip(("x", "weights", "gate_up_proj", "down_proj"), a, b):
        torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-10, msg=lambda m: f"{what}: grad of {name}: {m}")
