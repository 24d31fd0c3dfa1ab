"""benchmarks/diloco_reference.py's DiLoCo on toy models: the outer step is the textbook formula, and DiLoCo with
one replica, outer lr 1 and no momentum is plain training (so the reference adds nothing of its own)."""
import torch

from benchmarks.diloco_reference import OuterOptimizer, train_diloco

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
