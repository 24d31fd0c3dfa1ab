"""benchmarks/diloco_reference.py's DiLoCo on toy models: the outer step is the textbook formula, and DiLoCo with
one replica, outer lr 1 and no momentum is plain training (so the reference adds nothing of its own)."""
import torch

from benchmarks.diloco_reference import CodedPushes, OuterOptimizer, train_diloco

LR, MU = 0.7, 0.9


def linear(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def test_outer_steps_are_nesterov_on_the_mean_pseudo_gradient():
    anchor = linear(0)
    outer = OuterOptimizer(anchor.parameters(), [[0, 1]], LR, MU)
    a = [p.detach().clone() for p in anchor.parameters()]
    m = [torch.zeros_like(x) for x in a]
    for round_ in range(2):  # the second round exercises the momentum carried over
        replicas = [[p.detach() for p in linear(10 * round_ + k).parameters()] for k in (1, 2)]
        new = outer.merge(0, replicas)
        for i in range(2):
            g = (a[i] - replicas[0][i] + a[i] - replicas[1][i]) / 2
            m[i] = MU * m[i] + g
            a[i] = a[i] - LR * (g + MU * m[i])
            torch.testing.assert_close(new[i], a[i], rtol=0, atol=1e-6)


def test_one_replica_outer_lr_1_no_momentum_is_plain_training():
    data = torch.randn(12, 4, 3), torch.randn(12, 4, 2)
    plain, diloco = linear(0), linear(0)

    def stepper(model):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)

        def step(_, s):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(data[0][s]), data[1][s]).backward()
            opt.step()
        return step

    step_plain = stepper(plain)
    for s in range(12):
        step_plain(0, s)
    final = train_diloco([diloco], stepper(diloco), 12, 5, OuterOptimizer(diloco.parameters(), [[0], [1]], 1.0, 0.0))
    for p, q, f in zip(plain.parameters(), diloco.parameters(), final):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
        torch.testing.assert_close(f, p, rtol=0, atol=1e-6)


def test_coded_pushes_are_the_codec_s_with_each_replica_s_own_error_feedback():
    """--coded-pushes: the merge averages decode(encode(g + residual)) per replica, each replica's residual carried
    to its next push of that parameter (and none without error feedback)."""
    import numpy as np
    from yeto_patch.wire import codecs
    anchor = linear(0)
    pushes = CodedPushes("int1", 8, True, 2, 2)
    outer = OuterOptimizer(anchor.parameters(), [[0, 1]], 1.0, 0.0, pushes=pushes)
    a = [p.detach().clone() for p in anchor.parameters()]
    res = [[np.zeros(x.numel(), np.float32) for x in a] for _ in range(2)]
    for round_ in range(3):
        replicas = [[p.detach() for p in linear(10 * round_ + k).parameters()] for k in (1, 2)]
        new = outer.merge(0, replicas)
        for i in range(2):
            sent = []
            for k in range(2):
                x = (a[i] - replicas[k][i]).reshape(-1).numpy() + res[k][i]
                d = codecs.decode("int1", codecs.encode("int1", x, 8), x.size, 8)
                res[k][i] = x - d
                sent.append(torch.from_numpy(d).reshape(a[i].shape))
            a[i] = a[i] - (sent[0] + sent[1]) / 2
            torch.testing.assert_close(new[i], a[i], rtol=0, atol=1e-6)
    assert any(np.abs(r).max() > 0 for r in pushes.residual[1])
    plain = CodedPushes("int4", 8, False, 1, 1)
    g = torch.randn(5, 3)
    plain(0, 0, g)
    assert plain.residual[0][0] is None


def test_overlap_installs_the_blend_tau_steps_later():
    """H=4, tau=2, alpha 0.5, one replica, outer lr 1, no momentum, each step adds 1: the merge after step 4 gives
    base = start + 4; the replica trains on to start + 6; after step 6 it is (start + 6 + base) / 2 = start + 5;
    step 7 (the final cut) gives start + 6 (start + 7 if bases were installed at once or never)."""
    model = linear(0)
    trace = []

    def step(_, s):
        with torch.no_grad():
            model.weight.add_(1.0)
        trace.append(model.weight.detach().clone())

    start = model.weight.detach().clone()
    outer = OuterOptimizer(model.parameters(), [[0, 1]], 1.0, 0.0)
    final = train_diloco([model], step, 7, 4, outer, tau=2, alpha=0.5)
    torch.testing.assert_close(trace[5], start + 6)  # trained on from the local weights until the install
    torch.testing.assert_close(final[0], start + 6)
    torch.testing.assert_close(model.weight.detach(), start + 6)


def _mlm():
    import importlib.util
    import pytest
    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron-core < 0.17 ships no megatron.training")
    import sys
    sys.path.insert(0, "benchmarks")
    import diloco_reference_mlm
    return diloco_reference_mlm


def test_reference_takes_the_islands_own_argument_lists():
    """benchmarks/diloco_reference_mlm.py on a setting given only as argument lists: each island's seed, data,
    batch and lr schedule as Megatron's parser reads them, H / tau / alpha through yeto-patch's config, the padded
    vocabulary of the islands' layout kept, parallelism and bf16 dropped; the benchmark's own options build the
    same lists; islands that describe different models are refused."""
    import shlex
    import pytest
    R = _mlm()
    bench = R.parse(["--init", "S", "--data", "/d", "--seeds", "11:22", "--warmup", "2", "--data-layout", "corpus"])
    a, b = (shlex.join(x) for x in bench.islands)
    o = R.parse(["--init", "S", "--island", a, "--island", b, "--island-env",
                 "YETO_DILOCO_SYNC_EVERY=20 YETO_DILOCO_MERGE_ALPHA=0.3 YETO_DILOCO_SYNCER=h:1"])
    assert (o.h, o.tau_, o.alpha_, o.vocab_rows, o.iters) == (20, 5, 0.3, 384, 300)
    assert [(n.seed, n.global_batch_size, n.lr_warmup_iters) for n in o.parsed] == [(11, 4, 2), (22, 4, 2)]
    assert o.parsed[1].train_data_path == ["1", "/d/shard0", "1", "/d/shard1"]
    argv = R.megatron_argv(o)
    assert "--bf16" not in argv and "--tensor-model-parallel-size" not in argv and "--use-distributed-optimizer" \
        not in argv and argv[argv.index("--make-vocab-size-divisible-by") + 1] == "384"
    assert (bench.h, bench.tau_, bench.alpha_) == (10, 5, 0.5)
    other = shlex.join([x if x != "64" else "32" for x in bench.islands[1]])   # hidden 32 (and seq 32)
    with pytest.raises(SystemExit, match="another model"):
        R.parse(["--init", "S", "--island", a, "--island", other])
    with pytest.raises(SystemExit):   # no islands at all
        R.parse(["--init", "S"])


def test_reference_codes_its_pushes_only_when_asked():
    """--push-dtype: the product's codec on each replica's pseudo-gradient (error feedback unless
    --no-error-feedback); a codec or block the product refuses is refused before any training."""
    import pytest
    R = _mlm()
    base = ["--init", "S", "--data", "/d"]
    assert R.pushes_label(R.parse(base)) == "exact"
    assert R.pushes_label(R.parse(base + ["--push-dtype", "int4"])) == "int4 block 256 + error feedback"
    o = R.parse(base + ["--push-dtype", "int1", "--push-block", "1024", "--no-error-feedback"])
    assert R.pushes_label(o) == "int1 block 1024"
    for bad in (["--push-dtype", "int3"], ["--push-dtype", "int1", "--push-block", "12"]):
        with pytest.raises(SystemExit):
            R.parse(base + bad)
