"""Single-process simulation of the qgZ 2-hop flow (seed 000 3.3) on W = N*D simulated ranks.

Proves that the swizzle layout, split as documented in ``megatron_ext.kernels.layout`` ([Note: qgZ swizzle layout]),
leaves partition r of the sum on rank r after an intra-node all-to-all, a dequantize-reduce-quantize, an inter-node
all-to-all and a dequantize-reduce, for every pipeline stage.
"""
import pytest
import torch

from megatron_ext.kernels import (dequantize_reduce, dequantize_reduce_quantize, swizzle_layout, swizzle_quantize,
                                  use_backend)


def simulate_qgz(xs, nodes, rpn, stages, bits, group_size):
    """Each rank's reduce-scatter output (fp32, ``partition_numel`` elements), with all-to-alls as list shuffles."""
    N, D, W = nodes, rpn, nodes * rpn
    lay = swizzle_layout(xs[0].numel(), bits, group_size, N, D, stages)
    sent = [swizzle_quantize(x, bits, group_size, N, D, stages) for x in xs]
    out = [torch.zeros(lay.partition_numel) for _ in range(W)]
    for s in range(stages):
        # hop 1, intra-node: rank (a, b') sends row b of codes[s].view(D, N*chunk_bytes) to local peer (a, b)
        node_sum = []
        for r in range(W):
            a, b = divmod(r, D)
            codes = torch.stack([sent[a * D + bb][0][s].reshape(D, -1)[b] for bb in range(D)])
            scales = torch.stack([sent[a * D + bb][1][s].reshape(D, -1)[b] for bb in range(D)])
            c, sc = dequantize_reduce_quantize(codes, scales, bits, group_size)
            node_sum.append((c.view(N, lay.chunk_bytes), sc.view(N, lay.chunk_groups)))
        # hop 2, inter-node among the ranks with local index b: row a of the node sum goes to node a
        for r in range(W):
            a, b = divmod(r, D)
            codes = torch.stack([node_sum[aa * D + b][0][a] for aa in range(N)])
            scales = torch.stack([node_sum[aa * D + b][1][a] for aa in range(N)])
            total = dequantize_reduce(codes, scales, bits=bits, group_size=group_size, numel=lay.chunk_numel)
            v = lay.stage_valid_numel(s)
            out[r][s * lay.stage_numel:s * lay.stage_numel + v] = total[:v]
    return out, lay


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("nodes,rpn", [(2, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("bits", [8, 4])
def test_two_hop_flow_places_every_partition(nodes, rpn, stages, bits):
    W = nodes * rpn
    g = 16
    numel = W * 45 - 3  # partitions of 45 (not a multiple of the group, nor of 2 stages), last one padded
    torch.manual_seed(W * 10 + stages)
    # partition p of the sum is centred on 100*p, so a misplaced partition is off by about 100
    offsets = (torch.arange(numel) // 45).float() * 100
    xs = [offsets / W + torch.randn(numel) for _ in range(W)]
    with use_backend("torch"):
        out, lay = simulate_qgz(xs, nodes, rpn, stages, bits, g)
    assert lay.partition_numel == 45
    exact = torch.stack(xs).double().sum(0)
    exact = torch.cat([exact, torch.zeros(W * 45 - numel, dtype=exact.dtype)])
    qm = 2 ** (bits - 1) - 1
    amax = torch.stack(xs).abs().max().item()
    # error: W first-hop roundings (<= amax/qm/2 each) + N requantizations of node sums (<= D*amax*(1+..)/qm/2 each)
    bound = (W * amax / qm / 2 + nodes * rpn * amax * 1.5 / qm / 2) * 1.01
    parts = exact.view(W, 45)
    for r in range(W):
        errs = (out[r].double().unsqueeze(0) - parts).abs().amax(dim=1)
        assert errs[r].item() <= bound, (r, errs[r].item(), bound)
        assert int(errs.argmin()) == r  # rank r holds partition r, not a neighbour's
