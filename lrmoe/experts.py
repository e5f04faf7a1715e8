"""The selective experts function: full forward over every routed pair, pruned compacted backward.

Forward (every pair is computed; see docs/method.md):
  1. stable sort of pairs by expert -> permutation, demand d_e, offsets;
  2. retention quotas q_e fixed from the demand, before the expert GEMMs;
  3. X = x[token], GU = X W_gu^T, h = act(gate) * up, O = h W_d^T (grouped GEMMs; act is SiLU
     unless an activation is given: :func:`gated`);
  4. y_t = sum_k alpha_{t,k} O_{t,k} (deterministic batched reduction); ||h_u||^2 recorded.
Backward, given g = dL/dy:
  1. dL/dalpha_u = g_t . O_u for every pair (exact, kept or not);
  2. scores R_u = scorer(alpha, g, phi); per expert keep the q_e best (ties: lower pair index;
     non-finite scores first), or with ``selection="sample"`` q_e pairs drawn with probability
     pi_u ~ sqrt(R_u) whose rows are scaled by 1/pi_u (:func:`select_within_quota`);
  3. compact the kept rows (alpha*g, GU, X) into contiguous per-expert buffers;
  4. grouped GEMMs over kept rows only: dW_d, dh, gated-activation backward, dW_gu, dX; sum dX per
     token (segmented, deterministic).

Activations: SiLU (``activation=None``) runs the fused SwiGLU forward and backward; any other
elementwise activation runs the general path (:func:`gated`, :func:`gated_backward`), whose
backward takes act'(gate) from autograd on the activation itself (``torch.func.vjp``) for the rows
entering the backward, so it is exact for whatever the activation computes.

Under ``torch.compile`` the same function is traced: the host-read checks become tensor asserts
or are skipped (see :func:`_check_inputs`), the grouped GEMMs run compile-safe operators
(:mod:`lrmoe.kernels.grouped_gemm`), and no :class:`BackwardRecord` is filled (a record is a
Python side effect of the backward, which a traced backward cannot have).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .kernels.grouped_gemm import grouped_mm, resolve_backend
from .kernels.host import host_reads_free
from .kernels.routing import count_by_value, kept_positions, select_top_quota, sort_pairs_by_expert, sum_rows_by_token
from .kernels.sampling import sample_quota
from .policy import BackwardPolicy, BackwardRecord, PolicySnapshot, check_policy
from .quota import kept_pairs, quota_for
from .scorers import ScoreInputs, row_norm2


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype of an active ``torch.autocast`` region for ``device``'s type, or None."""
    try:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        return None


def autocast_inputs(hidden_TH: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor):
    """Inside ``torch.autocast``: the token rows and expert weights cast to the autocast dtype
    (float32 tensors only, as autocast casts ``nn.Linear``'s inputs), so that the expert GEMMs run
    in bf16/fp16 like the rest of the model (fp32 master weights; their gradients come back
    through the casts in fp32). Outside autocast: unchanged. The experts functions call this,
    then run their forward and backward with autocast off (explicit dtypes throughout)."""
    dt = autocast_dtype(hidden_TH.device)
    if dt is None:
        return hidden_TH, gate_up_proj, down_proj
    cast = lambda t: t.to(dt) if t.dtype == torch.float32 else t  # noqa: E731
    return cast(hidden_TH), cast(gate_up_proj), cast(down_proj)


def autocast_off(device: torch.device):
    """A context with autocast disabled for ``device``'s type (a no-op context where it is off)."""
    return torch.autocast(device.type, enabled=False) if autocast_dtype(device) is not None else contextlib.nullcontext()


def check_routing_shapes(T: int, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor) -> None:
    """top_k_index and top_k_weights must both be [T, K]; the index must be an integer tensor."""
    if top_k_index_TK.dim() != 2 or top_k_index_TK.shape[0] != T or top_k_weights_TK.shape != top_k_index_TK.shape:
        raise ValueError(f"top_k_index and top_k_weights must both be [T={T}, K], got "
                         f"{tuple(top_k_index_TK.shape)} and {tuple(top_k_weights_TK.shape)}")
    if top_k_index_TK.dtype.is_floating_point or top_k_index_TK.dtype == torch.bool:
        raise ValueError(f"top_k_index must be an integer tensor, got {top_k_index_TK.dtype}")


def compute_dtypes(hidden_TH: torch.Tensor, weight: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes the experts see for the hidden states and the weights (:func:`autocast_inputs`'
    casts applied)."""
    dt = autocast_dtype(hidden_TH.device)
    cast = lambda d: dt if dt is not None and d == torch.float32 else d  # noqa: E731
    return cast(hidden_TH.dtype), cast(weight.dtype)


def check_hidden(hidden_TH: torch.Tensor, weight: torch.Tensor, name: str = "hidden_TH") -> None:
    """ValueError unless the hidden states can enter experts with weights like ``weight``.

    The dtype rule: the experts compute in the weights' dtype (inside ``torch.autocast``: the
    autocast dtype, see :func:`autocast_inputs`) and return y in the hidden states' dtype. Hidden
    states must be floating point, on the weights' device, and of a dtype the compute dtype holds
    exactly (``torch.promote_types(hidden, weights) == weights``: bf16 or fp16 states into fp32
    weights are fine; fp64 states into fp32 weights, or fp32 into bf16, are refused rather than
    silently rounded)."""
    if not hidden_TH.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {hidden_TH.dtype} (cast it, e.g. x.float())")
    if hidden_TH.device != weight.device:
        raise ValueError(f"{name} is on {hidden_TH.device} but the expert weights are on {weight.device}; "
                         f"move both to one device")
    h_dt, w_dt = compute_dtypes(hidden_TH, weight)
    if torch.promote_types(h_dt, w_dt) != w_dt:
        where = " (the autocast dtype)" if w_dt != weight.dtype else ""
        raise ValueError(f"{name} is {h_dt} but the experts compute in {w_dt}{where}, which would round it; "
                         f"accepted: hidden states of a dtype {w_dt} holds exactly (torch.promote_types(hidden, "
                         f"{w_dt}) == {w_dt}); cast the input or the layer (e.g. layer.to({h_dt}))")


def _check_inputs(hidden_TH, top_k_index_TK, top_k_weights_TK, gate_up_proj, down_proj):
    if hidden_TH.dim() != 2:
        raise ValueError(f"hidden_TH must be [T, H], got shape {tuple(hidden_TH.shape)}")
    check_hidden(hidden_TH, gate_up_proj)
    for name, t in (("down_proj", down_proj), ("top_k_index", top_k_index_TK), ("top_k_weights", top_k_weights_TK)):
        if t.device != gate_up_proj.device:
            raise ValueError(f"{name} is on {t.device} but gate_up_proj is on {gate_up_proj.device}; "
                             f"every input of the experts must be on one device")
    T, H = hidden_TH.shape
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError("gate_up_proj must be [E, 2I, H] and down_proj [E, H, I], got "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    E, I2, H_w = gate_up_proj.shape
    if H_w != H or I2 % 2 or tuple(down_proj.shape) != (E, H, I2 // 2):
        raise ValueError(f"expert weights do not match hidden size {H}: gate_up_proj {tuple(gate_up_proj.shape)} "
                         f"(expected [E, 2I, {H}]), down_proj {tuple(down_proj.shape)} (expected [E, {H}, I])")
    check_routing_shapes(T, top_k_index_TK, top_k_weights_TK)
    # The range check reads the indices on the host: free on CPU; on accelerators it would cost a
    # synchronisation per layer call, so it runs there only under torch.autograd.set_detect_anomaly.
    # Inside torch.compile (no host reads in a traced graph) it is a tensor assert, on CPU only.
    if torch.compiler.is_compiling():
        if top_k_index_TK.device.type == "cpu" and top_k_index_TK.numel():
            torch._assert_async(((top_k_index_TK >= 0) & (top_k_index_TK < E)).all(),
                                f"expert indices must be in [0, {E - 1}]")
    elif (host_reads_free(top_k_index_TK) or torch.is_anomaly_enabled()) and top_k_index_TK.numel():
        lo, hi = int(top_k_index_TK.min()), int(top_k_index_TK.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"expert indices must be in [0, {E - 1}], got values in [{lo}, {hi}]")


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def swiglu_backward(gu: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (h, dGU) for h = silu(gate) * up, given dL/dh (written in place into one buffer;
    under torch.compile the same ops out of place, as a traced graph takes no ``out=`` views)."""
    gate, up = gu.chunk(2, dim=-1)
    if torch.compiler.is_compiling():
        silu = F.silu(gate)
        return silu * up, torch.cat([torch.ops.aten.silu_backward(dh * up, gate), dh * silu], dim=-1)
    I = gate.shape[-1]
    dgu = torch.empty_like(gu)
    silu = F.silu(gate)
    torch.mul(dh, silu, out=dgu[:, I:])  # dL/dup
    torch.mul(dh, up, out=dgu[:, :I])  # dL/dsilu(gate)
    torch.ops.aten.silu_backward.grad_input(dgu[:, :I], gate, grad_input=dgu[:, :I])  # dL/dgate
    return silu.mul_(up), dgu


def experts_activation(act):
    """The ``activation`` argument of :func:`lrmoe.experts.lrmoe_experts` for an activation module or
    function: None (the fused SwiGLU path) for None, ``F.silu`` and ``nn.SiLU``; any other callable
    as it is (the general path; it must be elementwise). ValueError for a non-callable, or for a
    module with parameters (the experts' backward returns no gradient for them)."""
    if act is None or act is F.silu or type(act) is torch.nn.SiLU:
        return None
    if not callable(act):
        raise ValueError(f"activation must be an elementwise callable (e.g. nn.GELU()) or None for SiLU, got {act!r}")
    if isinstance(act, torch.nn.Module) and next(act.parameters(), None) is not None:
        raise ValueError(f"activation {type(act).__name__} has parameters, which the LRMoE experts would not "
                         f"train; accepted: activations without parameters")
    return act


def check_activation(activation) -> None:
    """ValueError unless ``activation`` is None (SiLU, fused) or a callable."""
    if activation is not None and not callable(activation):
        raise ValueError(f"activation must be None (SiLU) or an elementwise callable tensor -> tensor, "
                         f"got {activation!r}")


def gated(gu: torch.Tensor, activation=None) -> torch.Tensor:
    """h = act(gate) * up for GU rows [N, 2I] (gate half first); ``activation`` None is SiLU (fused).

    Any other activation must be elementwise (a row's output depends on that row only: the
    backward re-evaluates it on the rows it keeps); its output must have the gate's shape."""
    if activation is None:
        return swiglu(gu)
    gate, up = gu.chunk(2, dim=-1)
    act = activation(gate)
    if not isinstance(act, torch.Tensor) or act.shape != gate.shape:
        got = tuple(act.shape) if isinstance(act, torch.Tensor) else type(act).__name__
        raise ValueError(f"the activation must be elementwise: it returned {got} for a gate of shape "
                         f"{tuple(gate.shape)}")
    return act * up


def gated_backward(gu: torch.Tensor, dh: torch.Tensor, activation=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (h, dGU) for h = act(gate) * up given dL/dh: SiLU through :func:`swiglu_backward`;
    any other activation through its own autograd (dL/dgate = act'(gate) * up * dL/dh as the
    vector-Jacobian product of the activation at these rows, so it is exact for what the
    activation computes), dL/dup = act(gate) * dL/dh."""
    if activation is None:
        return swiglu_backward(gu, dh)
    gate, up = gu.chunk(2, dim=-1)
    act, vjp = torch.func.vjp(activation, gate)
    (dgate,) = vjp(dh * up)
    return act * up, torch.cat([dgate, dh * act], dim=-1)


def acc_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    return torch.promote_types(a.dtype, b.dtype)


def combine(alpha_TK: torch.Tensor, O_TKH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y[t] = sum_k alpha[t, k] O[t, k] (in the promoted dtype, returned in ``dtype``), for an
    autograd Function's forward (no grad: ``out=``). The result is a tensor of its own, not a view:
    FSDP2 warns of a module output that is a view (an in-place op on it would skip its hooks)."""
    acc = acc_dtype(O_TKH, alpha_TK)
    T, K, H = O_TKH.shape
    y = O_TKH.new_empty(T, H, dtype=acc)
    torch.bmm(alpha_TK.to(acc).unsqueeze(1), O_TKH.to(acc), out=y.unsqueeze(1))
    return y.to(dtype)


def expert_backward(G_NH, GU_N2I, X_NH, offs_E, gate_up_proj, down_proj, backend="auto", x_index=None,
                    activation=None):
    """Grouped-GEMM backward of the gated experts over the given rows (kept rows in compact mode;
    ``activation`` as in :func:`gated`, None for SwiGLU).

    G = alpha * dL/dy rows, GU = saved gate/up pre-activations, X = expert inputs, all in the
    same expert-contiguous order described by ``offs_E`` (with ``x_index``, row i of X is
    ``X_NH[x_index[i]]``, read inside the wgrad kernel). Returns (dX [N, H], dW_gu, dW_d)."""
    dh = grouped_mm(G_NH, down_proj, offs_E, backend=backend)  # [N, I]
    h, dGU = gated_backward(GU_N2I, dh, activation)
    dW_d = grouped_mm(G_NH.t(), h, offs_E, backend=backend)  # [E, H, I]
    dW_gu = grouped_mm(dGU.t(), X_NH, offs_E, backend=backend, b_index=x_index)  # [E, 2I, H]
    dX = grouped_mm(dGU, gate_up_proj, offs_E, backend=backend)  # [N, H]
    return dX, dW_gu, dW_d


def buffer_bytes(N: int, H: int, I: int, itemsize: int) -> int:
    """Bytes of the backward execution buffers for N rows: G, X, GU, h, dh, dGU, dX."""
    return N * (H + H + 2 * I + I + I + 2 * I + H) * itemsize


def score_pairs(policy: PolicySnapshot, alpha_TK, g_TH, phi_norm2_TK, hidden_TH, top_k_index_TK,
                g_norm2_T: torch.Tensor | None = None) -> torch.Tensor:
    """float32 scores [T, K] by the call's scorer. A pair whose gradient rank-one term holds a NaN/Inf
    (a NaN/Inf in the token's incoming gradient, its routing weight or its ||phi||^2) scores +inf
    whatever the scorer (e.g. random), so it is kept and counted, never silently dropped."""
    T, K = top_k_index_TK.shape
    g_norm2_T = row_norm2(g_TH) if g_norm2_T is None else g_norm2_T
    inputs = ScoreInputs(alpha_TK, g_TH, phi_norm2_TK, hidden_TH, top_k_index_TK,
                         generator=policy.generator, grad_norm2_T=g_norm2_T, phi=policy.phi)
    raw = policy.scorer_fn(inputs, **policy.scorer_kwargs)
    if not isinstance(raw, torch.Tensor) or raw.shape not in ((T, K), (T * K,)) or raw.is_complex():
        got = f"{raw.dtype} of shape {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"scorer {policy.scorer!r} returned {got}; a scorer must return real scores of shape "
                         f"[T, K] = [{T}, {K}] (or [T*K] in pair order)")
    scores_TK = raw.float().reshape(T, K)
    finite_TK = torch.isfinite(g_norm2_T).unsqueeze(1) & torch.isfinite(alpha_TK) & torch.isfinite(phi_norm2_TK)
    return scores_TK.masked_fill(~finite_TK, float("inf"))


def select_within_quota(policy: PolicySnapshot, scores_P: torch.Tensor, bucket_P: torch.Tensor,
                        quota_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(keep [P] bool, inclusion probabilities [P] float64 or None): within every bucket b (an
    expert; in expert parallelism a (source, instance) pair) exactly ``quota_B[b]`` pairs, by the
    policy's selection rule: ``top`` (the highest scores; no probabilities) or ``sample``
    (:func:`lrmoe.kernels.sampling.sample_quota`: pi ~ sqrt(score), drawn from the policy's
    generator). A bucket with quota 0 (in expert parallelism, the pairs dropped in forward) keeps nothing."""
    if policy.selection == "sample":
        return sample_quota(scores_P, bucket_P, quota_B, policy.generator)
    return select_top_quota(scores_P, bucket_P, quota_B), None


def row_weights(alpha_P: torch.Tensor, dtype: torch.dtype, keep_P: torch.Tensor | None,
                inclusion_P: torch.Tensor | None) -> torch.Tensor:
    """The factor of each pair's gradient row alpha_u g_t: alpha_u, divided by pi_u for a sampled
    selection (0 for the pairs it dropped)."""
    w = alpha_P.to(dtype)
    if inclusion_P is None:
        return w
    inv = torch.where(keep_P, 1.0 / inclusion_P.clamp(min=2.0 ** -40), torch.zeros_like(inclusion_P))
    return w * inv.to(dtype)


class Stopwatch:
    """Phase timings of one backward (only when ``policy.profile``; synchronises the device)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device, self.times = enabled, device, {}
        self._last = self._now() if enabled else 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.enabled:
            now = self._now()
            self.times[phase] = self.times.get(phase, 0.0) + now - self._last
            self._last = now


class SelectiveExperts(torch.autograd.Function):
    """The autograd Function :func:`lrmoe_experts` applies (call that, not this). Public so that
    tools (the training step timer) can recognise its backward node by identity."""

    @staticmethod
    def forward(ctx, hidden_TH, top_k_weights_TK, gate_up_proj, down_proj, top_k_index_TK, policy, record,
                activation=None):
        T, K = top_k_index_TK.shape
        E = gate_up_proj.shape[0]
        w_dtype = gate_up_proj.dtype
        perm_P, demand_E, offs_E = sort_pairs_by_expert(top_k_index_TK, E)
        P = T * K
        n_keep = kept_pairs(P, policy.drop_ratio) if policy.selects else P
        quota_E = (quota_for(demand_E, n_keep, policy.quota, drop_ratio=policy.drop_ratio, **policy.quota_kwargs)
                   if n_keep < P else demand_E)

        token_P = perm_P // K  # token of each pair, in sorted order
        x_TH = hidden_TH.to(w_dtype)
        # Each GEMM resolves "auto" for its own operands (an odd intermediate size can rule out
        # F.grouped_mm for the down projection but not for the gate/up one).
        backend = policy.backend
        fused = (policy.fuse_gather if policy.fuse_gather is not None
                 else resolve_backend(backend, x_TH, gate_up_proj) == "triton")
        if fused:  # token rows read inside the GEMM's loads; no gathered copy of X
            X = None
            GU = grouped_mm(x_TH, gate_up_proj.transpose(1, 2), offs_E, backend=backend, a_index=token_P)
        else:
            X = x_TH.index_select(0, token_P)
            GU = grouped_mm(X, gate_up_proj.transpose(1, 2), offs_E, backend=backend)
        h = gated(GU, activation)
        inv_perm = torch.empty_like(perm_P)
        inv_perm[perm_P] = torch.arange(P, device=perm_P.device)
        if fused:  # output rows written straight back to pair order
            O_P = grouped_mm(h, down_proj.transpose(1, 2), offs_E, backend=backend, out_index=perm_P)
        else:
            O_P = grouped_mm(h, down_proj.transpose(1, 2), offs_E, backend=backend).index_select(0, inv_perm)
        phi_norm2_TK = None
        if policy.mode != "full" and policy.drop_ratio > 0:
            phi_norm2_TK = row_norm2(h).index_select(0, inv_perm).view(T, K)
        del h
        O_TKH = O_P.view(T, K, O_P.shape[-1])
        y = combine(top_k_weights_TK, O_TKH, hidden_TH.dtype)

        # Compact mode re-gathers the inputs of kept rows only in backward (saving P x H of
        # activation memory); when every row is used in backward, the gathered input is kept.
        compacts = policy.mode == "compact" and n_keep < P
        ctx.save_for_backward(hidden_TH, top_k_weights_TK, gate_up_proj, down_proj, top_k_index_TK,
                              perm_P, offs_E, demand_E, quota_E, GU, O_TKH, phi_norm2_TK, None if compacts else X)
        # ``policy`` is the call's snapshot (lrmoe_experts), so a policy mutated between forward and
        # backward cannot make the gradients disagree with the selection the record reports.
        ctx.policy, ctx.record, ctx.n_keep, ctx.compacts = policy, record, n_keep, compacts
        ctx.masks = policy.mode == "mask" and n_keep < P
        ctx.backend, ctx.fused, ctx.activation = backend, fused, activation
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g_TH):
        with autocast_off(g_TH.device):  # explicit dtypes, also when backward runs inside autocast
            return SelectiveExperts._backward(ctx, g_TH)

    @staticmethod
    def _backward(ctx, g_TH):
        (hidden_TH, alpha_TK, gate_up_proj, down_proj, top_k_index_TK, perm_P, offs_E, demand_E, quota_E,
         GU, O_TKH, phi_norm2_TK, X) = ctx.saved_tensors
        policy, record, n_keep = ctx.policy, ctx.record, ctx.n_keep
        T, K = top_k_index_TK.shape
        P = T * K
        E, I2, H = gate_up_proj.shape
        w_dtype = gate_up_proj.dtype
        g_TH = g_TH.contiguous()
        watch = Stopwatch(policy.profile, g_TH.device)

        # 1. Router gradient for every pair, kept or not.
        grad_alpha = None
        if ctx.needs_input_grad[1]:
            acc = acc_dtype(O_TKH, alpha_TK)
            grad_alpha = torch.bmm(O_TKH.to(acc), g_TH.to(acc).unsqueeze(-1)).squeeze(-1).to(alpha_TK.dtype)
        watch.lap("router_grad")

        # 2. Scores and selection (non-finite gradients rank first whatever the scorer).
        scores_TK = keep_P = incl_P = None
        g_norm2_T = row_norm2(g_TH)  # also flags NaN/Inf rows (one fused reduction)
        if phi_norm2_TK is not None:
            scores_TK = score_pairs(policy, alpha_TK, g_TH, phi_norm2_TK, hidden_TH, top_k_index_TK, g_norm2_T)
            if n_keep < P:
                keep_P, incl_P = select_within_quota(policy, scores_TK.reshape(-1), top_k_index_TK.reshape(-1),
                                                     quota_E)
        watch.lap("score_select")

        # 3. Rows entering the expert backward: all, kept (compact) or all with dropped zeroed (mask).
        token_P = perm_P // K
        alpha_P = alpha_TK.reshape(-1)
        if ctx.compacts:
            pos = kept_positions(keep_P, perm_P, n_keep)
            rows_pair, offs = perm_P.index_select(0, pos), torch.cumsum(quota_E, 0).to(torch.int32)
            rows_token, GU_rows = token_P.index_select(0, pos), GU.index_select(0, pos)
            if not ctx.fused:
                X = hidden_TH.to(w_dtype).index_select(0, rows_token)
        else:
            rows_pair, offs, rows_token, GU_rows = perm_P, offs_E, token_P, GU
        watch.lap("compact")
        acc = acc_dtype(g_TH, alpha_TK)
        if incl_P is not None:  # sampled: alpha / pi (unbiased)
            alpha_P = row_weights(alpha_P, acc, keep_P, incl_P)
        G = g_TH.index_select(0, rows_token).to(acc).mul_(alpha_P.index_select(0, rows_pair).to(acc).unsqueeze(1))
        if keep_P is not None and ctx.masks:
            G = torch.where(keep_P[rows_pair].unsqueeze(1), G, torch.zeros((), dtype=G.dtype, device=G.device))
        G = G.to(w_dtype)
        watch.lap("grad_rows")

        # 4. Grouped GEMMs over those rows only.
        if ctx.fused:
            dX, dW_gu, dW_d = expert_backward(G, GU_rows, hidden_TH.to(w_dtype), offs, gate_up_proj, down_proj,
                                              backend=ctx.backend, x_index=rows_token, activation=ctx.activation)
        else:
            dX, dW_gu, dW_d = expert_backward(G, GU_rows, X, offs, gate_up_proj, down_proj, backend=ctx.backend,
                                              activation=ctx.activation)
        watch.lap("gemm")
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            # G is dead after the GEMMs: reuse its buffer for the reordered dX rows.
            grad_hidden = sum_rows_by_token(dX, rows_pair, T, K, workspace=G).to(hidden_TH.dtype)
        watch.lap("scatter")

        if record is not None:
            if keep_P is None:
                keep_P = torch.ones(P, dtype=torch.bool, device=g_TH.device)
            kept_E = count_by_value(top_k_index_TK.reshape(-1), E, weights=keep_P)
            if scores_TK is not None:
                nonfinite = (~torch.isfinite(scores_TK)).sum()
            else:
                nonfinite = (~torch.isfinite(g_norm2_T)).sum() * K
            record.fill(demand=demand_E, quota=quota_E, kept=kept_E, kept_mask=keep_P.view(T, K),
                        scores=scores_TK, nonfinite=nonfinite, mode=policy.mode, drop_ratio=policy.drop_ratio,
                        scorer=None if scores_TK is None else policy.scorer,
                        selection=None if scores_TK is None else policy.selection,
                        inclusion=None if incl_P is None else incl_P.view(T, K),
                        buffer_bytes=buffer_bytes(G.shape[0], H, I2 // 2, G.element_size()), timings=watch.times)
        return grad_hidden, grad_alpha, dW_gu, dW_d, None, None, None, None


def lrmoe_experts(hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor,
                  gate_up_proj: torch.Tensor, down_proj: torch.Tensor, policy: BackwardPolicy | None = None,
                  record: BackwardRecord | None = None, activation=None) -> torch.Tensor:
    """Gated (SwiGLU by default) experts over routed pairs with LRMoE's selective, compacted backward.

    hidden_TH [T, H]; top_k_index_TK [T, K] expert ids; top_k_weights_TK [T, K] routing weights;
    gate_up_proj [E, 2I, H] (gate half first); down_proj [E, H, I]. Returns y_TH [T, H] with
    y_t = sum_k alpha_{t,k} expert_{e_{t,k}}(x_t). ``record`` (a fresh :class:`BackwardRecord`)
    is filled when the backward runs (not inside ``torch.compile``: there it is ignored).
    ``activation``: None for SiLU (the fused SwiGLU path), or an elementwise callable applied to
    the gate half (h = activation(gate) * up; the general path of :func:`gated`, exact backward).

    Inside ``torch.autocast``, float32 ``hidden_TH`` and weights are cast to the autocast dtype
    first (:func:`autocast_inputs`; y is then in that dtype); the function itself runs with
    autocast off. Hidden states must be floating point, on the weights' device, and of a dtype
    the compute dtype holds exactly (:func:`check_hidden`); otherwise ValueError."""
    policy = check_policy(policy)
    check_activation(activation)
    _check_inputs(hidden_TH, top_k_index_TK, top_k_weights_TK, gate_up_proj, down_proj)
    policy = policy.snapshot(hidden_TH.device)
    hidden_TH, gate_up_proj, down_proj = autocast_inputs(hidden_TH, gate_up_proj, down_proj)
    with autocast_off(hidden_TH.device):
        return SelectiveExperts.apply(hidden_TH, top_k_weights_TK, gate_up_proj, down_proj,
                                       top_k_index_TK.to(torch.int64), policy,
                                       None if torch.compiler.is_compiling() else record, activation)
