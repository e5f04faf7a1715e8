"""The LRMoE planner's compiled loops (:func:`lrmoe.planning.jit.njit`): numpy arrays and scalars in and out.

:mod:`lrmoe.planning.lrmoe_plan` keeps the Python around them (options, the registry of quota
policies, the budget fallbacks, the :class:`~lrmoe.planning.plan.Plan`); everything it repeats per
threshold or per kept-pair probe runs here: the built-in quota policies, the greedy, a candidate's
locality-first routing, instance quotas (with the integral max flow), backward quotas and memory,
the threshold searches and the kept-pair search.

Same plans as the plain Python (the frozen reference, :mod:`lrmoe.planning.reference.lrmoe_plan`):
every float is the same IEEE double operation in the same order. Where the Python used numpy or the
standard library for a float reduction this module has its exact twin: :func:`np_sum` is numpy's
pairwise summation of a 1-D float64 array, :func:`fsum` CPython's ``math.fsum``,
:func:`dinic_flow` scipy's ``maximum_flow`` (Dinic's algorithm: the same flow, not only the same
value). Integer counts stay int64 (plans larger than 2^53 pairs are out of scope for both).

Layout of the arguments: ``prob`` is the tuple of one planner call's constants (:func:`problem`),
``qs`` the tuple one quota vector's search reads (:func:`search_setup`).
"""
from __future__ import annotations

import math

import numpy as np

from .jit import njit
from .plan import add_top, divmod_nonneg, owner_prefix, pop_largest, take_sends

EPS = 1e-9
WATERFILL, PROPORTIONAL = 0, 1  # the built-in quota policies (lrmoe.planning.quota)
# status codes of a quota vector (a bug, never a user error: the Python raises with the details)
QUOTA_OK, QUOTA_BAD = 0, 1


# ----------------------------------------------------------------------------- float reductions
@njit
def _block_sum(a, lo, n):
    """numpy's pairwise_sum over a[lo:lo + n] for n <= 128 (8 accumulators beyond 7 elements)."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    m = n - n % 8
    while i < m:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit
def np_sum(a):
    """``a.sum()`` of a contiguous 1-D float64 array, bit for bit: numpy's pairwise summation (blocks
    of at most 128; a longer range is the sum of its halves, the first a multiple of 8 long), its
    recursion run on an explicit stack (numba's on-disk cache does not keep recursive functions)."""
    n = a.size
    if n <= 128:
        return _block_sum(a, 0, n)
    frames = np.empty((128, 3), dtype=np.int64)  # (start, length, phase); depth <= log2(n)
    values = np.empty(128)
    top, nv = 0, 0
    frames[0, 0], frames[0, 1], frames[0, 2] = 0, n, 0
    while top >= 0:
        lo, m, phase = frames[top, 0], frames[top, 1], frames[top, 2]
        if m <= 128:
            values[nv] = _block_sum(a, lo, m)
            nv += 1
            top -= 1
            continue
        half = m // 2
        half -= half % 8
        if phase == 0:  # the first half
            frames[top, 2] = 1
            top += 1
            frames[top, 0], frames[top, 1], frames[top, 2] = lo, half, 0
        elif phase == 1:  # the second half
            frames[top, 2] = 2
            top += 1
            frames[top, 0], frames[top, 1], frames[top, 2] = lo + half, m - half, 0
        else:
            nv -= 1
            values[nv - 1] = values[nv - 1] + values[nv]
            top -= 1
    return values[0]


@njit
def fsum(a):
    """``math.fsum(a)`` bit for bit (CPython's partials algorithm with its half-even correction)."""
    p = np.empty(32)
    n = 0
    for k in range(a.size):
        x = a[k]
        i = 0
        for j in range(n):
            y = p[j]
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo != 0.0:
                p[i] = lo
                i += 1
            x = hi
        n = i
        if x != 0.0:
            if n >= p.size:
                grown = np.empty(2 * p.size)
                grown[:n] = p[:n]
                p = grown
            p[n] = x
            n += 1
    hi = 0.0
    if n > 0:
        n -= 1
        hi = p[n]
        lo = 0.0
        while n > 0:
            x = hi
            n -= 1
            y = p[n]
            hi = x + y
            lo = y - (hi - x)
            if lo != 0.0:
                break
        if n > 0 and ((lo < 0.0 and p[n - 1] < 0.0) or (lo > 0.0 and p[n - 1] > 0.0)):
            y = lo * 2.0
            x = hi + y
            if y == x - hi:
                hi = x
    return hi


@njit
def exact_sum(a):
    """``math.fsum(a)`` (the correctly rounded sum), fast: a compensated sum (every addition's error
    kept exactly by TwoSum, the errors summed) whose result is returned when its error bound proves
    it correctly rounded, else :func:`fsum` (rare: the sum lies within the bound of a rounding
    boundary, or of zero)."""
    n = a.size
    s, c, err = 0.0, 0.0, 0.0
    for k in range(n):
        x = a[k]
        t = s + x
        z = t - s
        e = (s - (t - z)) + (x - z)  # TwoSum: s + x == t + e exactly
        s = t
        c += e
        err += abs(e)
    hi = s + c
    z = hi - s
    lo = (s - (hi - z)) + (c - z)  # TwoSum(s, c): hi + lo == s + c exactly
    if not (math.isfinite(hi) and hi != 0.0):
        return fsum(a)
    # |exact - (hi + lo)| <= gamma_n * sum|e|, gamma_n = n u / (1 - n u), taken twice for the rounding of err
    bound = 2.0 * (n * 1.1102230246251565e-16) / (1.0 - n * 1.1102230246251565e-16) * err
    m, ex = math.frexp(abs(hi))
    if ex < -1000:
        return fsum(a)
    half_gap = math.ldexp(1.0, ex - 54)  # half the spacing above |hi|
    if m == 0.5:
        half_gap *= 0.5  # a power of two: the spacing below is half as wide
    if abs(lo) + bound < half_gap:
        return hi
    return fsum(a)


@njit
def exact_row_sums(d_EG, frac_E):
    """``math.fsum(d_EG[:, r] * frac_E)`` for every rank r (the demand transposed, [E, G]):
    :func:`exact_sum`'s compensated sums for all ranks at once (the inner loop over ranks is
    contiguous and vectorises), each proven correctly rounded or redone with :func:`fsum`."""
    E, G = d_EG.shape
    s = np.zeros(G)
    c = np.zeros(G)
    err = np.zeros(G)
    for k in range(E):
        f = frac_E[k]
        for r in range(G):
            x = d_EG[k, r] * f
            t = s[r] + x
            z = t - s[r]
            e = (s[r] - (t - z)) + (x - z)
            s[r] = t
            c[r] += e
            err[r] += abs(e)
    out = np.empty(G)
    gamma = 2.0 * (E * 1.1102230246251565e-16) / (1.0 - E * 1.1102230246251565e-16)
    row = np.empty(E)
    for r in range(G):
        hi = s[r] + c[r]
        z = hi - s[r]
        lo = (s[r] - (hi - z)) + (c[r] - z)
        ok = math.isfinite(hi) and hi != 0.0
        if ok:
            m, ex = math.frexp(abs(hi))
            half_gap = math.ldexp(1.0, ex - 54) * (0.5 if m == 0.5 else 1.0)
            ok = ex >= -1000 and abs(lo) + gamma * err[r] < half_gap
        if ok:
            out[r] = hi
        else:
            for k in range(E):
                row[k] = d_EG[k, r] * frac_E[k]
            out[r] = fsum(row)
    return out


# ----------------------------------------------------------------------------- small integer helpers
@njit
def _desc_order(key):
    """Indices by descending key, ties to the lower index (``np.argsort(-key, kind="stable")``)."""
    return np.argsort(-key, kind="mergesort")


@njit
def _add_top(out, rem, missing):
    """:func:`lrmoe.planning.plan.add_top` with its own scratch."""
    if missing > 0:
        add_top(out, rem, missing, np.empty(rem.size, dtype=np.int64))


@njit
def largest_remainder_col(total, w, out, rem, buf):
    """``out[:] = largest_remainder(total, w)`` (:func:`lrmoe.planning.plan.largest_remainder_cols` of one
    column); w >= 0 sums to > 0 whenever total != 0. ``rem``, ``buf``: int64 scratch of w's size."""
    n = w.size
    W = 0
    for i in range(n):
        W += w[i]
    if total == 0 or W <= 0:
        for i in range(n):
            out[i] = 0
        return
    if total == W:  # every weight kept whole
        for i in range(n):
            out[i] = w[i]
        return
    s = 0
    if total < 2**26 and W < 2**26:  # w * total < 2^52: a float quotient is within 1 of the floor
        fW = float(W)
        for i in range(n):
            p = w[i] * total
            f = np.int64(p / fW)
            r = p - f * W
            if r < 0:
                f -= 1
                r += W
            elif r >= W:
                f += 1
                r -= W
            out[i] = f
            rem[i] = r
            s += f
        if n <= 16:  # the remainders one largest at a time, as unique keys (remainder desc, index asc)
            for i in range(n):
                buf[i] = rem[i] * n + (n - 1 - i)
            for _ in range(total - s):
                out[pop_largest(buf, n)] += 1
            return
    else:
        for i in range(n):
            p = w[i] * total
            out[i] = p // W
            rem[i] = p - out[i] * W
            s += out[i]
    add_top(out, rem, total - s, buf)


# ----------------------------------------------------------------------------- quota policies
@njit
def waterfill(d, n_keep):
    """:func:`lrmoe.planning.quota.waterfill_quota` without a floor (int64 in and out)."""
    return waterfill_sorted(d, np.sort(d), n_keep)


@njit
def waterfill_sorted(d, s, n_keep):
    """:func:`waterfill` with ``s = np.sort(d)`` given (a kept-pair search sorts its piece once)."""
    E = d.size
    if E == 0:
        return np.zeros(0, dtype=np.int64)
    # the largest breakpoint b in {0} U {d_e} with f(b) = sum_e min(d_e, b) <= n_keep (f non-decreasing)
    b = 0
    prefix = 0
    for k in range(E):
        f = prefix + s[k] * (E - k)
        if f <= n_keep:
            b = s[k]
        prefix += s[k]
    above = 0
    fb = 0
    for e in range(E):
        if d[e] > b:
            above += 1
            fb += b
        else:
            fb += d[e]
    tau = b + ((n_keep - fb) // above if above else 0)
    q = np.empty(E, dtype=np.int64)
    total = 0
    for e in range(E):
        q[e] = min(d[e], tau)
        total += q[e]
    missing = n_keep - total
    if missing > 0:  # the hottest experts above tau get one more first (ties: the lower index)
        key = np.empty(E, dtype=np.int64)
        for e in range(E):
            key[e] = d[e] if d[e] > tau else -1
        _add_top(q, key, missing)
    return q


@njit
def waterfill_floor(d, n_keep, min_keep):
    """:func:`lrmoe.planning.quota.waterfill_quota` with the ``min_keep`` floor."""
    if min_keep <= 0:
        return waterfill(d, n_keep)
    floor_E = np.minimum(d, min_keep)
    fs = floor_E.sum()
    if fs >= n_keep:
        return waterfill(floor_E, n_keep)
    return floor_E + waterfill(d - floor_E, n_keep - fs)


@njit
def proportional(d, n_keep, num, den):
    """:func:`lrmoe.planning.quota.proportional_quota` with the kept fraction num / den."""
    E = d.size
    q = np.zeros(E, dtype=np.int64)
    if n_keep == 0:
        return q
    rem = np.empty(E, dtype=np.int64)
    total = 0
    for e in range(E):
        p = d[e] * num
        q[e] = p // den
        rem[e] = p - q[e] * den
        total += q[e]
    key = np.empty(E, dtype=np.int64)
    for e in range(E):
        key[e] = rem[e] if rem[e] > 0 else -1
    _add_top(q, key, n_keep - total)
    return q


@njit
def quota(d_E, n_keep, policy, min_keep, num, den, exact):
    """The planner's quotas (``lrmoe_plan._quota``) of a built-in policy: the demand when n_keep >= P;
    ``exact`` (n_keep is the drop ratio's own) makes proportional use the kept fraction num / den."""
    P = d_E.sum()
    if n_keep >= P:
        return d_E.copy()
    if policy == WATERFILL:
        return waterfill_floor(d_E, n_keep, min_keep)
    if exact:
        return proportional(d_E, n_keep, num, den)
    return proportional(d_E, n_keep, n_keep, max(P, 1))


@njit
def quota_of(piece, n_keep, policy, min_keep, num, den, exact):
    """:func:`quota` of a piece's demand (:func:`piece_sums`): waterfill without a floor reads its
    sorted copy."""
    d_E = piece[0]
    if policy == WATERFILL and min_keep <= 0 and n_keep < d_E.sum():
        return waterfill_sorted(d_E, piece[3], n_keep)
    return quota(d_E, n_keep, policy, min_keep, num, den, exact)


@njit
def quota_status(d_E, q_E, n_keep):
    """The quota contract (0 <= q <= d, sum == n_keep): QUOTA_OK or QUOTA_BAD."""
    s = 0
    for e in range(d_E.size):
        if q_E[e] < 0 or q_E[e] > d_E[e]:
            return QUOTA_BAD
        s += q_E[e]
    return QUOTA_OK if s == n_keep else QUOTA_BAD


# ----------------------------------------------------------------------------- constants of one call
def problem(owner_E, others_ptr, others_idx, free_G, rep_bytes, owner_bytes, row_dispatch, row_saved, row_output,
            row_backward, budget, backward_weight, min_rows, tolerance):
    """The constants of one planner call as one tuple (``prob``, plain Python): ownership, in-domain
    receivers (CSR: the others of rank r are ``others_idx[others_ptr[r]:others_ptr[r + 1]]``), free
    replica slots, byte sizes (a replica's, an owner's, per row), the budget, B, min_rows, the
    tolerance, and a counter of greedy passes (``prob[14][0]``, read by the tests)."""
    i64 = np.int64
    return (np.asarray(owner_E, dtype=i64), np.asarray(others_ptr, dtype=i64), np.asarray(others_idx, dtype=i64),
            np.asarray(free_G, dtype=i64), float(rep_bytes), int(owner_bytes), int(row_dispatch), int(row_saved),
            int(row_output), int(row_backward), float(budget), float(backward_weight), int(min_rows),
            float(tolerance), np.zeros(1, dtype=i64))


@njit
def over_memory_floor(prob, G, pairs, kept):
    """``lrmoe_plan._over_memory_floor``: no plan keeping ``kept`` of ``pairs`` fits the budget."""
    owner_E, budget = prob[0], prob[10]
    floor = (owner_E.size * prob[5] + prob[6] * (pairs + kept) + (prob[7] + prob[8]) * pairs + prob[9] * kept)
    return budget < math.inf and -(-floor // G) > budget


@njit
def slack_units(tolerance, scale):
    """``lrmoe_plan._slack``: bracket width at which a bisection stops (1 for tolerance 0)."""
    return max(1, math.floor(tolerance * scale))


# ----------------------------------------------------------------------------- one quota vector's search
@njit
def piece_sums(d_GE):
    """What every probe of one demand piece reads of it, as ``piece``: (d_E, d_EG (the demand
    transposed), pairs_G (every rank's routed pairs), d_E sorted (waterfill's breakpoints))."""
    G, E = d_GE.shape
    d_E = np.zeros(E, dtype=np.int64)
    pairs_G = np.zeros(G, dtype=np.int64)
    for r in range(G):
        sent = 0
        for e in range(E):
            d_E[e] += d_GE[r, e]
            sent += d_GE[r, e]
        pairs_G[r] = sent
    return d_E, np.ascontiguousarray(d_GE.T), pairs_G, np.sort(d_E)


@njit
def search_setup(d_GE, q_E, prob):
    """What every threshold of q_E's search reads (``lrmoe_plan._QuotaSearch.__init__``), as ``qs``:
    (d_GE, q_E, d_E, w_E, rb_E, cost_G, mem_G, order_G, mine_ptr, mine_idx, lo, top, over_floor, slack, L_E,
    d_EG (the demand transposed), pairs_G)."""
    return search_setup_of(d_GE, piece_sums(d_GE), q_E, prob)


@njit
def search_setup_of(d_GE, piece, q_E, prob):
    """:func:`search_setup` with the piece's sums already made (:func:`piece_sums`; the kept-pair
    search makes them once for all its probes)."""
    owner_E, bw = prob[0], prob[11]
    G, E = d_GE.shape
    d_E, d_EG, pairs_G = piece[0], piece[1], piece[2]
    frac = np.zeros(E)
    w_E = np.zeros(E)
    L_E = np.empty(E)
    rb_E = np.empty(E)
    for e in range(E):
        if d_E[e] > 0:
            frac[e] = q_E[e] / d_E[e]
            w_E[e] = 1.0 + bw * frac[e]
        L_E[e] = d_E[e] + bw * float(q_E[e])
        rb_E[e] = float(prob[7]) + frac[e] * float(prob[9])
    cost_G = np.zeros(G)
    owned_w = np.zeros(G)
    n_owned = np.zeros(G, dtype=np.int64)
    for e in range(E):  # np.bincount order: sequential in expert order
        o = owner_E[e]
        cost_G[o] += L_E[e]
        owned_w[o] += d_E[e] * rb_E[e]
        n_owned[o] += 1
    mem_G = np.empty(G)
    kept_sent = exact_row_sums(d_EG, frac)  # exactly rounded (math.fsum): every rank computes the same plan
    for r in range(G):
        sent = pairs_G[r]
        mem_G[r] = (float(n_owned[r] * prob[5]) + float(prob[6]) * (sent + kept_sent[r]) + float(prob[8] * sent)
                    + owned_w[r])
    order_G = _desc_order(cost_G)
    by_load = _desc_order(L_E)  # every rank's experts by descending weighted load (ties: lower index)
    mine_ptr = np.zeros(G + 1, dtype=np.int64)
    for e in range(E):
        mine_ptr[owner_E[e] + 1] += 1
    for r in range(G):
        mine_ptr[r + 1] += mine_ptr[r]
    fill = mine_ptr[:G].copy()
    mine_idx = np.empty(E, dtype=np.int64)
    for k in range(E):
        e = by_load[k]
        mine_idx[fill[owner_E[e]]] = e
        fill[owner_E[e]] += 1
    top_cost = 0.0
    for r in range(G):
        top_cost = max(top_cost, cost_G[r])
    lo = math.floor(np_sum(cost_G) / G)
    top = math.ceil(top_cost)
    over = over_memory_floor(prob, G, d_E.sum(), q_E.sum())
    return (d_GE, q_E, d_E, w_E, rb_E, cost_G, mem_G, order_G, mine_ptr, mine_idx, lo, top, over,
            slack_units(prob[13], lo), L_E, d_EG, pairs_G)


@njit
def _shed(r, need, qs, prob, slack, mem, free, left, reps, n, head_E, next_R, stamp, token):
    """Move rows off rank r until its cost excess ``need`` is gone (and its memory is within the
    budget); returns (cost excess left, replicas so far, stamp token)."""
    w_E, rb_E, mine_ptr, mine_idx = qs[3], qs[4], qs[8], qs[9]
    others_ptr, others_idx, rep_bytes, budget, min_rows = prob[1], prob[2], prob[4], prob[10], prob[12]
    finite = budget < math.inf
    receivers = others_idx[others_ptr[r]:others_ptr[r + 1]]  # loops over slices: numba compiles a range
    for e in mine_idx[mine_ptr[r]:mine_ptr[r + 1]]:  # with a variable start slower (docs/benchmarks.md)
        w, rb = w_E[e], rb_E[e]
        w_min = w - EPS  # the least slack that takes one row
        token += 1  # stamp[u] == token: u hosts a replica of e already
        k = head_E[e]
        while k >= 0:
            stamp[reps[k, 1]] = token
            k = next_R[k]
        while (need > EPS or mem[r] > budget) and left[e] > 0:
            t, best = -1, -1.0
            for u in receivers:  # the first rank with the most slack
                if slack[u] > best and free[u] > 0 and slack[u] >= w_min and stamp[u] != token \
                        and (not finite or mem[u] + rep_bytes + rb <= budget):
                    t, best = u, slack[u]
            if t < 0:
                break
            want = math.ceil(need / w - EPS)
            if mem[r] > budget:
                want = max(want, math.ceil((mem[r] - budget) / rb))
            else:
                want = max(want, 0)
            # a replica carries at least min_rows (lrmoe_plan._greedy says why)
            x = min(max(want, min_rows), math.floor(slack[t] / w + EPS), left[e])
            if finite:
                x = min(x, math.floor((budget - mem[t] - rep_bytes) / rb))
            if x < min_rows:
                break
            reps[n, 0], reps[n, 1], reps[n, 2] = e, t, x
            next_R[n] = head_E[e]
            head_E[e] = n
            n += 1
            slack[t] -= x * w
            need -= x * w
            free[t] -= 1
            mem[t] += rep_bytes + x * rb
            mem[r] -= x * rb
            left[e] -= x
            stamp[t] = token
        if need <= EPS and mem[r] <= budget:
            break
    return need, n, token


@njit
def greedy(tau, qs, prob, work):
    """``lrmoe_plan._greedy`` at threshold tau: the number n of replicas written to ``work[0][:n]``
    (rows: expert, rank, rows), or -1 when the greedy cannot meet tau. ``work``: :func:`workspace`.
    Its first phase (:func:`greedy_meets`) moves every rank's cost excess; then every rank still
    over the memory budget sheds rows, which shapes the plan but not whether tau is met."""
    n, token = greedy_meets(tau, qs, prob, work)
    if n < 0:
        return -1
    order_G, budget = qs[7], prob[10]
    reps, next_R, head_E, stamp, excess, slack, mem, free, left = work
    for i in range(order_G.size):
        r = order_G[i]
        if mem[r] > budget:
            need, n, token = _shed(r, 0.0, qs, prob, slack, mem, free, left, reps, n, head_E, next_R, stamp, token)
    return n


@njit
def greedy_meets(tau, qs, prob, work):
    """The greedy's first phase: every rank over tau sheds its excess (and its memory over the
    budget while at it). Returns (the replicas so far, or -1 when some rank cannot get under tau;
    the stamp token reached). Whether tau is met is decided here, so the threshold searches run
    only this phase."""
    d_E, cost_G, mem_G, order_G = qs[2], qs[5], qs[6], qs[7]
    free_G = prob[3]
    reps, next_R, head_E, stamp, excess, slack, mem, free, left = work
    prob[14][0] += 1
    G = cost_G.size
    ftau = float(tau)
    for r in range(G):
        excess[r] = max(cost_G[r] - ftau, 0.0)
        slack[r] = max(ftau - cost_G[r], 0.0)
    if np_sum(excess) > np_sum(slack) + EPS:
        return -1, 0
    for r in range(G):
        mem[r] = mem_G[r]
        free[r] = free_G[r]
        stamp[r] = -1
    for e in range(d_E.size):
        left[e] = d_E[e]  # rows not moved yet
        head_E[e] = -1  # replicas of each expert (linked through next_R)
    n, token = np.int64(0), np.int64(0)
    for i in range(G):
        r = order_G[i]
        if excess[r] > EPS:
            need, n, token = _shed(r, excess[r], qs, prob, slack, mem, free, left, reps, n, head_E, next_R, stamp,
                                   token)
            if need > EPS:
                return -1, token
    return n, token


@njit
def workspace(prob):
    """The greedy's scratch, allocated once per search: the replicas (room for every one the free
    slots allow), their links per expert, and per-rank / per-expert state."""
    G, E = prob[3].size, prob[0].size
    R = prob[3].sum() + 1
    return (np.empty((R, 3), dtype=np.int64), np.empty(R, dtype=np.int64), np.empty(E, dtype=np.int64),
            np.empty(G, dtype=np.int64), np.empty(G), np.empty(G), np.empty(G), np.empty(G, dtype=np.int64),
            np.empty(E, dtype=np.int64))


# ----------------------------------------------------------------------------- a candidate plan
@njit
def replica_columns(reps, n, d_E, owner_E):
    """:func:`lrmoe.planning.plan.replica_columns` of ``reps[:n]``: every instance column's expert,
    rank and rows (owners first, then the replicas by expert, in the greedy's order within one)."""
    E = d_E.size
    order = np.argsort(reps[:n, 0], kind="mergesort")
    N = E + n
    expert_N = np.empty(N, dtype=np.int64)
    rank_N = np.empty(N, dtype=np.int64)
    rows_N = np.empty(N, dtype=np.int64)
    for e in range(E):
        expert_N[e], rank_N[e], rows_N[e] = e, owner_E[e], d_E[e]
    for k in range(n):
        i = order[k]
        e = reps[i, 0]
        expert_N[E + k], rank_N[E + k], rows_N[E + k] = e, reps[i, 1], reps[i, 2]
        rows_N[e] -= reps[i, 2]
    return expert_N, rank_N, rows_N


@njit
def locality_split(d_EG, expert_N, rank_N, rows_N):
    """:func:`lrmoe.planning.plan.locality_split_replicas`, transposed: send [N, G] from the demand
    [E, G]. Every replica takes the pairs already on its host first, then the rest of its rows by
    largest remainder over the sources' pairs left (replicas of one expert in column order); the
    owner (column e) takes what is left."""
    E, G = d_EG.shape
    N = expert_N.size
    send = np.zeros((N, G), dtype=np.int64)
    send[:E] = d_EG  # experts without replicas: every pair to the owner
    rem = np.empty(G, dtype=np.int64)
    alloc = np.empty(G, dtype=np.int64)
    scratch = np.empty(G, dtype=np.int64)
    scratch2 = np.empty(G, dtype=np.int64)
    start = E
    while start < N:  # the replica columns of one expert: [start, stop)
        e = expert_N[start]
        stop = start
        while stop < N and expert_N[stop] == e:
            stop += 1
        rem[:] = d_EG[e]
        for c in range(start, stop):  # pass 1: pairs already on the host rank
            r = rank_N[c]
            take = min(rows_N[c], rem[r])
            send[c, r] = take
            rem[r] -= take
        for c in range(start, stop):  # pass 2: the rest, largest remainder over the sources' pairs
            largest_remainder_col(rows_N[c] - send[c, rank_N[c]], rem, alloc, scratch, scratch2)
            for s in range(G):
                send[c, s] += alloc[s]
                rem[s] -= alloc[s]
        send[e] = rem
        start = stop
    return send


@njit
def _reverse_edges(n, ptr0, heads0, caps0):
    """scipy's _add_reverse_edges and _make_edge_pointers: the graph with every edge's reverse (zero
    capacity where missing), sorted heads per node, and each edge's reverse edge."""
    m0 = heads0.size
    # the transpose's rows (sorted by construction: tails in increasing order)
    tcount = np.zeros(n + 1, dtype=np.int64)
    for k in range(m0):
        tcount[heads0[k] + 1] += 1
    for v in range(n):
        tcount[v + 1] += tcount[v]
    tidx = np.empty(m0, dtype=np.int64)
    fill = tcount[:n].copy()
    for u in range(n):
        for k in range(ptr0[u], ptr0[u + 1]):
            v = heads0[k]
            tidx[fill[v]] = u
            fill[v] += 1
    ptr = np.zeros(n + 1, dtype=np.int64)
    heads = np.empty(2 * m0, dtype=np.int64)
    caps = np.zeros(2 * m0, dtype=np.int64)
    p = 0
    for u in range(n):
        a, a_end = ptr0[u], ptr0[u + 1]
        b, b_end = tcount[u], tcount[u + 1]
        while a != a_end or b != b_end:
            move_a = a != a_end and (b == b_end or heads0[a] <= tidx[b])
            move_b = b != b_end and (a == a_end or tidx[b] <= heads0[a])
            if move_a:
                heads[p] = heads0[a]
                caps[p] = caps0[a]
                a += 1
            if move_b:
                if not move_a:
                    heads[p] = tidx[b]
                b += 1
            p += 1
        ptr[u + 1] = p
    heads = heads[:p]
    caps = caps[:p]
    rev = np.empty(p, dtype=np.int64)
    for u in range(n):  # the edge v -> u of every edge u -> v (heads sorted: binary search)
        for k in range(ptr[u], ptr[u + 1]):
            v = heads[k]
            lo, hi = ptr[v], ptr[v + 1]
            while lo < hi:
                mid = (lo + hi) // 2
                if heads[mid] < u:
                    lo = mid + 1
                else:
                    hi = mid
            rev[k] = lo
    return ptr, heads, caps, rev


@njit
def dinic_flow(ptr, heads, caps_in, rev, source, sink):
    """scipy.sparse.csgraph.maximum_flow(method="dinic") on a graph with its reverse edges
    (:func:`_reverse_edges`): the flow on every edge (the same flow as scipy's, edge by edge)."""
    n = ptr.size - 1
    caps = caps_in.copy()
    flows = np.zeros(heads.size, dtype=np.int64)
    levels = np.empty(n, dtype=np.int64)
    progress = np.empty(n, dtype=np.int64)
    q = np.empty(n, dtype=np.int64)
    stack_v = np.empty(n, dtype=np.int64)
    stack_f = np.empty(n, dtype=np.int64)
    while True:
        levels[:] = -1
        q[0] = source
        start, end = 0, 1
        levels[source] = 0
        found = False
        while start != end:  # level graph (breadth first)
            cur = q[start]
            start += 1
            if cur == sink:
                found = True
                break
            for e in range(ptr[cur], ptr[cur + 1]):
                v = heads[e]
                if caps[e] > 0 and levels[v] == -1:
                    levels[v] = levels[cur] + 1
                    q[end] = v
                    end += 1
        if not found:
            break
        for i in range(n):
            progress[i] = ptr[i]
        while True:  # augmenting paths in the level graph (depth first)
            top = 0
            stack_v[0] = source
            stack_f[0] = 2147483647
            augmented = False
            while True:
                current = stack_v[top]
                flow = stack_f[top]
                e = progress[current]
                v = heads[e]
                if caps[e] > 0 and levels[v] == levels[current] + 1:
                    cf = min(flow, caps[e])
                    if v == sink:
                        while top > -1:
                            e = progress[stack_v[top]]
                            caps[e] -= cf
                            caps[rev[e]] += cf
                            flows[e] += cf
                            flows[rev[e]] -= cf
                            top -= 1
                        augmented = True
                        break
                    top += 1
                    stack_v[top] = v
                    stack_f[top] = cf
                else:
                    dead = False
                    while progress[current] == ptr[current + 1] - 1:
                        top -= 1
                        if top < 0:
                            dead = True
                            break
                        current = stack_v[top]
                    if dead:
                        break
                    progress[current] += 1
            if not augmented:
                break
    return flows


@njit
def _by_expert(expert_N, E):
    """The instances grouped by expert, in array order within one (``np.argsort(expert_N, kind="mergesort")``),
    without a sort for the candidates' layout: owner e at column e, the replicas after the owners
    sorted by expert (:func:`replica_columns`)."""
    N = expert_N.size
    ordered = N >= E
    for c in range(min(E, N)):
        ordered = ordered and expert_N[c] == c
    for c in range(E + 1, N):
        ordered = ordered and expert_N[c - 1] <= expert_N[c]
    if not ordered:
        return np.argsort(expert_N, kind="mergesort")
    cols = np.empty(N, dtype=np.int64)
    j, k = E, 0
    for e in range(E):
        cols[k] = e
        k += 1
        while j < N and expert_N[j] == e:
            cols[k] = j
            k += 1
            j += 1
    return cols


@njit
def instance_quotas(q_E, rows_N, expert_N, rank_N, G, bw, tau):
    """``lrmoe_plan._instance_quotas_flat``: every instance's kept rows (within 1 of its exact share,
    largest remainder unless that pushes a rank's executed cost over tau; then the rounding with the
    smallest executed maximum, by an integral max flow, the same flow as scipy's)."""
    E = q_E.size
    N = rows_N.size
    d_E = np.zeros(E, dtype=np.int64)
    for i in range(N):
        d_E[expert_N[i]] += rows_N[i]
    floors = np.zeros(N, dtype=np.int64)
    rems = np.zeros(N, dtype=np.int64)
    fractional = np.zeros(N, dtype=np.bool_)
    units_E = q_E.copy()
    for i in range(N):
        d = d_E[expert_N[i]]
        if d > 0:
            p = rows_N[i] * q_E[expert_N[i]]
            floors[i] = p // d
            rems[i] = p - floors[i] * d
            fractional[i] = rems[i] != 0
        units_E[expert_N[i]] -= floors[i]
    # largest remainder within every expert (instances in array order; ties: the lower index)
    exact = floors.copy()
    total_units = 0
    for e in range(E):
        if d_E[e] > 0:
            total_units += units_E[e]
    start = 0
    cols = _by_expert(expert_N, E)
    sub = np.empty(N, dtype=np.int64)
    add = np.empty(N, dtype=np.int64)
    buf = np.empty(N, dtype=np.int64)
    while start < N:
        e = expert_N[cols[start]]
        stop = start
        while stop < N and expert_N[cols[stop]] == e:
            stop += 1
        if d_E[e] > 0 and units_E[e] > 0:
            m = stop - start
            for k in range(start, stop):
                sub[k - start] = rems[cols[k]]
                add[k - start] = 0
            add_top(add[:m], sub[:m], units_E[e], buf[:m])
            for k in range(start, stop):
                exact[cols[k]] += add[k - start]
        start = stop
    if bw <= 0 or total_units == 0:
        return exact
    F_G = np.zeros(G)
    K_G = np.zeros(G)
    Kf_G = np.zeros(G)
    cand_G = np.zeros(G, dtype=np.int64)
    for i in range(N):
        F_G[rank_N[i]] += rows_N[i]
        K_G[rank_N[i]] += exact[i]
        Kf_G[rank_N[i]] += floors[i]
        if fractional[i]:
            cand_G[rank_N[i]] += 1
    worst = 0.0
    for r in range(G):
        worst = max(worst, F_G[r] + bw * K_G[r])
    if worst <= tau + EPS:
        return exact
    base_G = np.empty(G)
    for r in range(G):
        base_G[r] = F_G[r] + bw * Kf_G[r]

    # nodes: 0 source, 1..X the experts with units, then the G ranks, then the sink
    node_E = np.zeros(E, dtype=np.int64)
    X = 0
    for e in range(E):
        if units_E[e] > 0:
            X += 1
            node_E[e] = X
    n_nodes = X + G + 2
    sink = n_nodes - 1
    ptr0 = np.zeros(n_nodes + 1, dtype=np.int64)
    ptr0[1] = X  # source -> every expert node
    for i in range(N):
        if fractional[i] and units_E[expert_N[i]] > 0:
            ptr0[node_E[expert_N[i]] + 1] += 1
    for r in range(G):
        ptr0[X + 1 + r + 1] = 1  # rank -> sink
    for v in range(n_nodes):
        ptr0[v + 1] += ptr0[v]
    m0 = ptr0[n_nodes]
    heads0 = np.empty(m0, dtype=np.int64)
    caps0 = np.zeros(m0, dtype=np.int64)
    for x in range(X):
        heads0[x] = x + 1
    k = 0
    for e in range(E):
        if units_E[e] > 0:
            caps0[k] = units_E[e]
            k += 1
    fill = ptr0[:n_nodes].copy()
    for i in range(N):  # expert -> rank, in instance order (one instance per rank: sorted below)
        if fractional[i] and units_E[expert_N[i]] > 0:
            u = node_E[expert_N[i]]
            heads0[fill[u]] = X + 1 + rank_N[i]
            caps0[fill[u]] = 1
            fill[u] += 1
    for u in range(1, X + 1):  # heads sorted per row, as scipy's csr_matrix sorts them
        a, b = ptr0[u], ptr0[u + 1]
        heads0[a:b] = np.sort(heads0[a:b])
    cap_pos0 = np.empty(G, dtype=np.int64)
    for r in range(G):
        cap_pos0[r] = ptr0[X + 1 + r]
        heads0[cap_pos0[r]] = sink
    ptr, heads, caps_t, rev = _reverse_edges(n_nodes, ptr0, heads0, caps0)
    cap_pos = np.empty(G, dtype=np.int64)
    for r in range(G):  # rank -> sink is the last edge of a rank node's row
        cap_pos[r] = ptr[X + 1 + r + 1] - 1

    # the executed maximum is one of base_r + B k: the smallest that admits a flow of every unit
    bmax = base_G.max()
    vals = np.empty(int(cand_G.sum()) + G)
    nv = 0
    for r in range(G):
        for kk in range(cand_G[r] + 1):
            vals[nv] = base_G[r] + bw * kk
            nv += 1
    vals = np.sort(vals[:nv])
    targets = np.empty(nv)
    nt = 0
    for j in range(nv):
        if (j == 0 or vals[j] != vals[j - 1]) and vals[j] >= bmax - EPS:
            targets[nt] = vals[j]
            nt += 1
    lo = -1
    for j in range(nt):
        room = 0
        for r in range(G):
            room += max(min(math.floor((targets[j] - base_G[r]) / bw + EPS), cand_G[r]), 0)
        if room >= total_units:
            lo = j
            break
    if lo < 0:
        lo = nt - 1

    # the first target whose capacities can hold every unit usually admits a flow: tried first,
    # then binary search above it (feasibility only grows with the target)
    best = _flow_at(targets[lo], base_G, cand_G, bw, caps_t, cap_pos, ptr, heads, rev, sink)
    have = _flow_value(best, ptr) == total_units
    hi = lo if have else nt - 1
    lo += 0 if have else 1
    while lo < hi:
        mid = (lo + hi) // 2
        flows = _flow_at(targets[mid], base_G, cand_G, bw, caps_t, cap_pos, ptr, heads, rev, sink)
        if _flow_value(flows, ptr) == total_units:
            hi, best, have = mid, flows, True
        else:
            lo = mid + 1
    if not have:  # the largest target always admits one (every rank uncapped)
        best = _flow_at(targets[hi], base_G, cand_G, bw, caps_t, cap_pos, ptr, heads, rev, sink)
    out = floors.copy()
    for i in range(N):
        if units_E[expert_N[i]] > 0 and fractional[i]:
            u = node_E[expert_N[i]]
            v = X + 1 + rank_N[i]
            for kk in range(ptr[u], ptr[u + 1]):
                if heads[kk] == v:
                    out[i] += best[kk]
                    break
    return out


@njit
def _flow_at(target, base_G, cand_G, bw, caps, cap_pos, ptr, heads, rev, sink):
    """The max flow with every rank -> sink capacity floor((target - base_r) / B) (within [0, cand_r])."""
    for r in range(base_G.size):
        caps[cap_pos[r]] = max(min(math.floor((target - base_G[r]) / bw + EPS), cand_G[r]), 0)
    return dinic_flow(ptr, heads, caps, rev, 0, sink)


@njit
def _flow_value(flows, ptr):
    value = 0
    for k in range(ptr[0], ptr[1]):  # out of the source (node 0)
        value += flows[k]
    return value


@njit
def quota_matrix(kept_N, send):
    """:func:`lrmoe.planning.plan.largest_remainder_cols` (kept_N, send), transposed: backward quotas
    [N, G] from send [N, G]."""
    N, G = send.shape
    quota = np.empty((N, G), dtype=np.int64)
    rem = np.empty(G, dtype=np.int64)
    buf = np.empty(G, dtype=np.int64)
    for c in range(N):
        total, W = kept_N[c], 0
        for i in range(G):
            W += send[c, i]
        if G > 16 or total >= 2**26 or W >= 2**26 or total == 0 or total == W or W <= 0:
            largest_remainder_col(total, send[c], quota[c], rem, buf)
            continue
        # up to 16 sources (EP8): the split in place, without the two calls per column that cost
        # 15x the arithmetic (136 columns at Qwen3 EP8: 16.9 -> 3 us); the floors, then the
        # remainders one largest at a time, as unique keys (remainder desc, source asc)
        s = 0
        for i in range(G):
            f, r = divmod_nonneg(send[c, i] * total, W)
            quota[c, i] = f
            buf[i] = r * G + (G - 1 - i)
            s += f
        for _ in range(total - s):
            quota[c, pop_largest(buf, G)] += 1
    return quota


@njit
def plan_memory(prob, G, E, rank_N, send, quota, pairs_G):
    """:func:`lrmoe.planning.memory.plan_memory` of a layout whose first E instances are the owners
    (the rest replicas), from send and quota transposed ([N, G]): (base_G, replicas_G, dispatch_G,
    saved_G, backward_G), int64."""
    N = rank_N.size
    base = np.zeros(G, dtype=np.int64)
    reps = np.zeros(G, dtype=np.int64)
    sent = np.zeros(G, dtype=np.int64)
    recv = np.zeros(G, dtype=np.int64)
    kept_recv = np.zeros(G, dtype=np.int64)
    for c in range(N):
        r = rank_N[c]
        if c < E:
            base[r] += prob[5]
        else:
            reps[r] += int(prob[4])
        rows, kept = 0, 0
        for s in range(G):
            rows += send[c, s]
            kept += quota[c, s]
            sent[s] += send[c, s] + quota[c, s]
        recv[r] += rows
        kept_recv[r] += kept
    dispatch = prob[6] * sent
    saved = prob[7] * recv + prob[8] * pairs_G
    backward = prob[9] * kept_recv
    return base, reps, dispatch, saved, backward


@njit
def candidate(tau, qs, prob, work, n):
    """``lrmoe_plan._candidate`` of the greedy's replicas ``work[0][:n]`` at tau: (expert_N, rank_N,
    send [N, G], quota [N, G] (transposed), memory tuple, peak)."""
    expert_N, rank_N, send, kept_N = _layout_kept(tau, qs, prob, work, n)
    quota = quota_matrix(kept_N, send)
    mem = plan_memory(prob, send.shape[1], qs[2].size, rank_N, send, quota, qs[16])
    return expert_N, rank_N, send, quota, mem, _peak(mem)


@njit
def _layout_kept(tau, qs, prob, work, n):
    """A candidate's instances, send [N, G] and kept rows per instance (what :func:`candidate` and
    :func:`candidate_fits` share)."""
    q_E, d_E, d_EG = qs[1], qs[2], qs[15]
    expert_N, rank_N, rows_N = replica_columns(work[0], n, d_E, prob[0])
    send = locality_split(d_EG, expert_N, rank_N, rows_N)
    kept_N = instance_quotas(q_E, rows_N, expert_N, rank_N, d_EG.shape[1], prob[11], float(tau))
    return expert_N, rank_N, send, kept_N


@njit
def _peak(mem):
    """The largest rank total of :func:`plan_memory`'s five terms."""
    peak = 0
    for r in range(mem[0].size):
        peak = max(peak, mem[0][r] + mem[1][r] + mem[2][r] + mem[3][r] + mem[4][r])
    return peak


@njit
def candidate_fits(tau, qs, prob, work):
    """1 when the candidate at tau fits the budget, 0 when it does not, -1 when the greedy fails.

    The candidate's backward quotas per (instance, source) are not built: bounds on every rank's
    memory decide most verdicts (:func:`source_bounds`), and the ranks they leave open get their
    exact kept rows sent (:func:`sent_kept_exact`)."""
    n = greedy(tau, qs, prob, work)
    if n < 0:
        return -1
    E, G, pairs_G, budget = qs[2].size, qs[15].shape[1], qs[16], prob[10]
    _, rank_N, send, kept_N = _layout_kept(tau, qs, prob, work, n)
    base, lo, hi = source_bounds(prob, G, E, rank_N, send, kept_N, pairs_G)
    row = prob[6]
    open_G = np.empty(G, dtype=np.int64)
    k = 0
    for s in range(G):
        if base[s] + row * lo[s] > budget:
            return 0
        if base[s] + row * hi[s] > budget:
            open_G[k] = s
            k += 1
    if k == 0:
        return 1
    kept = sent_kept_exact(kept_N, send, open_G[:k])
    for j in range(k):
        if base[open_G[j]] + row * kept[j] > budget:
            return 0
    return 1


@njit
def source_bounds(prob, G, E, rank_N, send, kept_N, pairs_G):
    """Every rank's :func:`plan_memory` total but the kept rows it sends, and bounds on those, from a
    candidate's send [N, G] and kept rows per instance, without the backward quotas per (instance,
    source): (base_G, lo_G, hi_G), the rank's total being base + row_dispatch x (kept rows sent),
    those in [lo, hi]. They are sum_c quota[c, s], whose every entry (a largest-remainder split of
    kept_N[c] over the sources by send) is the floor or the ceiling of its share kept_N[c]
    send[c, s] / rows_c: the sum is within the shares' sum +- the count of nonzero entries,
    widened by 1 for the float sum (whose error is far below 1)."""
    N = rank_N.size
    fixed = np.zeros(G, dtype=np.int64)
    sent = np.zeros(G, dtype=np.int64)
    share = np.zeros(G)
    nonzero = np.zeros(G, dtype=np.int64)
    for c in range(N):
        r = rank_N[c]
        rows = 0
        for s in range(G):
            rows += send[c, s]
            sent[s] += send[c, s]
        fixed[r] += (prob[5] if c < E else int(prob[4])) + prob[7] * rows + prob[9] * kept_N[c]
        if kept_N[c] > 0:
            f = kept_N[c] / rows
            for s in range(G):
                share[s] += f * send[c, s]
                nonzero[s] += send[c, s] > 0
    base = np.empty(G, dtype=np.int64)
    lo = np.empty(G, dtype=np.int64)
    hi = np.empty(G, dtype=np.int64)
    for s in range(G):
        lo[s] = max(math.ceil(share[s]) - nonzero[s] - 1, 0)
        hi[s] = min(math.floor(share[s]) + nonzero[s] + 1, sent[s])
        base[s] = fixed[s] + prob[6] * sent[s] + prob[8] * pairs_G[s]
    return base, lo, hi


@njit
def peak_bounds(prob, G, E, rank_N, send, kept_N, pairs_G):
    """Bounds (low, high) on :func:`plan_memory`'s peak of a candidate (:func:`source_bounds`' over
    the ranks; the tests read it, :func:`candidate_fits` reads the ranks' own bounds)."""
    base, lo, hi = source_bounds(prob, G, E, rank_N, send, kept_N, pairs_G)
    low, high = 0, 0
    for s in range(G):
        low = max(low, base[s] + prob[6] * lo[s])
        high = max(high, base[s] + prob[6] * hi[s])
    return low, high


@njit
def sent_kept_exact(kept_N, send, sources):
    """``quota_matrix(kept_N, send)[:, sources].sum(0)`` without the matrix: per column the floors
    and remainders of the split, and a source takes one more
    where fewer than the missing units go to remainders before its own (larger, or equal at a
    lower source). O(N G (1 + len(sources))), no selection: at EP64 a few sources cost a fifth of
    the full matrix."""
    N, G = send.shape
    k = sources.size
    out = np.zeros(k, dtype=np.int64)
    fl = np.empty(G, dtype=np.int64)
    rm = np.empty(G, dtype=np.int64)
    for c in range(N):
        total, W = kept_N[c], 0
        for i in range(G):
            W += send[c, i]
        if total == 0 or W <= 0:
            continue
        if total == W:
            for j in range(k):
                out[j] += send[c, sources[j]]
            continue
        s_fl = 0
        for i in range(G):
            fl[i], rm[i] = divmod_nonneg(send[c, i] * total, W)
            s_fl += fl[i]
        missing = total - s_fl
        for j in range(k):
            s = sources[j]
            out[j] += fl[s]
            if missing > 0:
                r, before = rm[s], 0
                for i in range(G):
                    before += (rm[i] > r) | ((rm[i] == r) & (i < s))
                out[j] += before < missing
    return out


@njit
def domain_floor(cost_G, others_ptr, others_idx):
    """A threshold every rank cannot get under: the largest mean cost of a fast domain. The greedy
    moves cost only between the ranks of one domain (a rank and its in-domain receivers), so below
    a domain's mean some rank of it stays over the threshold. When the receivers do not partition
    the ranks into domains, the mean over all ranks (the global bound)."""
    G = cost_G.size
    total = 0.0
    for r in range(G):
        total += cost_G[r]
    best = total / max(G, 1)
    for r in range(G):  # a partition: every receiver u of r has r's domain (same size, r among its receivers)
        deg = others_ptr[r + 1] - others_ptr[r]
        for j in range(others_ptr[r], others_ptr[r + 1]):
            u = others_idx[j]
            if others_ptr[u + 1] - others_ptr[u] != deg:
                return best
            if r not in others_idx[others_ptr[u]:others_ptr[u + 1]]:
                return best
    for r in range(G):
        s = cost_G[r]
        for j in range(others_ptr[r], others_ptr[r + 1]):
            s += cost_G[others_idx[j]]
        best = max(best, s / (others_ptr[r + 1] - others_ptr[r] + 1))
    return best


@njit
def threshold(qs, prob, work):
    """The smallest integer threshold the greedy meets (``_QuotaSearch.threshold``): the bisection over
    [lo, top] (top is always met: no replica needed), to a bracket of ``slack`` units."""
    lo, hi, slack = qs[10], qs[11], qs[13]
    return _bisect_threshold(lo, hi, slack, qs, prob, work, _below_floor(qs, prob, lo, hi))


@njit
def _below_floor(qs, prob, lo, hi):
    """The largest threshold in [lo - 1, hi - 1] that :func:`domain_floor` proves the greedy fails:
    a unit below the floor (the float means' rounding)."""
    return min(max(math.floor(domain_floor(qs[5], prob[1], prob[2])) - 1, lo - 1), hi - 1)


@njit
def _bisect_threshold(lo, hi, slack, qs, prob, work, bad):
    """The bisection over [lo, hi] (hi is met) to a bracket of ``slack`` units. Midpoints up to ``bad``
    fail without a greedy pass: the greedy cannot meet them (:func:`domain_floor`), so the answer
    is the one the passes would give (a quarter of the passes at EP64, none at EP8)."""
    while hi - lo >= slack:
        mid = (lo + hi) // 2
        if mid > bad and greedy_meets(mid, qs, prob, work)[0] >= 0:
            hi = mid
        else:
            lo = mid + 1
    return hi


@njit
def threshold_from_floor(qs, prob, work):
    """A threshold the greedy meets, searched from below: every threshold up to the domain floor
    minus 1 fails (:func:`domain_floor` proves it), then steps 1, 2, 4, ... up from there until the
    greedy meets one, then the bisection of that bracket. A few passes where :func:`threshold`
    takes log2(top - lo) (the answer sits within a few units of the floor wherever the replicas can
    balance the ranks), and the same threshold wherever the greedy's feasibility grows with the
    threshold. It does not everywhere: at the paper's scale the greedy can meet a threshold, miss
    the next few hundred and meet again, and either search can land on either side (the tests
    measure it). Used only where its plan is kept when it fits (:func:`plan_piece`); with a
    tolerance (slack > 1), :func:`threshold`."""
    lo, hi, slack = qs[10], qs[11], qs[13]
    bad = _below_floor(qs, prob, lo, hi)  # every threshold <= bad fails
    if slack == 1 and hi > lo:
        step = 1
        while True:
            good = min(bad + step, hi)
            if good == hi or greedy_meets(good, qs, prob, work)[0] >= 0:
                break  # top is always met: never run there, as in the bisection
            bad, step = good, 2 * step
        lo, hi = bad + 1, good
    return _bisect_threshold(lo, hi, slack, qs, prob, work, bad)


@njit
def search_fits(qs, prob, work, top_first, thr):
    """``_QuotaSearch.fits``: whether the plan of these quotas fits. ``thr``: the threshold when known
    (else -1). Returns (fits, the threshold or -1 when not computed, whether the candidate at the
    threshold is known to fit: the plan is then that candidate)."""
    if not prob[10] < math.inf:  # every candidate fits: the plan is the one at the threshold
        return True, threshold(qs, prob, work) if thr < 0 else thr, True
    if qs[12]:
        return False, thr, False
    # the candidate at a threshold is a function of it: at thr == top one evaluation answers both
    if not top_first:
        thr = threshold(qs, prob, work) if thr < 0 else thr
        if candidate_fits(thr, qs, prob, work) == 1:
            return True, thr, True
        if thr != qs[11] and candidate_fits(qs[11], qs, prob, work) == 1:
            return True, thr, False
        return False, thr, False
    if candidate_fits(qs[11], qs, prob, work) == 1:
        return True, thr, False
    thr = threshold(qs, prob, work) if thr < 0 else thr
    fit = thr != qs[11] and candidate_fits(thr, qs, prob, work) == 1
    return fit, thr, fit


@njit
def search_tau(qs, prob, work, thr, thr_fits):
    """``_QuotaSearch._search``: the threshold of the plan returned for these quotas (the cost-optimal
    one, or when that one is over the budget, the smallest higher one that fits, if any).
    ``thr_fits``: the candidate at the cost-optimal threshold ``thr`` is known to fit."""
    hi, top, slack = thr, qs[11], qs[13]
    if qs[12]:  # over the memory floor: no candidate fits (the reference tries two, which answer no)
        return hi
    if thr_fits or not prob[10] < math.inf or candidate_fits(hi, qs, prob, work) == 1:
        return hi
    if hi == top or candidate_fits(top, qs, prob, work) != 1:
        return hi
    bad, step, found = hi, 1, -1
    while bad < top and found < 0:
        tau = min(bad + step, top)
        if candidate_fits(tau, qs, prob, work) == 1:
            found = tau
        else:
            bad, step = tau, 2 * step
    if found < 0:
        return hi
    good = found
    while good - bad > slack:
        mid = (bad + good) // 2
        if candidate_fits(mid, qs, prob, work) == 1:
            good = mid
        else:
            bad = mid
    return good


# ----------------------------------------------------------------------------- the kept-pair search
@njit
def keep_search(d_GE, prob, policy, min_keep, num, den, hi_keep, lo_keep, bisect, hi_known=-1, lo_known=-1,
                lo_thr=-1, lo_thr_fits=False):
    """The kept-pair search of one demand piece with a built-in quota policy (``plan_lrmoe``'s
    keep_search): (n_keep, its quotas' threshold or -1, whether the candidate there is known to fit,
    quota status); n_keep -1 when even lo_keep does not fit. ``num / den``: the kept fraction of the
    drop ratio (hi_keep is its own n_keep). ``bisect=False`` stops after the first two probes, when
    only whether some count fits matters (a microbatch-split probe): n_keep is then hi_keep, -1, or
    lo_keep < hi_keep for "lo_keep fits, the bisection between them not run".

    Probes already run for this piece are not run again: ``hi_known == 0`` says hi_keep does not
    fit; ``lo_known == 1`` that lo_keep fits, with threshold ``lo_thr`` and ``lo_thr_fits`` (what
    its probe returned); -1: not known.

    A probe fits when the candidate at its quotas' cost-optimal threshold or at the largest one
    (``top``) fits, whichever it tries first (:func:`search_fits`): the answer is the same, the cost
    is not. The top candidate needs no threshold search (a third of a probe at EP8), so a probe
    tries it first when one of the last two probes that tried it found it fitting (near the budget
    the verdicts flip from probe to probe; docs/benchmarks.md measures the choice). The plan is the
    same either way: a fitting count whose threshold was not searched gets it searched once, by
    :func:`quota_result`."""
    piece = piece_sums(d_GE)
    work = workspace(prob)
    if hi_known < 0:  # hi_keep first, the cost-optimal candidate first (it usually fits)
        fit, thr, thr_fits, bad = fits_keep(d_GE, piece, prob, work, policy, min_keep, num, den, hi_keep, hi_keep,
                                            np.bool_(False))
        if bad != QUOTA_OK or fit:
            return (hi_keep if fit else -1), thr, thr_fits, bad
    if lo_known == 1:
        thr, thr_fits = lo_thr, lo_thr_fits
    else:
        fit, thr, thr_fits, bad = fits_keep(d_GE, piece, prob, work, policy, min_keep, num, den, hi_keep, lo_keep,
                                            np.bool_(True))
        if bad != QUOTA_OK or not fit:
            return -1, -1, False, bad
    if not bisect:
        return lo_keep, thr, thr_fits, QUOTA_OK
    slack = slack_units(prob[13], piece[0].sum())
    # the last two verdicts on a probe's top candidate (lo_keep's probe tried it first: it fit when no
    # threshold was searched); a probe tries the top first when either fit
    last, before = thr < 0, False
    while hi_keep - lo_keep > slack:  # lo_keep fits, hi_keep does not
        mid = (lo_keep + hi_keep) // 2
        top_first = last or before
        fit, t, t_fits, bad = fits_keep(d_GE, piece, prob, work, policy, min_keep, num, den, hi_keep, mid,
                                        np.bool_(top_first))
        if bad != QUOTA_OK:
            return -1, -1, False, bad
        verdict = _top_verdict(top_first, fit, t, t_fits)
        if verdict >= 0:
            last, before = verdict == 1, last
        if fit:
            lo_keep, thr, thr_fits = mid, t, t_fits
        else:
            hi_keep = mid
    return lo_keep, thr, thr_fits, QUOTA_OK


@njit
def _top_verdict(top_first, fit, thr, thr_fits):
    """What a kept-pair probe (tried ``top_first``, :func:`fits_keep` answered ``fit, thr, thr_fits``)
    says of its top candidate: 1 fits, 0 does not, -1 not tried. No threshold searched (thr < 0):
    the top was tried first and fit, or the memory floor refused the count. Tried first and a
    threshold searched: the top did not fit. The cost-optimal candidate tried first: it fit and the
    top was not tried (``thr_fits``), or the answer is the top's."""
    if thr < 0:
        return 1 if fit else -1
    if top_first:
        return 0
    return -1 if thr_fits else (1 if fit else 0)


@njit
def fits_keep(d_GE, piece, prob, work, policy, min_keep, num, den, hi_keep, n_keep, top_first):
    """Whether the plan keeping n_keep pairs fits, the kept-pair search's probe (also
    ``lrmoe_plan.kept_pairs_fit``'s): the floor test from the pair counts first, then the quotas'
    search (:func:`search_fits`), plus the quota status. ``piece``: :func:`piece_sums` of d_GE."""
    d_E = piece[0]
    P = d_E.sum()
    if over_memory_floor(prob, d_GE.shape[0], P, min(n_keep, P)):
        return False, -1, False, QUOTA_OK
    q_E = quota_of(piece, n_keep, policy, min_keep, num, den, n_keep == hi_keep)
    bad = quota_status(d_E, q_E, min(n_keep, P))
    if bad != QUOTA_OK:
        return False, -1, False, bad
    fit, thr, thr_fits = search_fits(search_setup_of(d_GE, piece, q_E, prob), prob, work, top_first, np.int64(-1))
    return fit, thr, thr_fits, QUOTA_OK


@njit
def quota_result(d_GE, q_E, prob, thr, thr_fits):
    """The plan of quotas q_E (``_QuotaSearch.result``): (tau, threshold_cost, expert_N, rank_N, slot_N,
    send, quota, memory tuple, peak). ``thr``: the cost-optimal threshold when known, else -1;
    ``thr_fits``: the candidate there is known to fit."""
    G, E = d_GE.shape
    qs = search_setup(d_GE, q_E, prob)
    work = workspace(prob)
    if thr < 0:
        thr, thr_fits = threshold(qs, prob, work), False
    tau = search_tau(qs, prob, work, thr, thr_fits)
    n = greedy(tau, qs, prob, work)
    expert_N, rank_N, send, quota, mem, peak = candidate(tau, qs, prob, work, n)
    return (tau, thr, expert_N, rank_N, _slots(expert_N, rank_N, G, E), np.ascontiguousarray(send.T),
            np.ascontiguousarray(quota.T), mem, peak)


@njit
def _slots(expert_N, rank_N, G, E):
    """Owners in slot e % (E/G), every rank's replicas in the slots after its owned ones, in column order."""
    epr = E // G
    used = np.full(G, epr, dtype=np.int64)
    slot_N = np.empty(expert_N.size, dtype=np.int64)
    for c in range(expert_N.size):
        if c < E:
            slot_N[c] = c % epr
        else:
            slot_N[c] = used[rank_N[c]]
            used[rank_N[c]] += 1
    return slot_N


@njit
def piece_result(d_GE, prob, policy, min_keep, num, den, n_keep, hi_keep, thr, thr_fits):
    """:func:`quota_result` of a built-in policy's quotas for n_keep: (quotas, quota status, result)."""
    d_E = d_GE.sum(0)
    q_E = quota(d_E, n_keep, policy, min_keep, num, den, n_keep == hi_keep)
    bad = quota_status(d_E, q_E, min(n_keep, d_E.sum()))
    return q_E, bad, quota_result(d_GE, q_E, prob, thr, thr_fits)


@njit
def plan_piece(d_GE, prob, policy, min_keep, num, den, hi_keep, lo_keep, lo_known, lo_thr, lo_thr_fits):
    """The kept-pair search and the plan of one demand piece with a built-in quota policy, in one call:
    (n_keep or -1, quotas, quota status, :func:`quota_result`); with n_keep -1 the plan is hi_keep's.
    ``lo_known == 1`` (with ``lo_thr``, ``lo_thr_fits``): a microbatch-split probe found hi_keep over
    the budget and lo_keep fitting (:func:`keep_search`'s ``bisect=False``); -1: nothing known.

    The usual case first, without pressure: hi_keep's quotas, their cost-optimal candidate fits (the
    kept-pair search's first probe), and that candidate is the plan (built once); its threshold is
    searched from the domain floor (:func:`threshold_from_floor`: a few greedy passes, not ~20).
    When it does not fit, the rest of that probe is the reference's (the candidate at the
    bisection's threshold, then at the largest one), run here on the same setup, and the search
    goes on below hi_keep without probing it again: a plan keeps hi_keep pairs whenever the
    reference's does, and under pressure keeps the reference's count."""
    G, E = d_GE.shape
    d_E = d_GE.sum(0)
    P = d_E.sum()
    hi_known = 0 if lo_known == 1 else -1
    if hi_known < 0 and not over_memory_floor(prob, G, P, min(hi_keep, P)):
        q_E = quota(d_E, hi_keep, policy, min_keep, num, den, np.bool_(True))
        bad = quota_status(d_E, q_E, min(hi_keep, P))
        if bad != QUOTA_OK:
            return -1, q_E, bad, _empty_result(G, E)
        qs = search_setup(d_GE, q_E, prob)
        work = workspace(prob)
        thr = threshold_from_floor(qs, prob, work)
        n = greedy(thr, qs, prob, work)
        expert_N, rank_N, send, quota_NG, mem, peak = candidate(thr, qs, prob, work, n)
        if peak <= prob[10]:
            return hi_keep, q_E, QUOTA_OK, (thr, thr, expert_N, rank_N, _slots(expert_N, rank_N, G, E),
                                            np.ascontiguousarray(send.T), np.ascontiguousarray(quota_NG.T), mem, peak)
        # not kept: the rest is the reference's search (search_fits(top_first=False) of this probe, from
        # the bisection's threshold), so under pressure the kept pairs are the reference's
        thr_from_floor, thr = thr, threshold(qs, prob, work)
        if thr != thr_from_floor and candidate_fits(thr, qs, prob, work) == 1:
            return hi_keep, q_E, QUOTA_OK, quota_result(d_GE, q_E, prob, thr, np.bool_(True))
        if thr != qs[11] and candidate_fits(qs[11], qs, prob, work) == 1:
            return hi_keep, q_E, QUOTA_OK, quota_result(d_GE, q_E, prob, thr, np.bool_(False))
        hi_known = 0
    elif hi_known < 0:
        hi_known = 0  # over the memory floor: hi_keep's probe answers no (fits_keep)
    n_keep, thr, thr_fits, bad = keep_search(d_GE, prob, policy, min_keep, num, den, hi_keep, lo_keep, np.bool_(True),
                                             hi_known, lo_known, lo_thr, lo_thr_fits)
    use = hi_keep if n_keep < 0 else n_keep
    q_E, bad2, result = piece_result(d_GE, prob, policy, min_keep, num, den, use, hi_keep,
                                     thr if n_keep >= 0 else -1, thr_fits and n_keep >= 0)
    return n_keep, q_E, max(bad, bad2), result


@njit
def _empty_result(G, E):
    z = np.zeros(0, dtype=np.int64)
    zg = np.zeros(G, dtype=np.int64)
    return (0, 0, z, z, z, np.zeros((G, 0), dtype=np.int64), np.zeros((G, 0), dtype=np.int64),
            (zg, zg, zg, zg, zg), 0)


@njit
def quota_search_fits(d_GE, q_E, prob, top_first):
    """``_QuotaSearch(d_GE, q_E).fits(top_first)`` for quotas from Python: (fits, threshold or -1,
    whether the candidate there is known to fit)."""
    qs = search_setup(d_GE, q_E, prob)
    return search_fits(qs, prob, workspace(prob), top_first, np.int64(-1))


@njit
def check_plan(d_GE, expert_N, rank_N, slot_N, send, quota):
    """:meth:`lrmoe.planning.plan.Plan.check` on the arrays of a plan whose first E instances are the
    owners, the others replicas: (error code, dropped_GE, is_replica_N, routed pairs, kept pairs); code 0
    when the plan is consistent (1 bad instance, 2 taken slot, 3 expert without instance or two owners,
    4 negative send or dropped counts, 5 quota outside [0, send])."""
    G, E = d_GE.shape
    N = expert_N.size
    dropped = d_GE.copy()
    is_rep_N = np.empty(N, dtype=np.bool_)
    for c in range(N):
        is_rep_N[c] = c >= E
    for c in range(N):
        e = expert_N[c]
        if not (0 <= e < E and 0 <= rank_N[c] < G and slot_N[c] >= 0):
            return 1, dropped, is_rep_N, 0, 0
    S = slot_N.max() + 1 if N else 1
    taken = np.zeros((G, S), dtype=np.bool_)
    for c in range(N):
        if taken[rank_N[c], slot_N[c]]:
            return 2, dropped, is_rep_N, 0, 0
        taken[rank_N[c], slot_N[c]] = True
    count = np.zeros(E, dtype=np.int64)
    owners = np.zeros(E, dtype=np.int64)
    for c in range(N):
        count[expert_N[c]] += 1
        if not is_rep_N[c]:
            owners[expert_N[c]] += 1
    for e in range(E):
        if count[e] < 1 or owners[e] > 1:
            return 3, dropped, is_rep_N, 0, 0
    low_send, low_quota, low_gap, kept = 0, 0, 0, 0  # branch-free minima (vectorised)
    for s in range(G):
        for c in range(N):
            low_send = min(low_send, send[s, c])
            low_quota = min(low_quota, quota[s, c])
            low_gap = min(low_gap, send[s, c] - quota[s, c])
            kept += quota[s, c]
    if low_send < 0:
        return 4, dropped, is_rep_N, 0, 0
    if low_quota < 0 or low_gap < 0:
        return 5, dropped, is_rep_N, 0, 0
    K = owner_prefix(expert_N, E)
    ex = expert_N[K:]
    for s in range(G):
        take_sends(dropped[s], send[s], ex, K)
    low, pairs = 0, 0
    for s in range(G):
        for e in range(E):
            low = min(low, dropped[s, e])
            pairs += d_GE[s, e]
    return (4 if low < 0 else 0), dropped, is_rep_N, pairs, kept


# ----------------------------------------------------------------------------- baseline selection quotas
@njit
def selection_quota_matrix(q_E, expert_N, rows_N, send):
    """:func:`lrmoe.planning.selection.selection_quotas`' split: q_e over expert e's instances in
    proportion to their rows, then each instance's share over its sources in proportion to the pairs
    each sent (largest remainder both times, instances in column order): quota [G, N]."""
    G, N = send.shape
    quota = np.zeros((G, N), dtype=np.int64)
    order = np.argsort(expert_N, kind="mergesort")
    w = np.empty(G, dtype=np.int64)
    out = np.empty(G, dtype=np.int64)
    rem = np.empty(max(G, N), dtype=np.int64)
    buf = np.empty(max(G, N), dtype=np.int64)
    start = 0
    while start < N:
        e = expert_N[order[start]]
        stop = start
        while stop < N and expert_N[order[stop]] == e:
            stop += 1
        if q_E[e] != 0:
            m = stop - start
            rows = np.empty(m, dtype=np.int64)
            share = np.empty(m, dtype=np.int64)
            for k in range(m):
                rows[k] = rows_N[order[start + k]]
            largest_remainder_col(q_E[e], rows, share, rem[:m], buf[:m])
            for k in range(m):
                c = order[start + k]
                for s in range(G):
                    w[s] = send[s, c]
                largest_remainder_col(share[k], w, out, rem[:G], buf[:G])
                for s in range(G):
                    quota[s, c] = out[s]
        start = stop
    return quota
