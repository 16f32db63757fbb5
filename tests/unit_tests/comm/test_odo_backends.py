"""The quantized backends inside the OverlappedDistributedOptimizer at DP=4 on 2 simulated nodes, every backend in
one world: one SGD step within the analytic error bound of the plain run, a few training steps with bit-identical
weights on all ranks, and qwZ leaving the fp32 master shards exact."""
from __future__ import annotations

import functools

import pytest
import torch

from unit_tests.comm import _worlds as W
from unit_tests.dist_harness import run_distributed

# label: (grad_reduce, param_gather, qgz_bits)
COMBOS = {
    "plain+plain": ("plain", "plain", 4),
    "qgz4+plain": ("qgz", "plain", 4),
    "qgz8+plain": ("qgz", "plain", 8),
    "bytegrad+plain": ("bytegrad", "plain", 4),
    "plain+qwz": ("plain", "qwz", 4),
    "qgz4+qwz": ("qgz", "qwz", 4),
    "bytegrad+qwz": ("bytegrad", "qwz", 4),
    "ring+plain": ("ring", "plain", 4),
}
DP, RPN, STEPS, LR, GROUP = 4, 2, 6, 0.1, 32


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))


def _batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 13, generator=g), torch.randn(16, 5, generator=g)


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _wrap(module, gr, pg, bits, optimizer, lr, bucket_size=300, pool=2):
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx

    cfg = mx.OverlapConfig(bucket_size=bucket_size, buffer_pool_size=pool, grad_reduce=gr, param_gather=pg, ranks_per_node=RPN,
                           quant_group_size=GROUP, qgz_bits=bits)
    model = mx.OverlappedDDP(module, cfg)
    ocfg = OptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0)
    return model, mx.OverlappedDistributedOptimizer(ocfg, model)


def _train_all():
    """Rank body: every combo trains the MLP with SGD (no momentum, decay or clipping, so step 1 is w - lr*g)."""
    import torch.distributed as dist

    W.capture_logs()
    rank = dist.get_rank()
    x, y = _batch(rank)
    out = {}
    for label, (gr, pg, bits) in COMBOS.items():
        module = _mlp()
        model, opt = _wrap(module, gr, pg, bits, "sgd", LR)
        losses, weights = [], []
        model.ledger.reset()
        for _ in range(STEPS):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.scale_loss(loss).backward()
            model.finish_grad_sync()
            ok, _, _ = opt.step()
            assert ok
            opt.zero_grad()
            losses.append(loss.item())
            model.force_param_sync()
            weights.append(_flat(module))
        out[label] = {"weights": weights, "losses": losses, "ledger": model.ledger.summary()}
    out["masters"] = _masters_with_fixed_gradients(rank)
    return out


def _masters_with_fixed_gradients(rank: int):
    """A linear model whose gradient does not depend on its weights (d/dW sum(c * (Wx + b)) = c^T x), so every
    run sees identical gradients at every step: the fp32 masters must then be bit-identical with and without
    qwZ, while the model's weights are qwZ-decoded."""
    g = torch.Generator().manual_seed(200 + rank)
    x, c = torch.randn(8, 13, generator=g), torch.randn(8, 37, generator=g)
    out = {}
    for label in ("plain+plain", "plain+qwz", "qgz4+plain", "qgz4+qwz"):
        gr, pg, bits = COMBOS[label]
        torch.manual_seed(0)
        module = torch.nn.Linear(13, 37)
        model, opt = _wrap(module, gr, pg, bits, "adam", 1e-2)
        masters, weights = [], []
        for _ in range(3):
            (model(x) * c).sum().backward()
            model.finish_grad_sync()
            opt.step()
            opt.zero_grad()
            model.force_param_sync()
            masters.append(torch.cat([m.clone() for m in opt.masters]))
            weights.append(_flat(module))
        out[label] = {"masters": masters, "weights": weights}
    return out


@functools.lru_cache(maxsize=None)
def world():
    return run_distributed(_train_all, DP, timeout=300)


def _local_grads(rank: int) -> torch.Tensor:
    """This rank's unreduced gradient at the initial weights (what it puts into its buckets), in float64."""
    module = _mlp()
    x, y = _batch(rank)
    torch.nn.functional.mse_loss(module(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()]).double()


def _grad_error_bound(label: str, xs) -> float:
    """Bound on max |reduced gradient - plain's| from the per-group bounds of ``_worlds`` with every group's absmax
    and range replaced by the whole gradient's (bucket padding is zero, so ranges include 0): valid for any
    bucket layout. qgZ: first quantization of every rank plus the requantization of each node's partial sum;
    ByteGrad: two min-max rounds; both over the average taken once."""
    N, D = DP // RPN, RPN
    absmax = lambda t: float(t.abs().max())                      # noqa: E731
    rng = lambda t: float(max(t.max(), 0) - min(t.min(), 0))     # noqa: E731
    if label.startswith("qgz"):
        qm = (1 << (int(label[3]) - 1)) - 1
        total = 0.0
        for a in range(N):
            e1 = sum(absmax(xs[q]) / qm / 2 for q in range(a * D, (a + 1) * D))
            partial = sum(xs[q] for q in range(a * D, (a + 1) * D))
            total += e1 + (absmax(partial) + e1) / qm / 2
        return total / DP
    if label.startswith("bytegrad"):
        eps = 1e-7
        e1 = sum((rng(sum(xs[q] for q in range(a * D, (a + 1) * D))) + eps) / 510 for a in range(N)) / DP
        return e1 + (rng(sum(xs) / DP) + 2 * e1 + eps) / 510
    return 0.0


@pytest.mark.parametrize("label", [c for c in COMBOS if c != "plain+plain"])
def test_first_step_within_analytic_bound_of_plain(label):
    """Step 1 starts from identical weights, so w1 - w1_plain = -lr (g - g_plain) exactly (SGD): bounded by lr times
    the backend's gradient bound, plus qwZ's decode error of the published weights (half a step of a per-group
    INT8 scale, at most max|w| / 254), plus fp32 rounding."""
    res = world()
    plain = res[0]["plain+plain"]
    assert res[0][label]["losses"][0] == plain["losses"][0], "step 1 must start from the same weights"
    xs = [_local_grads(r) for r in range(DP)]
    w_plain = plain["weights"][0].double()
    w = res[0][label]["weights"][0].double()
    gscale = max(float(x.abs().max()) for x in xs)
    bound = LR * (_grad_error_bound(label, xs) + 1e-5 * gscale) + 1e-6 * float(w_plain.abs().max())
    if label.endswith("+qwz"):
        bound += float(w_plain.abs().max()) * (1 + 1e-3) / 254 + LR * _grad_error_bound(label, xs) / 254
    err = float((w - w_plain).abs().max())
    assert err <= bound, f"{label}: step-1 weights differ from plain by {err:.3g} > bound {bound:.3g}"
    if not label.startswith("ring"):   # ring quantizes nothing: plain's sum in ring order (rounding only)
        assert err > 0, f"{label}: nothing was quantized?"


@pytest.mark.parametrize("label", list(COMBOS))
def test_trains_with_bit_identical_weights_on_all_ranks(label):
    res = world()
    for step in range(STEPS):
        ws = [r[label]["weights"][step] for r in res]
        assert all(torch.equal(w, ws[0]) for w in ws[1:]), f"{label}: ranks differ after step {step + 1}"
    losses = [sum(r[label]["losses"][i] for r in res) / DP for i in range(STEPS)]
    assert losses[-1] < 0.95 * losses[0], f"{label} did not train: {losses}"
    led = res[0][label]["ledger"]
    gr, pg = label.split("+")
    if gr.startswith("qgz"):
        assert led["qgz_inter_all_to_all"]["inter"] > 0 and "reduce_scatter" not in led
    if gr == "bytegrad":
        assert led["bytegrad_inter_all_to_all"]["inter"] > 0 and "reduce_scatter" not in led
    if pg == "qwz":
        assert led["qwz_all_gather"]["inter"] > 0 and "all_gather" not in led
    if gr == "ring":
        assert led["ring_reduce_scatter"]["calls"] > 0 and "reduce_scatter" not in led


@pytest.mark.parametrize("grad", ["plain", "qgz4"])
def test_qwz_keeps_fp32_masters_exact(grad):
    """Identical gradients at every step: the masters of a qwZ run equal the plain-gather run's bit for bit
    (qwZ changes only what the model sees), while the model weights are the decoded ones."""
    res = world()
    for r, out in enumerate(res):
        exact, quant = out["masters"][f"{grad}+plain"], out["masters"][f"{grad}+qwz"]
        for step in range(3):
            assert torch.equal(quant["masters"][step], exact["masters"][step]), (r, step)
            assert not torch.equal(quant["weights"][step], exact["weights"][step]), "qwZ decoded nothing?"
            assert torch.equal(quant["weights"][step], res[0]["masters"][f"{grad}+qwz"]["weights"][step])


def _inter_node_hops_before_backward_ends():
    """Rank body: how many inter-node collectives each hierarchical backend has issued when backward returns
    (before finish_grad_sync), and the bucket count. The buffer pool holds every bucket, so no pool exhaustion
    forces an early completion: only Work.advance() can issue the hops."""
    import torch.distributed as dist

    W.capture_logs()
    x, y = _batch(dist.get_rank())
    out = {}
    for gr, name in (("qgz", "qgz_inter_all_to_all"), ("bytegrad", "bytegrad_inter_all_to_all")):
        model, opt = _wrap(_mlp(), gr, "plain", 4, "sgd", LR, bucket_size=100, pool=8)
        torch.nn.functional.mse_loss(model(x), y).backward()
        entry = model.ledger.entries().get(name)
        out[gr] = (entry.calls if entry is not None else 0, len(model.buckets))
        model.finish_grad_sync()
        opt.step()
    return out


def test_odo_advances_inter_node_hops_during_backward():
    """Every bucket launch advances the older in-flight reductions by one hop (Work.advance), so all but the last
    bucket's inter-node hop is issued while backward still runs, not after it."""
    for rank, rank_out in enumerate(run_distributed(_inter_node_hops_before_backward_ends, DP, timeout=120)):
        for gr, (calls, buckets) in rank_out.items():
            assert buckets >= 3, "the test needs several buckets"
            if gr == "bytegrad" and rank % RPN != 0:
                continue  # only node leaders take part in ByteGrad's inter-node hops
            # qgZ's first advance launches the inter-node hop of each of its 2 pipeline stages; ByteGrad's, the
            # leaders' all-to-all: every bucket but the last is advanced at least once before backward returns.
            per_bucket = 2 if gr == "qgz" else 1
            assert calls >= (buckets - 1) * per_bucket, f"{gr}: only {calls} inter-node hops issued in backward"
