"""FP32 master read / write on real megatron-core (CPU, 4 gloo ranks in one pool for the module)."""
import numpy as np
import pytest

from tests.mcore.harness import hdo_supported

W = "tests.island.masters.test_view_mcore"

LAYOUTS = {
    "tp2dp2_bf16_distopt": dict(tp=2, bf16=True),
    "pp2tp2_bf16_distopt": dict(tp=2, pp=2, layers=4, micro=4, bf16=True),
    "dp4_bf16_float16opt": dict(tp=1, bf16=True, dist_opt=False),
    "dp4_fp32_fp32opt": dict(tp=1, dist_opt=False),
    "tp2dp2_fp32_distopt": dict(tp=2),
    "moe_tp2ep2_bf16_chained": dict(tp=2, ep=2, experts=4, bf16=True),
}
EXTRA = {
    "pp2vpp2_bf16": dict(tp=1, pp=2, vpp=2, layers=4, micro=4, bf16=True),
    "moe_tp2ep2etp2_fp32": dict(tp=2, ep=2, experts=4, etp=2),
    "tp2dp2_bf16_overlap_param_gather": dict(tp=2, bf16=True, overlap_grad_reduce=True, overlap_param_gather=True),
}
if hdo_supported():
    EXTRA["tp2dp2_bf16_hybrid_device_optimizer"] = dict(tp=2, bf16=True, cpu_offload=True, offload_fraction=0.5)


def _compare_with_reference(res):
    got = res[0]["got"]
    ref = {}
    for r in res:
        ref.update(r["ref"])
    assert sorted(got) == sorted(ref)
    bad = [k for k in got if not np.array_equal(got[k], ref[k])]
    assert not bad, f"read differs from the reference for {bad}"
    names = [n for n, _, _ in res[0]["manifest"]]
    assert sorted(names) == sorted(got)


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(EXTRA))
def test_read_equals_megatron_reference(mcore_pool, layout):
    """(1) rank 0's streamed read == megatron's own DP gathering + TP concatenation, element for element."""
    cfg = {**LAYOUTS, **EXTRA}[layout]
    res = mcore_pool.run(f"{W}:read_vs_reference", cfg, timeout=240)
    _compare_with_reference(res)
    # chunks of 16 KiB: nothing bigger than a small multiple of the chunk was buffered on any rank
    assert max(r["peak"] for r in res) <= 2 * (1 << 14)


@pytest.mark.parametrize("layout", list(LAYOUTS) + ["tp2dp2_bf16_overlap_param_gather"]
                         + (["tp2dp2_bf16_hybrid_device_optimizer"] if hdo_supported() else []))
def test_write_read_plus_c_changes_masters_exactly_keeps_adam_state(mcore_pool, layout):
    """(3) write(read() + c): masters == old + c, params == cast(masters) on every replica, Adam state
    bit-identical, and training continues and lowers the loss."""
    cfg = {**LAYOUTS, **EXTRA}[layout]
    res = mcore_pool.run(f"{W}:write_plus_constant", cfg, 0.03125, timeout=240)
    for r in res:
        assert r["same_states"] and r["n_states"] > 0
    assert sum(r["n_checked"] for r in res) > 0
    r0 = res[0]
    assert r0["eval1"] != pytest.approx(r0["eval0"], abs=1e-4)    # the write changed the model
    assert r0["eval2"] < r0["eval1"], r0                          # the next steps train from the new values


def test_blend_write(mcore_pool):
    res = mcore_pool.run(f"{W}:write_plus_constant", LAYOUTS["tp2dp2_bf16_distopt"], 0.03125, 2, 1 << 14, 0.25,
                         timeout=240)
    assert all(r["same_states"] for r in res)
    assert res[0]["eval2"] < res[0]["eval1"]


def test_blend_with_anchor_at_the_value(mcore_pool):
    """DiLoCo's overlapped install: masters := alpha*local + (1-alpha)*base, anchor := base."""
    res = mcore_pool.run(f"{W}:blend_with_anchor_value", LAYOUTS["pp2tp2_bf16_distopt"], 0.25, 0.5, timeout=240)
    r = res[0]
    assert r["err_cur"] < 1e-6 and r["err_delta"] < 1e-6
    assert r["mean_delta"] == pytest.approx(0.125, abs=1e-4)   # (1 - alpha) * c


@pytest.mark.parametrize("layout", ["pp2tp2_bf16_distopt", "dp4_bf16_float16opt"])
def test_read_delta_is_anchor_minus_current(mcore_pool, layout):
    res = mcore_pool.run(f"{W}:delta_roundtrip", LAYOUTS[layout], timeout=240)
    assert res[0]["ok"] and res[0]["sub_ok"]
    # anchors only where the data is owned: together they hold the model once
    assert sum(r["anchor_bytes"] for r in res) > 0


@pytest.mark.parametrize("layout", ["tp2dp2_bf16_distopt", "dp4_bf16_float16opt"])
def test_a_snapshot_gathered_later_on_its_own_group_is_the_delta_of_its_boundary(mcore_pool, layout):
    """The background push's data path: each rank snapshots only what it owns; gathered later, beside a
    read_delta on the view's group, it gives rank 0 the boundary's delta bit for bit."""
    res = mcore_pool.run(f"{W}:snapshot_gather", LAYOUTS[layout], timeout=240)
    assert res[0]["ok"] and not any(r["err"] or r["alive"] for r in res), res
    assert sum(r["own"] for r in res) == res[0]["total"]     # the snapshots hold the model once, split by owner


@pytest.mark.parametrize("kind,expect", [
    ("sink", "injected failure in the rank-0 sink"),
    ("no_anchor", "no anchor for"),
    ("mismatched_op", "called write"),
])
def test_error_on_one_rank_is_raised_on_every_rank(mcore_pool, kind, expect):
    """(5) an injected failure on one rank ends every rank with that message, quickly, and the island still works."""
    res = mcore_pool.run(f"{W}:injected_failure", LAYOUTS["pp2tp2_bf16_distopt"], kind, timeout=120)
    for r in res:
        assert r["error"] is not None and expect in r["error"], res
        assert r["seconds"] < 30


def test_non_finite_write_is_refused_everywhere_and_installs_nothing(mcore_pool):
    res = mcore_pool.run(f"{W}:injected_failure", LAYOUTS["tp2dp2_bf16_distopt"], "bad_source", timeout=120)
    for r in res:
        assert r["error"] and "non-finite" in r["error"]
        assert r["unchanged"]


def test_peak_memory_is_bounded_by_the_chunk_not_the_model(mcore_pool):
    """(6) a model ~130x the chunk: peak sync buffers per rank stay a small multiple of the chunk."""
    chunk = 1 << 15
    cfg = dict(tp=2, bf16=True, hidden=192, ffn=768, heads=8, layers=2, vocab=1024)
    res = mcore_pool.run(f"{W}:bounded_memory", cfg, chunk, timeout=240)
    model_bytes = res[0]["model_bytes"]
    assert model_bytes > 100 * chunk
    print("bounded memory:", res)
    for r in res:
        assert r["read_peak"] <= 3 * chunk and r["write_peak"] <= 3 * chunk, r
        # measured resident memory: far below one model copy (allocator noise allowed)
        assert r["read_rss"] < model_bytes / 8 and r["write_rss"] < model_bytes / 8, r


def test_relative_write_adds_the_owners_anchor_exactly(mcore_pool):
    """Quantized base updates from the syncer: value = anchor + change on the owner, bit for bit, for the
    anchor-only pass, a replace and a blended install; without anchors every rank refuses."""
    res = mcore_pool.run(f"{W}:relative_write", LAYOUTS["tp2dp2_bf16_distopt"], 0.5, timeout=480)
    for r in res:
        assert r["err"] and "no anchor for" in r["err"], res
    r = res[0]
    assert r["changed"] and r["keep_masters"] and r["keep_anchor"]
    assert r["replace"] and r["replace_anchor"] and r["blend_anchor"]
    assert r["blend_err"] < 1e-6


@pytest.mark.parametrize("layout,mode,updates,route", [
    ("tp2dp2_bf16_distopt", "replace", 0, "in_step"),
    ("tp2dp2_bf16_distopt", "blend", 0, "in_step"),
    ("tp2dp2_bf16_distopt", "blend", 2, "after_step"),
    ("tp2dp2_bf16_distopt", "blend", 0, "after_step"),
    ("dp4_bf16_float16opt", "blend", 0, "in_step"),
    ("dp4_bf16_float16opt", "replace", 0, "after_step"),
    ("pp2tp2_bf16_distopt", "replace", 1, "in_step"),
    ("moe_tp2ep2_bf16_chained", "blend", 1, "in_step"),
    ("tp2dp2_bf16_overlap_param_gather", "blend", 0, "in_step"),
    ("tp2dp2_fp32_distopt", "blend", 0, "in_step"),
    ("dp4_fp32_fp32opt", "blend", 0, "after_step"),          # (FP32Optimizer never casts: after the step only)
    pytest.param("tp2dp2_bf16_hybrid_device_optimizer", "blend", 0, "in_step",
                 marks=pytest.mark.skipif(not hdo_supported(), reason="no HybridDeviceOptimizer here")),
])
def test_a_base_staged_in_the_background_installs_what_write_installs(mcore_pool, layout, mode, updates, route):
    """stage (background group, another thread) + an install against write on the same state, every master,
    anchor and param on every rank bit for bit: installed into the masters only, before each leaf optimizer's
    own cast and Megatron's parameter gather (in_step: what the engine does inside the optimizer step), or after
    the step with the params and the replicas' refresh (after_step)."""
    cfg = {**LAYOUTS, **EXTRA}[layout]
    res = mcore_pool.run(f"{W}:staged_vs_write", cfg, mode, updates, 0.5, 1 << 14, route, timeout=240)
    for r in res:
        assert not r["err"] and not r["alive"] and r["untouched"] and not r["pending"], r
        assert not r["differ"], r["differ"][:5]
        # the staging is one float32 copy of the rank's masters, two for a blend (the scaled values too)
        assert r["staged_bytes"] == r["master_bytes"] * (2 if mode == "blend" else 1), r


def test_agree_flags_ors_the_flags_and_raises_the_lowest_failing_ranks_error_everywhere(mcore_pool):
    res = mcore_pool.run(f"{W}:agree_flags_cases", timeout=120)
    assert [r["ok"] for r in res] == [[1, 0, 1]] * 4
    assert [r["err"] for r in res] == ["RuntimeError: install failed on rank 2 [island rank 2]"] * 4

# ================================================================================================ workers
# Run on every rank of the module's pool (pool.run(f"{W}:<name>", ...)): real megatron-core on CPU, gloo.
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.island.masters.mcore_setup import _setup, _wire  # noqa: E402
from tests.mcore import harness  # noqa: E402
from yeto_patch.island import IslandComm, IslandError, collect_arrays, find_masters  # noqa: E402
from yeto_patch.island.masters.refs import leaf_optimizers  # noqa: E402


def _reference_full_masters(ctx) -> dict:
    """{global name: full fp32 array} for the parameters whose TP-rank-0 / DP-rank-0 copy lives here.

    Uses megatron's own accessors (DistributedOptimizer._get_main_param_and_optimizer_states + all_reduce over
    its data_parallel_group; main params of the non-distributed optimizers) and megatron's TP / expert-TP groups,
    and names layers / experts from the parallel ranks, not from yeto_patch.island.masters.names."""
    from megatron.core import parallel_state as ps
    cfg = ctx["cfg"]
    opt = ctx["optimizer"]
    if cfg.overlap_param_gather:   # model params are only current after the (deferred) all-gather
        for c in ctx["model"]:
            c.start_param_sync(force_sync=True)
    main_of = {}
    for o in leaf_optimizers(opt):
        if hasattr(o, "model_param_group_index_map"):
            bufs = [p for b in o.buffers for p in b.params]
            for p in bufs:   # identical order on every DP rank
                full = torch.zeros(p.numel(), dtype=torch.float32)
                if p in o.model_param_group_index_map:
                    rng = o._get_model_param_range_map(p)["param"]
                    st = o._get_main_param_and_optimizer_states(p)
                    full[rng.start:rng.end] = st["param"].detach().float()
                dist.all_reduce(full, group=o.data_parallel_group)
                main_of[p] = full.view(p.shape)
        elif hasattr(o, "fp32_from_float16_groups"):
            for g16, g32 in zip(o.float16_groups, o.fp32_from_float16_groups):
                for p, m in zip(g16, g32):
                    main_of[p] = m.detach().clone()
            for g in o.fp32_from_fp32_groups:
                for p in g:
                    main_of[p] = p.detach().clone()
        else:
            for g in o.optimizer.param_groups:
                for p in g["params"]:
                    main_of[p] = p.detach().clone()
    out = {}
    layers_per_chunk = cfg.layers // (cfg.pp * (cfg.vpp or 1))
    pp_rank = ps.get_pipeline_model_parallel_rank()
    for ci, chunk in enumerate(ctx["model"]):
        model = harness.unwrap(chunk)
        for name, p in model.named_parameters():
            is_expert = ".experts." in name
            if is_expert:
                g, tp_rank = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank()
            else:
                g, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
            m = main_of[p]
            assert torch.equal(m.to(p.dtype), p.detach()), f"master and param disagree for {name}"
            if getattr(p, "tensor_model_parallel", False) and g.size() > 1:
                assert getattr(p, "partition_stride", 1) == 1
                parts = [torch.empty_like(m) for _ in range(g.size())]
                dist.all_gather(parts, m.contiguous(), group=g)
                m = torch.cat(parts, dim=p.partition_dim)
            ref = name
            parts_ = name.split(".")
            if parts_[:2] == ["decoder", "layers"]:
                vp = ci
                glob = (vp * cfg.pp + pp_rank) * layers_per_chunk + int(parts_[2])
                parts_[2] = str(glob)
            if is_expert:
                i = parts_.index("local_experts")
                n_local = cfg.experts // cfg.ep
                parts_[i: i + 2] = [str(ps.get_expert_model_parallel_rank() * n_local + int(parts_[i + 1]))]
            ref = ".".join(parts_)
            if name == "output_layer.weight" and cfg.tied:
                continue   # the copy of the embedding; compared separately
            dp_rank = (ps.get_expert_data_parallel_rank() if is_expert else ps.get_data_parallel_rank())
            if tp_rank == 0 and dp_rank == 0:
                out[ref] = m.numpy().copy()
    return out


def read_vs_reference(cfg_kwargs, steps=2, chunk_bytes=1 << 14):
    ctx, man, view = _setup(cfg_kwargs, steps, chunk_bytes=chunk_bytes)
    got = collect_arrays(view)
    ref = _reference_full_masters(ctx)
    # every rank sends its reference arrays through rank 0's result (test process compares)
    res = dict(ref={k: v for k, v in ref.items()}, manifest=_wire(man), peak=view.stats["peak_buffer_bytes"],
               rounds=view.stats["rounds"], losses=ctx["losses"])
    if dist.get_rank() == 0:
        res["got"] = {man.entries[e].name: a for e, a in got.items()}
    return res


def _opt_states(optimizer):
    out = []
    for o in leaf_optimizers(optimizer):
        inner = o.optimizer
        subs = [inner] + list(getattr(inner, "sub_optimizers", []) or [])
        for so in subs:
            for p, st in so.state.items():
                for k, v in st.items():
                    if torch.is_tensor(v) and k != "master_param":
                        out.append((k, v.detach().clone()))
    return out


def write_plus_constant(cfg_kwargs, c=0.125, steps=2, chunk_bytes=1 << 14, blend_alpha=None):
    ctx, man, view = _setup(cfg_kwargs, steps, chunk_bytes=chunk_bytes)
    masters = find_masters(ctx["optimizer"])
    before_m = {k: m.master.clone() for k, m in masters.items()}
    before_s = _opt_states(ctx["optimizer"])
    assert before_s, "no optimizer state captured"
    full = collect_arrays(view)
    eval0 = harness.eval_loss(ctx)
    if dist.get_rank() == 0:
        src = {e: a + np.float32(c) for e, a in full.items()}
    else:
        src = None
    if blend_alpha is None:
        view.write(None, src)
    else:
        view.write(None, src, mode="blend", alpha=blend_alpha)
    # masters changed exactly as asked; params are the cast of the masters
    n_checked = 0
    for lp in man.local:
        m = masters.get(id(lp.param))
        if m is None:
            continue
        old = before_m[id(lp.param)]
        if blend_alpha is None:
            exp = old + torch.tensor(c, dtype=torch.float32)
        else:
            # the owner computes alpha * current + (1 - alpha) * value; replicas receive its result
            exp = (old + torch.tensor(c, dtype=torch.float32)) * (1.0 - blend_alpha) + old * blend_alpha
        assert torch.equal(m.master, exp), f"master of {lp.name} not as written"
        got = lp.param.detach().view(-1)[m.start:m.end]
        assert torch.equal(got, exp.to(lp.param.dtype)), f"param of {lp.name} != cast(master)"
        n_checked += 1
    # every local param (non-owned parts too) is the cast of the new global value
    after_s = _opt_states(ctx["optimizer"])
    same_states = len(after_s) == len(before_s) and all(
        k1 == k2 and torch.equal(a, b) for (k1, a), (k2, b) in zip(before_s, after_s))
    # all DP replicas of each param agree after the write (non-owned parts came from the owner)
    from megatron.core import parallel_state as ps
    for c_ in ctx["model"]:
        for name, p in harness.unwrap(c_).named_parameters():
            g = ps.get_expert_data_parallel_group() if ".experts." in name else ps.get_data_parallel_group()
            t = p.detach().float().clone()
            mx, mn = t.clone(), t.clone()
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=g)
            dist.all_reduce(mn, op=dist.ReduceOp.MIN, group=g)
            assert torch.equal(mx, mn), f"DP replicas of {name} differ after write"
    eval1 = harness.eval_loss(ctx)
    losses = harness.train_steps(ctx, 3, batch_step=0)   # the evaluation batch: its loss must fall
    eval2 = harness.eval_loss(ctx)
    return dict(n_checked=n_checked, same_states=same_states, n_states=len(before_s), eval0=eval0, eval1=eval1,
                eval2=eval2, losses=losses)


def delta_roundtrip(cfg_kwargs, chunk_bytes=1 << 14):
    ctx, man, view = _setup(cfg_kwargs, 1, chunk_bytes=chunk_bytes)
    view.snapshot_anchor()
    a = collect_arrays(view)
    harness.train_steps(ctx, 2)
    b = collect_arrays(view)
    d = collect_arrays(view, delta=True)
    ok = None
    if dist.get_rank() == 0:
        ok = all(np.array_equal(d[e], a[e] - b[e]) for e in a) and any(np.any(d[e]) for e in d)
    # a fragment only: entries 1 and 3
    sub = collect_arrays(view, [1, 3], delta=True)
    sub_ok = None if dist.get_rank() != 0 else sorted(sub) == [1, 3] and np.array_equal(sub[3], d[3])
    return dict(ok=ok, sub_ok=sub_ok, anchor_bytes=view.anchor_bytes())


def snapshot_gather(cfg_kwargs, chunk_bytes=1 << 14):
    """A background push's data path: snapshot_delta at a boundary, more training, then gather of the snapshot on
    a gloo group of its own in a second thread while the main thread runs read_delta on the view's group."""
    ctx, man, view = _setup(cfg_kwargs, 1, chunk_bytes=chunk_bytes)
    view.snapshot_anchor()
    harness.train_steps(ctx, 2)
    at_boundary = collect_arrays(view, delta=True)
    snap = view.snapshot_delta(range(len(man)))
    own = sum(int(b.numel()) for _, _, b in snap.values())
    harness.train_steps(ctx, 1)                      # the masters move on after the snapshot
    bg_comm = IslandComm(timeout_s=60)
    got, err = {}, []

    def sink(e, off, arr):
        got.setdefault(e, np.empty(man.entries[e].numel, np.float32))[off: off + arr.size] = arr

    def background():
        try:
            view.gather(range(len(man)), snap, sink if dist.get_rank() == 0 else None, bg_comm)
        except BaseException as e:  # noqa: BLE001
            err.append(repr(e))
    t = threading.Thread(target=background)
    t.start()
    now = collect_arrays(view, delta=True)           # concurrently, on the view's own group
    t.join(120)
    ok = None
    if dist.get_rank() == 0:
        ok = (not err and sorted(got) == sorted(at_boundary)
              and all(np.array_equal(got[e].reshape(at_boundary[e].shape), at_boundary[e]) for e in at_boundary)
              and any(not np.array_equal(now[e], at_boundary[e]) for e in now))
    return dict(ok=ok, err=err, alive=t.is_alive(), own=own, total=sum(e.numel for e in man.entries))


def injected_failure(cfg_kwargs, kind, chunk_bytes=1 << 12):
    ctx, man, view = _setup(cfg_kwargs, 0, chunk_bytes=chunk_bytes)
    calls = [0]

    def sink(e, off, arr):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected failure in the rank-0 sink")

    t0 = time.time()
    try:
        if kind == "sink":
            view.read(None, sink if dist.get_rank() == 0 else None)
        elif kind == "no_anchor":
            if dist.get_rank() != 2:
                view.snapshot_anchor()
            view.read_delta(None, sink=(lambda *a: None) if dist.get_rank() == 0 else None)
        elif kind == "mismatched_op":
            if dist.get_rank() == 1:
                view.write()
            else:
                view.read(None, (lambda *a: None) if dist.get_rank() == 0 else None)
        elif kind == "bad_source":
            def source(e, off, n):
                if e == 3:
                    return np.full(n, np.nan, dtype=np.float32)
                return np.zeros(n, dtype=np.float32)
            before = [p.detach().clone() for c in ctx["model"] for p in c.parameters()]
            try:
                view.write([3], source if dist.get_rank() == 0 else None)
            finally:
                after = [p.detach() for c in ctx["model"] for p in c.parameters()]
                unchanged = all(torch.equal(x, y) for x, y in zip(before, after))
            return dict(error=None, unchanged=unchanged)
        else:
            raise ValueError(kind)
    except IslandError as e:
        out = dict(error=str(e), seconds=time.time() - t0)
        if kind == "bad_source":
            after = [p.detach() for c in ctx["model"] for p in c.parameters()]
            out["unchanged"] = all(torch.equal(x, y) for x, y in zip(before, after))
        # the island still works after an agreed error
        collect_arrays(view, [0])
        return out
    return dict(error=None)


class _RssPeak:
    def __init__(self):
        import psutil
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def stop(self):
        self._stop = True
        self.t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        return self.peak - self.base


def bounded_memory(cfg_kwargs, chunk_bytes):
    ctx, man, view = _setup(cfg_kwargs, 0, chunk_bytes=chunk_bytes)
    import gc
    gc.collect()
    model_bytes = 4 * man.total_numel()
    digest = [0.0]

    def sink(e, off, arr):
        digest[0] += float(arr.sum(dtype=np.float64))

    def source(e, off, n):
        return np.full(n, 0.5, dtype=np.float32)

    # warm up the transfer paths (gloo buffers, allocator arenas) on one entry, then measure the whole model
    view.read([0], sink if dist.get_rank() == 0 else None)
    view.write([0], source if dist.get_rank() == 0 else None)
    view.stats["peak_buffer_bytes"] = 0
    mon = _RssPeak()
    view.read(None, sink if dist.get_rank() == 0 else None)
    read_rss = mon.stop()
    read_peak = view.stats["peak_buffer_bytes"]
    view.stats["peak_buffer_bytes"] = 0
    mon = _RssPeak()
    view.write(None, source if dist.get_rank() == 0 else None)
    write_rss = mon.stop()
    write_peak = view.stats["peak_buffer_bytes"]
    return dict(model_bytes=model_bytes, read_peak=read_peak, write_peak=write_peak, read_rss=read_rss,
                write_rss=write_rss, rounds=view.stats["rounds"])


def blend_with_anchor_value(cfg_kwargs, c=0.25, alpha=0.5):
    """write(mode=blend, set_anchor, anchor="value"): masters = alpha*local + (1-alpha)*value, anchor = value,
    so the next delta is value - blended."""
    ctx, man, view = _setup(cfg_kwargs, 1)
    full = collect_arrays(view)
    src = {e: a + np.float32(c) for e, a in full.items()} if dist.get_rank() == 0 else None
    view.write(None, src, mode="blend", alpha=alpha, set_anchor=True, anchor="value")
    cur = collect_arrays(view)
    d = collect_arrays(view, delta=True)
    if dist.get_rank() != 0:
        return None
    err_cur = max(float(np.max(np.abs(cur[e] - (alpha * full[e] + (1 - alpha) * src[e])))) for e in full)
    err_delta = max(float(np.max(np.abs(d[e] - (src[e] - cur[e])))) for e in full)
    return dict(err_cur=err_cur, err_delta=err_delta, mean_delta=float(np.mean([np.mean(x) for x in d.values()])))


def relative_write(cfg_kwargs, alpha=0.5):
    """write(..., relative=True): rank 0 sends changes, each owner adds its anchor (the syncer's quantized base
    updates). Anchor-only pass (blend alpha 1), replace, blend; and without anchors every rank refuses."""
    ctx, man, view = _setup(cfg_kwargs, 1)
    rank0 = dist.get_rank() == 0
    rng = np.random.default_rng(5)
    err = None
    try:
        view.write(None, {0: np.zeros(man.entries[0].numel, np.float32)} if rank0 else None, relative=True)
    except IslandError as e:
        err = str(e)
    view.snapshot_anchor()
    anchor = collect_arrays(view)
    harness.train_steps(ctx, 2)
    local = collect_arrays(view)

    def change():
        return {e: (rng.standard_normal(a.shape) * 0.01).astype(np.float32) for e, a in anchor.items()} \
            if rank0 else None
    d1, d2, d3 = change(), change(), change()
    view.write(None, d1, mode="blend", alpha=1.0, set_anchor=True, anchor="value", relative=True)
    after1 = collect_arrays(view)
    delta1 = collect_arrays(view, delta=True)
    view.write(None, d2, mode="replace", set_anchor=True, relative=True)
    after2 = collect_arrays(view)
    delta2 = collect_arrays(view, delta=True)
    view.write(None, d3, mode="blend", alpha=alpha, set_anchor=True, anchor="value", relative=True)
    after3 = collect_arrays(view)
    delta3 = collect_arrays(view, delta=True)
    if not rank0:
        return dict(err=err)
    a1 = {e: anchor[e] + d1[e] for e in anchor}          # float32 additions, as the syncer does them
    a2 = {e: a1[e] + d2[e] for e in anchor}
    a3 = {e: a2[e] + d3[e] for e in anchor}
    return dict(
        err=err, changed=any(not np.array_equal(anchor[e], local[e]) for e in anchor),
        keep_masters=all(np.array_equal(after1[e], local[e]) for e in anchor),
        keep_anchor=all(np.array_equal(delta1[e], a1[e] - local[e]) for e in anchor),
        replace=all(np.array_equal(after2[e], a2[e]) for e in anchor),
        replace_anchor=all(not np.any(delta2[e]) for e in anchor),
        blend_err=max(float(np.max(np.abs(after3[e] - (alpha * a2[e] + (1 - alpha) * a3[e])))) for e in anchor),
        blend_anchor=all(np.array_equal(delta3[e], a3[e] - after3[e]) for e in anchor))


def _island_state(view):
    """Clones of everything an install touches on this rank: model params, FP32 masters (and their extra
    copies), anchors (test-only: reads the view's tables)."""
    out = {}
    for k, lp in view.local_params().items():
        out[("param",) + k] = lp.param.data.clone()
    for k, m in view.master_refs().items():
        if m is not None:
            out[("master",) + k] = m.master.clone()
            for i, c in enumerate(list(m.extra_fp32) + list(m.extra_lowp)):
                out[("extra", i) + k] = c.clone()
    for k, (_, _, a) in view.anchors().items():
        out[("anchor",) + k] = a.clone()
    return out


def _restore_state(view, state):
    for k, lp in view.local_params().items():
        lp.param.data.copy_(state[("param",) + k])
    for k, m in view.master_refs().items():
        if m is not None:
            m.master.copy_(state[("master",) + k])
            for i, c in enumerate(list(m.extra_fp32) + list(m.extra_lowp)):
                c.copy_(state[("extra", i) + k])
    for k, (_, _, a) in view.anchors().items():
        a.copy_(state[("anchor",) + k])


def staged_vs_write(cfg_kwargs, mode, updates=0, alpha=0.5, chunk_bytes=1 << 14, route="in_step"):
    """The same base installed by write (the synchronous path) and by stage on a background group + an install:
    route "in_step": install_masters per leaf optimizer with params=False, then that leaf's own
    _copy_main_params_to_model_params and Megatron's parameter all-gather (what the optimizer step does right
    after the engine's install point); route "after_step": install_masters with params, then refresh_holders
    (the Installer's after-step install).
    Per rank, every master, anchor and param compared bit for bit: they must all be equal."""
    from yeto_patch.island.masters.refs import leaf_optimizers
    ctx, man, view = _setup(cfg_kwargs, 1, chunk_bytes=chunk_bytes)
    rank0 = dist.get_rank() == 0
    view.snapshot_anchor()
    harness.train_steps(ctx, 2)
    full = collect_arrays(view)
    rng = np.random.default_rng(11)
    n = max(1, updates)
    srcs = [{e: ((a + rng.standard_normal(a.shape) * 0.02) if not updates else
                 rng.standard_normal(a.shape) * 0.01).astype(np.float32).reshape(-1) for e, a in full.items()}
            for _ in range(n)] if rank0 else [None] * n
    before = _island_state(view)
    rel = {"relative": True} if updates else {}
    for s in srcs[:-1]:
        view.write(None, s, mode="blend", alpha=1.0, set_anchor=True, anchor="value", **rel)
    if mode == "replace":
        view.write(None, srcs[-1], mode="replace", set_anchor=True, **rel)
    else:
        view.write(None, srcs[-1], mode="blend", alpha=alpha, set_anchor=True, anchor="value", **rel)
    dist_opt = cfg_kwargs.get("dist_opt", True)

    def megatron_param_gather():   # (DistributedOptimizer: Megatron gathers params before the next forward)
        if dist_opt:
            for c in ctx["model"]:
                c.start_param_sync(force_sync=True)
    megatron_param_gather()
    by_write = _island_state(view)
    _restore_state(view, before)
    bg = IslandComm(timeout_s=60)
    bg.subgroups(view.holder_sets())
    staged, err = [], []
    blend_alpha = alpha if mode == "blend" else None

    def background():
        try:
            sources = [(lambda e, off, k, s=s: s[e][off: off + k]) for s in srcs] if rank0 else None
            staged.append(view.stage(None, sources, bg, relative=bool(updates) if rank0 else None,
                                     alpha=blend_alpha if rank0 else None))
        except BaseException as e:  # noqa: BLE001
            err.append(repr(e))
    t = threading.Thread(target=background)
    t.start()
    t.join(120)
    untouched = all(torch.equal(v, before[k]) for k, v in _island_state(view).items())   # staging changes nothing
    kept = [{e: a.copy() for e, a in src.items()} for src in srcs] if rank0 else []
    nbytes = staged[0].nbytes if staged else -1
    if route == "in_step":
        for leaf in leaf_optimizers(ctx["optimizer"]):
            view.install_masters(staged[0], leaf=id(leaf), params=False)
            leaf._copy_main_params_to_model_params()
        left = staged[0].uninstalled
        megatron_param_gather()
    else:
        view.install_masters(staged[0], params=True)
        if view.needs_refresh():
            view.refresh_holders(staged[0].entries)
        left = staged[0].uninstalled
        megatron_param_gather()
    untouched = untouched and all(np.array_equal(src[e], k[e]) for src, k in zip(srcs, kept) for e in src)
    by_stage = _island_state(view)
    differ = [str(k) for k, a in by_write.items() if not torch.equal(a, by_stage[k])]
    masters = sum((m.end - m.start) * 4 for m in view.master_refs().values() if m is not None and m.end > m.start)
    return dict(err=err, alive=t.is_alive(), untouched=untouched, differ=differ, staged_bytes=nbytes,
                master_bytes=masters, pending=left)


def agree_flags_cases() -> dict:
    """IslandComm.agree_flags on every rank: an OR of flags, then one rank's error raised everywhere with the lowest
    failing rank's message."""
    comm = IslandComm(timeout_s=60)
    r = dist.get_rank()
    ok = comm.agree_flags(None, [int(r == 1), 0, int(r >= 2)], "flags")
    err = None
    try:
        comm.agree_flags(RuntimeError(f"install failed on rank {r}") if r >= 2 else None, [1, 0, 0], "flags")
    except IslandError as e:
        err = str(e)
    return dict(ok=ok, err=err)
