"""What NCCL needs from the expert-parallel code, checked on CPU with gloo (no GPU here).

NCCL accepts only dense CUDA tensors of the rank's device and, unlike gloo, never checks that the
ranks agree: a collective whose sizes or dtypes differ across ranks hangs or reads garbage instead
of raising. The spawned gloo ranks here run the EP layer (several placements, forward drops,
replicas, compact/mask backward, a rank without tokens, split microbatches), the transformers
path (parallelize, broadcast, data-parallel sync, clipping, full state dict) through an auditor
wrapped around every ``torch.distributed`` collective, which checks each call (device, contiguity,
dtype, Python-int split sizes that add up) and logs it; the test side then checks that the ranks
issued the same collectives with matching sizes. Plus the launch helpers (subgroup timeouts, an
existing process group's backend, a long host barrier) and the guards added for NCCL.
"""
from __future__ import annotations

import datetime
import inspect
import os
import time
import traceback
import types

import pytest
import torch
import torch.distributed as dist

from dist_helpers import spawn
from lrmoe import BackwardPolicy

PG_TIMEOUT_S = 20
SPAWN_DEADLINE_S = 240
H, I, E, K = 8, 4, 8, 2

# dtypes ProcessGroupNCCL maps to an NCCL type (bool travels as uint8 and is not reduced here).
NCCL_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
               torch.int64, torch.bool}
REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
TENSOR_OPS = ("all_gather", "all_gather_into_tensor", "all_to_all_single", "all_to_all", "all_reduce", "reduce",
              "broadcast", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send", "recv", "isend",
              "irecv", "barrier")
FORBIDDEN = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
             "monitored_barrier")


# ----------------------------------------------------------------------------- the auditor
class Auditor:
    """Wraps every collective of torch.distributed: checks each tensor for NCCL and logs the call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.log: list[dict] = []
        self.errors: list[str] = []
        self.scenario = ""
        self._orig = {}

    def install(self):
        for name in TENSOR_OPS + FORBIDDEN:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._orig[name] = fn
            setattr(dist, name, self._wrap(name, fn))

    def uninstall(self):
        for name, fn in self._orig.items():
            setattr(dist, name, fn)

    def _err(self, msg):
        self.errors.append(f"[{self.scenario}] {msg}")

    def _tensor(self, op, what, t):
        if not isinstance(t, torch.Tensor):
            self._err(f"{op}: {what} is a {type(t).__name__}, not a tensor")
            return
        if t.device != self.device:
            self._err(f"{op}: {what} on {t.device}, the rank's device is {self.device}")
        if not t.is_contiguous():
            self._err(f"{op}: {what} is not contiguous (stride {t.stride()})")
        if t.dtype not in NCCL_DTYPES or t.is_complex():
            self._err(f"{op}: {what} has dtype {t.dtype}, which NCCL does not take")
        if op in REDUCING and t.dtype == torch.bool:
            self._err(f"{op}: {what} is bool, which NCCL does not reduce")

    def _splits(self, op, what, splits, t, G):
        if splits is None:
            return None
        splits = list(splits)
        bad = [s for s in splits if type(s) is not int]
        if bad:
            self._err(f"{op}: {what} holds non-int sizes {[type(s).__name__ for s in bad]}")
        if len(splits) != G:
            self._err(f"{op}: {what} has {len(splits)} sizes for a group of {G}")
        if sum(int(s) for s in splits) != t.shape[0]:
            self._err(f"{op}: {what} add up to {sum(int(s) for s in splits)}, the tensor has {t.shape[0]} rows")
        return [int(s) for s in splits]

    def _wrap(self, name, fn):
        sig = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            if name in FORBIDDEN:
                self._err(f"{name} used (host pickling; NCCL needs torch.cuda.set_device first, or gloo only)")
                return fn(*args, **kwargs)
            a = sig.bind(*args, **kwargs).arguments
            if a.get("async_op"):
                self._err(f"{name} with async_op=True (its result must be waited for before any use)")
            group = a.get("group")
            ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
            G = len(ranks)
            entry = {"op": name, "ranks": ranks, "scenario": self.scenario}
            if name == "all_gather":
                self._tensor(name, "input", a["tensor"])
                for j, o in enumerate(a["tensor_list"]):
                    self._tensor(name, f"output {j}", o)
                    if o.shape != a["tensor"].shape or o.dtype != a["tensor"].dtype:
                        self._err(f"all_gather: output {j} {o.dtype}{tuple(o.shape)} vs input "
                                  f"{a['tensor'].dtype}{tuple(a['tensor'].shape)}")
                entry.update(dtype=str(a["tensor"].dtype), shape=tuple(a["tensor"].shape))
            elif name == "all_to_all_single":
                out, inp = a["output"], a["input"]
                self._tensor(name, "input", inp)
                self._tensor(name, "output", out)
                if out.dtype != inp.dtype or out.shape[1:] != inp.shape[1:]:
                    self._err(f"all_to_all_single: output {out.dtype}{tuple(out.shape)} vs input "
                              f"{inp.dtype}{tuple(inp.shape)}")
                if out.data_ptr() == inp.data_ptr() and out.numel():
                    self._err("all_to_all_single: output aliases input")
                ins = self._splits(name, "input splits", a.get("input_split_sizes"), inp, G)
                outs = self._splits(name, "output splits", a.get("output_split_sizes"), out, G)
                entry.update(dtype=str(inp.dtype), row=tuple(inp.shape[1:]), ins=ins, outs=outs)
            elif name == "barrier":
                pass
            else:
                t = a.get("tensor")
                if t is None:
                    self._err(f"{name}: not audited by this test (add it)")
                else:
                    self._tensor(name, "tensor", t)
                    entry.update(dtype=str(t.dtype), shape=tuple(t.shape))
            self.log.append(entry)
            return fn(*args, **kwargs)

        return wrapper


def consistency_errors(logs: list[list[dict]]) -> list[str]:
    """The ranks' logs (default group of G ranks) must show the same collectives, in the same
    order, with the same dtypes and shapes, and all-to-all splits that pair up."""
    errs = []
    n = {len(lg) for lg in logs}
    if len(n) != 1:
        errs.append(f"ranks issued different numbers of collectives: {[len(lg) for lg in logs]}")
    for i, entries in enumerate(zip(*logs)):
        head = entries[0]
        where = f"collective {i} ({head['op']}, scenario {head['scenario']})"
        for r, e in enumerate(entries):
            if (e["op"], e["ranks"], e.get("dtype")) != (head["op"], head["ranks"], head.get("dtype")):
                errs.append(f"{where}: rank {r} issued {e['op']} {e.get('dtype')} on {e['ranks']}")
        if head["op"] in ("all_gather", "all_reduce", "broadcast", "reduce"):
            shapes = [e.get("shape") for e in entries]
            if len(set(shapes)) != 1:
                errs.append(f"{where}: shapes differ across ranks {shapes}")
        if head["op"] == "all_to_all_single":
            if len({e["row"] for e in entries}) != 1:
                errs.append(f"{where}: row shapes differ {[e['row'] for e in entries]}")
            G = len(entries)
            for s in range(G):
                for d in range(G):
                    sent = entries[s]["ins"][d] if entries[s]["ins"] is not None else None
                    got = entries[d]["outs"][s] if entries[d]["outs"] is not None else None
                    if sent != got:
                        errs.append(f"{where}: rank {s} sends {sent} rows to rank {d}, which expects {got}")
    return errs


# ----------------------------------------------------------------------------- worker: EP layer + hf
def make_data(tokens, seed, dtype=torch.float32):
    T = sum(tokens)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, dtype=dtype, generator=g)
    others = torch.tensor([e for e in range(E) if e != 1])
    idx = torch.stack([torch.full((T,), 1), others[torch.randint(0, E - 1, (T,), generator=g)]], 1)
    w = torch.rand(T, K, dtype=dtype, generator=g) + 0.1
    gu = torch.randn(E, 2 * I, H, dtype=dtype, generator=g) / H**0.5
    dn = torch.randn(E, H, I, dtype=dtype, generator=g) / I**0.5
    dy = torch.randn(T, H, dtype=dtype, generator=g)
    return x, idx, w, gu, dn, dy


# name, placement, planner options, extra slots (None: default), tokens per rank, drop, mode, warmup calls
EP_CASES = [
    ("fixed-c0", "fixed", {}, None, [10, 7], 0.0, "compact", 0),
    ("lrmoe-c20-compact", "lrmoe", {}, None, [10, 7], 0.2, "compact", 0),
    ("lrmoe-c20-mask", "lrmoe", {}, None, [10, 7], 0.2, "mask", 0),
    ("ultraep-emptyrank", "ultraep", {"min_tokens": 1}, None, [12, 0], 0.0, "compact", 0),
    ("lrmoe-c20-emptyrank", "lrmoe", {}, None, [0, 14], 0.2, "compact", 0),
    ("symi-drops", "symi", {"capacity_factor": 1.0}, None, [10, 7], 0.0, "compact", 1),
    ("fixed-c20-split", "fixed", {}, None, [10, 7], 0.2, "compact", 0),
]


def run_ep_case(case, rank, G):
    from lrmoe.parallel.runtime import ExpertParallel, ExpertParallelExperts

    name, placement, options, extra, tokens, drop, mode, warmup = case
    x, idx, w, gu, dn, dy = make_data(tokens, 3)
    lo = sum(tokens[:rank])
    hi = lo + tokens[rank]
    budget = float("inf")
    if name.endswith("split"):  # a budget between the piece of 2 and the whole step: split_microbatch
        import numpy as np

        from lrmoe.planning.policies import plan_placement

        ep0 = ExpertParallel(E, None, placement, **options)
        off = [0, tokens[0], sum(tokens)]
        demand = np.stack([np.bincount(idx[off[r]:off[r + 1]].reshape(-1).numpy(), minlength=E) for r in range(G)])
        mem = plan_placement(placement, demand, ep0.cluster, ep0.dims(H, I, K, 4), float("inf")).memory
        budget = float(mem.base_G.max() + 0.6 * mem.tokens_G.max())
    ep = ExpertParallel(E, None, placement, budget_bytes=budget,
                        slots_per_rank=None if extra is None else E // G + extra, **options)
    m = ExpertParallelExperts.from_full(gu, dn, ep, BackwardPolicy(drop_ratio=drop, mode=mode))
    for _ in range(warmup):
        m(x[lo:hi], idx[lo:hi], w[lo:hi])
    xl, wl = x[lo:hi].clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
    y = m(xl, idx[lo:hi], wl)
    y.backward(dy[lo:hi])
    with torch.no_grad():
        m(x[lo:hi], idx[lo:hi], w[lo:hi])
    return {"split": isinstance(ep.last_plan, list), "comm": dict(m.last_backward.comm_bytes)}


def run_hf_case(rank, G):
    import lrmoe.hf as hf
    from lrmoe.hf import parallel as ep_hf

    vocab, seqs, length = 61, 4, 10
    ids = torch.randint(0, vocab, (seqs, length), generator=torch.Generator().manual_seed(7))
    model = hf.build_model("qwen3-moe-tiny", vocab_size=vocab, seed=5)
    ep_hf.parallelize_experts(model, None, "lrmoe", policy=BackwardPolicy(0.2))
    ep_hf.broadcast_dense_params(model, src=0)
    per = seqs // G
    mine = ids[rank * per:(rank + 1) * per]
    model(input_ids=mine, labels=mine).loss.backward()
    ep_hf.finish_grad_sync(model)
    norm = ep_hf.clip_grad_norm_(model, 1.0)
    full = ep_hf.full_state_dict(model)
    # a rank without any gradient still joins the norm's all-reduce
    if rank == 1:
        model.zero_grad(set_to_none=True)
    ep_hf.clip_grad_norm_(model, 1.0)
    return {"norm": float(norm), "keys": len(full)}


def run_size_mismatch(rank, G):
    """num_experts differs across ranks: every rank must get ValueError (a fixed-size header is
    gathered before the demand, whose length is num_experts)."""
    from lrmoe.parallel.runtime import ExpertParallel, ExpertParallelExperts

    E_r = 4 if rank == 0 else 8
    g = torch.Generator().manual_seed(0)
    gu, dn = torch.randn(E_r, 2 * I, H, generator=g), torch.randn(E_r, H, I, generator=g)
    m = ExpertParallelExperts.from_full(gu, dn, ExpertParallel(E_r, None, "fixed"))
    x = torch.randn(5, H, generator=g)
    idx = torch.randint(0, E_r, (5, K), generator=g)
    try:
        m(x, idx, torch.rand(5, K, generator=g))
        return "no error"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def run_nccl_cpu_inputs(rank, G, auditor):
    """An EP group whose backend is NCCL refuses CPU inputs before any collective (emulated: the
    layer's backend is set to 'nccl' on this gloo group)."""
    from lrmoe.parallel.runtime import ExpertParallel, ExpertParallelExperts

    x, idx, w, gu, dn, dy = make_data([5, 5], 0)
    ep = ExpertParallel(E, None, "fixed")
    ep.backend = "nccl"
    m = ExpertParallelExperts.from_full(gu, dn, ep)
    before = len(auditor.log)
    try:
        m(x[:5], idx[:5], w[:5])
        out = "no error"
    except Exception as e:  # noqa: BLE001
        out = f"{type(e).__name__}: {e}"
    return {"result": out, "collectives": len(auditor.log) - before}


def _audited_group(rank, G, port) -> "Auditor":
    """A gloo group of G ranks on this machine, with the auditor around every collective."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=G,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    auditor = Auditor(torch.device("cpu"))
    auditor.install()
    return auditor


def ep_worker(rank, G, port, out_dir):
    auditor = _audited_group(rank, G, port)
    res = {}
    try:
        for case in EP_CASES:
            auditor.scenario = case[0]
            res[case[0]] = run_ep_case(case, rank, G)
        auditor.scenario = "hf"
        res["hf"] = run_hf_case(rank, G)
        auditor.scenario = "nccl-cpu-inputs"
        res["nccl-cpu-inputs"] = run_nccl_cpu_inputs(rank, G, auditor)
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    finally:
        auditor.uninstall()
        res["log"], res["audit_errors"] = auditor.log, auditor.errors
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        if "error" not in res:
            dist.destroy_process_group()
        os._exit(0)


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("nccl_ep")
    spawn(ep_worker, 2, str(d), deadline_s=SPAWN_DEADLINE_S)
    ranks = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return ranks


def test_every_collective_fits_nccl(ep_results):
    """Device, contiguity, dtype, int split sizes, no object collectives or async ops."""
    errs = [e for res in ep_results for e in res["audit_errors"]]
    assert not errs, "\n".join(errs[:20])
    ops = {e["op"] for res in ep_results for e in res["log"]}
    assert {"all_gather", "all_to_all_single", "all_reduce", "broadcast"} <= ops, ops


def test_ranks_issue_matching_collectives(ep_results):
    """NCCL does not check that the ranks agree: same sequence, dtypes, sizes; a2a splits pair up."""
    errs = consistency_errors([res["log"] for res in ep_results])
    assert not errs, "\n".join(errs[:20])


def test_cases_ran(ep_results):
    for res in ep_results:
        assert res["fixed-c20-split"]["split"], "the split fallback was not exercised"
        assert res["hf"]["keys"] > 0
    # the kept rows' positions crossed the network in the compact C20 case (on some rank)
    assert sum(res["lrmoe-c20-compact"]["comm"].get("bwd_grad_index", 0) for res in ep_results) > 0
    # compact backward with drops sends the row positions (int32 all-to-all)
    assert any(e["op"] == "all_to_all_single" and e["dtype"] == "torch.int32" for e in ep_results[0]["log"])


def mismatch_worker(rank, G, port, out_dir):
    auditor = _audited_group(rank, G, port)
    auditor.scenario = "size-mismatch"
    out = run_size_mismatch(rank, G)
    auditor.uninstall()
    torch.save({"result": out, "log": auditor.log}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)


def test_num_experts_mismatch_raises_on_every_rank(tmp_path):
    """gloo aborts the process on the size mismatch, NCCL would hang or read garbage."""
    spawn(mismatch_worker, 2, str(tmp_path), deadline_s=90)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, res in enumerate(ranks):
        assert res["result"].startswith("ValueError") and "num_experts" in res["result"], f"rank {r}: {res['result']}"
    errs = consistency_errors([res["log"] for res in ranks])
    assert not errs, "\n".join(errs)


def test_nccl_group_refuses_cpu_inputs_before_any_collective(ep_results):
    for r, res in enumerate(ep_results):
        out = res["nccl-cpu-inputs"]
        assert out["result"].startswith("ValueError") and "CUDA" in out["result"], f"rank {r}: {out}"
        assert out["collectives"] == 0


# ----------------------------------------------------------------------------- worker: launch helpers
def launch_worker(rank, G, port, out_dir):
    from lrmoe.parallel import launch

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(G), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(G),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    res = {}

    def part(name, fn):
        try:
            res[name] = fn()
        except Exception:  # noqa: BLE001
            res[name] = {"error": traceback.format_exc()}

    env = launch.init_distributed(ep=1, timeout_s=30)
    cpu = torch.device("cpu")
    part("timeouts", lambda: {name: g._get_backend(cpu).options._timeout.total_seconds()
                              for name, g in (("default", dist.group.WORLD), ("ep", env.ep_group),
                                              ("expert_dp", env.expert_dp_group))})

    def existing():
        # An existing gloo group decides the backend even where CUDA is available (no CUDA call).
        real = torch.cuda.is_available
        torch.cuda.is_available = lambda: True
        try:
            again = launch.init_distributed(ep=2, timeout_s=30)
            out = {"again": (again.backend, str(again.device), again.ep_group is None)}
            try:
                launch.init_distributed(ep=2, backend="nccl")
                out["mismatch"] = "no error"
            except ValueError as e:
                out["mismatch"] = f"ValueError: {e}"
            return out
        finally:
            torch.cuda.is_available = real

    part("existing", existing)

    def host_barrier():
        # A host barrier outlasts the training group's timeout, and the store's, lowered to 3 s
        # once both ranks are here (rank 0 then arrives 5 s late).
        dist.barrier()
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=3))
        dist.distributed_c10d._get_default_store().set_timeout(datetime.timedelta(seconds=3))
        arrived = os.path.join(out_dir, "host_barrier.rank0.arrived")
        if rank == 0:
            time.sleep(5)  # later than the lowered timeouts
            open(arrived, "w").close()
        launch.host_barrier(timeout_s=60)
        return {"returned": True, "peer_arrived_first": os.path.exists(arrived)}

    part("host_barrier", host_barrier)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    launch.shutdown()
    os._exit(0)


@pytest.fixture(scope="module")
def launch_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("nccl_launch")
    spawn(launch_worker, 2, str(d), deadline_s=120)
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_subgroups_take_the_timeout(launch_results):
    """new_group's default is the backend's (NCCL 10 min, gloo 30 min), not init's timeout."""
    for res in launch_results:
        assert res["timeouts"] == {"default": 30.0, "ep": 30.0, "expert_dp": 30.0}, res["timeouts"]


def test_existing_group_decides_the_backend(launch_results):
    for res in launch_results:
        out = res["existing"]
        assert "error" not in out, out.get("error")
        assert out["again"] == ("gloo", "cpu", True)
        assert out["mismatch"].startswith("ValueError") and "already exists" in out["mismatch"], out["mismatch"]


def test_host_barrier_waits_past_the_collective_timeout(launch_results):
    """Rank 0 arrives after the lowered 3 s timeouts: rank 1's barrier neither raises nor returns
    before rank 0 has arrived."""
    for res in launch_results:
        assert res["host_barrier"] == {"returned": True, "peer_arrived_first": True}, res["host_barrier"]


def test_host_barrier_single_process_is_a_no_op():
    from lrmoe.parallel import launch

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    launch.host_barrier(timeout_s=1)
    assert not dist.is_initialized() and launch._HOST_GROUPS == {}  # no group made, none cached


# ----------------------------------------------------------------------------- in-process guards
class _Stop(Exception):
    pass


def test_clip_norm_all_reduce_on_the_model_device_without_gradients(monkeypatch):
    """A rank without gradients still all-reduces on the model's device (NCCL: CUDA only), not on
    the CPU. The model sits on 'meta' here to tell the devices apart; the all-reduce is stopped."""
    from lrmoe.hf import parallel as ep_hf
    from lrmoe.parallel.grad_sync import mark_expert_parallel

    model = torch.nn.Linear(4, 4, device="meta")
    model.extra = mark_expert_parallel(torch.nn.Parameter(torch.empty(2, 3, device="meta")))
    seen = []

    def fake_all_reduce(t, *a, **k):
        seen.append(t.device)
        raise _Stop

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    with pytest.raises(_Stop):
        ep_hf.clip_grad_norm_(model, 1.0)
    assert seen == [torch.device("meta")]


def test_device_guard():
    from lrmoe.parallel.runtime import check_devices

    t = torch.zeros(2, 2)
    ep = types.SimpleNamespace(backend="gloo")
    check_devices(t, t, t, t, t, ep)  # gloo: CPU is fine
    with pytest.raises(ValueError, match="one device"):
        check_devices(t, t, t.to("meta"), t, t, ep)
    with pytest.raises(ValueError, match="CUDA tensors"):
        check_devices(t, t, t, t, t, types.SimpleNamespace(backend="nccl"))
    check_devices(t, t, t, t, t, types.SimpleNamespace(backend="cpu:gloo,cuda:nccl"))


# ----------------------------------------------------------------------------- data-parallel gradient sync
def _grad_sync_worker(rank, G, port, out_dir):
    from lrmoe.parallel import launch
    from lrmoe.parallel.grad_sync import finish_grad_sync, mark_expert_parallel

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(G), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(G),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    launch.init_distributed(ep=G, timeout_s=PG_TIMEOUT_S)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(5))
    m.b = torch.nn.Parameter(torch.zeros(3, 4))
    m.c = torch.nn.Parameter(torch.zeros(7))  # no gradient on any rank
    m.d = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    m.e = mark_expert_parallel(torch.nn.Parameter(torch.zeros(4)))  # an expert shard
    g = torch.Generator().manual_seed(100 + rank)
    before = {}
    for name in ("a", "b", "d", "e"):
        p = getattr(m, name)
        if name == "b" and rank == 1:
            continue  # b has a gradient on rank 0 only
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        before[name] = p.grad.clone()
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1]
    try:
        finish_grad_sync(m, None, None, bucket_numel=6)
    finally:
        dist.all_reduce = real
    after = {n: (None if getattr(m, n).grad is None else getattr(m, n).grad.clone()) for n in "abcde"}
    torch.save({"before": before, "after": after, "calls": calls}, os.path.join(out_dir, f"rank{rank}.pt"))
    launch.shutdown()
    os._exit(0)


def test_grad_sync_agrees_on_missing_gradients_and_buckets(tmp_path):
    """A gradient present on one rank only is averaged with zeros (the other rank gets a zero
    gradient first, so both ranks' bucketed all-reduces match); a parameter without gradients
    anywhere stays None; buckets split by size and dtype; expert shards are divided by W only."""
    spawn(_grad_sync_worker, 2, str(tmp_path), deadline_s=120)
    r = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(2)]
    for name in ("a", "d"):
        want = (r[0]["before"][name] + r[1]["before"][name]) / 2
        for i in range(2):
            torch.testing.assert_close(r[i]["after"][name], want, rtol=0, atol=1e-12)
    for i in range(2):
        torch.testing.assert_close(r[i]["after"]["b"], r[0]["before"]["b"] / 2, rtol=0, atol=1e-7)
        assert r[i]["after"]["c"] is None
        torch.testing.assert_close(r[i]["after"]["e"], r[i]["before"]["e"] / 2, rtol=0, atol=0)
        # presence flags (5 trainable params), then buckets: a (5), b (12, alone: over 6), d (fp64, own dtype)
        assert r[i]["calls"] == [5, 5, 12, 2], r[i]["calls"]


def test_buckets_keep_order_size_and_dtype():
    from lrmoe.parallel.grad_sync import gradient_buckets

    gs = [torch.zeros(3), torch.zeros(2), torch.zeros(4), torch.zeros(1, dtype=torch.float64), torch.zeros(1),
          torch.zeros(9)]
    b = gradient_buckets(gs, 5)
    assert [[g.numel() for g in x] for x in b] == [[3, 2], [4], [1], [1], [9]]
    assert [x[0].dtype for x in b] == [torch.float32, torch.float32, torch.float64, torch.float32, torch.float32]
    assert [g for x in b for g in x] == gs  # every gradient once, in order (identity)
