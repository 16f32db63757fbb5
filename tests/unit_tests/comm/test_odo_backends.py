"""The quantized backends inside the OverlappedDistributedOptimizer: a few training steps at DP=4 on 2 simulated
nodes, every combination of grad_reduce x param_gather in one world."""
from __future__ import annotations

import logging

import torch

from unit_tests.dist_harness import run_distributed

COMBOS = [("plain", "plain"), ("qgz", "qwz"), ("bytegrad", "qwz"), ("qgz", "plain")]


def _train(ranks_per_node: int, steps: int):
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx

    logging.getLogger("megatron_ext").setLevel(logging.ERROR)
    rank = dist.get_rank()
    out = {}
    for gr, pg in COMBOS:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))
        cfg = mx.OverlapConfig(bucket_size=300, grad_reduce=gr, param_gather=pg, ranks_per_node=ranks_per_node,
                               quant_group_size=32, qgz_bits=8)
        model = mx.OverlappedDDP(module, cfg)
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), model)
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(16, 13, generator=g)
        y = torch.randn(16, 5, generator=g)
        losses = []
        model.ledger.reset()
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.scale_loss(loss).backward()
            model.finish_grad_sync()
            ok, _, _ = opt.step()
            assert ok
            opt.zero_grad()
            losses.append(loss.item())
        model.force_param_sync()
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        out[f"{gr}+{pg}"] = {"params": flat, "losses": losses, "ledger": model.ledger.summary()}
    return out


def test_odo_with_quantized_backends_trains_and_keeps_weights_identical():
    res = run_distributed(_train, 4, 2, 6, timeout=300)
    plain = res[0]["plain+plain"]["params"]
    for combo in res[0]:
        params = [r[combo]["params"] for r in res]
        for p in params[1:]:
            assert torch.equal(p, params[0]), f"{combo}: ranks hold different weights"
        losses = [sum(r[combo]["losses"][i] for r in res) for i in range(6)]
        assert losses[-1] < losses[0], f"{combo} did not train: {losses}"
        # quantized runs stay close to the plain run's weights after a few Adam steps
        assert (params[0] - plain).abs().max() < 5e-2, combo
        led = res[0][combo]["ledger"]
        gr, pg = combo.split("+")
        if gr == "qgz":
            assert led["qgz_inter_all_to_all"]["inter"] > 0 and "reduce_scatter" not in led
        if pg == "qwz":
            assert led["qwz_all_gather"]["inter"] > 0 and "all_gather" not in led
