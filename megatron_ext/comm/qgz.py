"""The ``qgz`` gradient reduce-scatter: hierarchical 2-hop quantized all-to-all (ZeRO++ qgZ, seed 000 section 3.3).

[Note: qgZ data flow]
Let the DP group hold ``N`` nodes of ``D`` ranks (rank ``p = a*D + b``: node ``a``, local index ``b``), the bucket
``P*n`` elements (shard ``p`` is ``bucket[p*n:(p+1)*n]``) and ``S`` pipeline stages. Each shard is cut into ``S``
sub-slices of ``sub = ceil(n/S)`` elements; stage ``s`` carries sub-slice ``s`` of every shard (Algorithm 2's
generalised reordering). Per stage:

1. *swizzle + quantize*: the ``P`` sub-slices are reordered so that slot ``b*N + a`` holds partition ``a*D + b``
   (``x.view(N, D, -1).transpose(0, 1)``, eq. 1-2: 2 nodes x 4 ranks -> ``[0,4,1,5,2,6,3,7]``), each padded to
   ``sub_pad`` and quantized to ``bits`` with one fp32 scale per group;
2. *intra-node all-to-all* (``intra_group``): local peer ``b`` receives the ``N`` sub-slices destined to the ranks
   with local index ``b`` on every node;
3. *dequantize-reduce-requantize*: sum of the ``D`` received chunks in fp32 (the node's partial sum), requantized;
4. *inter-node all-to-all* (``inter_group``, same local index on every node): node ``a`` receives sub-slice ``a``;
5. *dequantize-reduce*: sum of the ``N`` node partial sums in fp32, times ``1/P`` in the same pass -- the only averaging
   step -- written straight into ``out_shard``.

Stages are pipelined: the intra-node all-to-alls of all stages are launched at once (they overlap the caller's
backward); the first ``advance()`` (or ``wait()``) then completes them in stage order, launching stage ``s``'s
inter-node all-to-all while stage ``s+1``'s intra-node exchange completes and is requantized, so both link classes
are busy at the same time (seed 000, 4.1.2); the second ``advance()`` finishes the inter-node hops. The ODO
advances in-flight buckets whenever it launches a new one, so the inter-node hop overlaps backward too.

Awkward sizes are padded, never sent to a fallback: with ``g_max`` = ``quant_group_size`` rounded down to an even
number (at least 2: INT4 codes pack two per byte), ``sub`` is split into ``G = ceil(sub/g_max)`` balanced groups of
``g = round_up(ceil(sub/G), 2) <= g_max`` elements and ``sub_pad = G*g``; then ``ceil(sub/g) == G`` holds for every
size (``g*(G-1) <= g_max*(G-1) < sub``), so the kernels' layout and the rows agree. Each all-to-all chunk is one
byte row ``[codes | pad to 4 | fp32 scales]``: ``row_intra = round_up(N*sub_pad*bits/8, 4) + 4*N*G`` sent to
each of the ``D-1`` local peers and ``row_inter = round_up(sub_pad*bits/8, 4) + 4*G`` sent to each of the ``N-1``
remote peers, per stage. So per
bucket a rank sends ``S*(D-1)*row_intra`` intra-node and ``S*(N-1)*row_inter`` inter-node bytes; summed over the
``P`` ranks the cross-node volume is ``(N-1)*P*S*row_inter ~= (N-1) * P*n*bits/8`` (M/4 for INT4 and M/2 for INT8
with M the bf16 bucket bytes and N = 2), plus scales and padding.

One node (``N == 1``): the inter-node hop vanishes and the intra-node all-to-all is followed directly by the
final dequantize-reduce (one-hop form, logged once per job). One rank per node (``D == 1``): the intra-node hop
vanishes and the inter-node hop is launched at once.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .backend import BackendOptions, GradReduce, Work, register_grad_reduce
from .ledger import CommLedger
from .topology import Topology
from .wire import empty_rows, round_up, row_bytes, unpack_rows


def qgz_geometry(n: int, stages: int, group_size: int) -> Tuple[int, int, int, int, int]:
    """``(stages, sub, groups_per_sub, group, sub_pad)`` for an ``n``-element shard (see the module note).

    The group is even and at most ``group_size`` (rounded down to even, at least 2), and ``ceil(sub/group)`` equals
    ``groups_per_sub`` for every ``n`` -- also for odd ``--quant-group-size``.
    """
    if group_size < 1:
        raise ValueError(f"quant_group_size (--quant-group-size) must be >= 1, got {group_size}")
    stages = max(1, min(stages, n))
    sub = -(-n // stages)
    g_max = max(2, group_size - group_size % 2)
    groups = max(1, -(-sub // g_max))
    g = round_up(-(-sub // groups), 2)
    return stages, sub, groups, g, groups * g


def qgz_bytes(n: int, nodes: int, ranks_per_node: int, bits: int, stages: int, group_size: int) -> Tuple[int, int]:
    """Closed form: (intra, inter) bytes one rank sends for one bucket of ``nodes*ranks_per_node*n`` elements."""
    S, _, G, _, sub_pad = qgz_geometry(n, stages, group_size)
    N, D = nodes, ranks_per_node
    intra = S * (D - 1) * row_bytes(N * sub_pad * bits // 8, N * G) if D > 1 else 0
    inter = S * (N - 1) * row_bytes(sub_pad * bits // 8, G) if N > 1 else 0
    return intra, inter


@register_grad_reduce("qgz")
class QgzGradReduce(GradReduce):
    """Hierarchical quantized reduce-scatter; see the module note."""

    @property
    def shard_alignment(self) -> int:
        # Equal, even sub-slices per stage; the rest of the padding is done (and counted) by the backend itself.
        return 2 * self.options.qgz_pipeline_stages

    def __init__(self, topology: Topology, ledger: CommLedger, options: BackendOptions) -> None:
        super().__init__(topology, ledger, options)
        topo = self.topology
        if topo.num_nodes == 1 and topo.size > 1:
            self._warn_once(f"qgz on a single node ({topo.size} ranks): using the one-hop intra-node all-to-all form")

    def reduce_scatter(self, bucket: torch.Tensor, out_shard: torch.Tensor) -> Work:
        return self._local_reduce_scatter(bucket, out_shard) or _QgzWork(self, bucket, out_shard)

    def _gather_piece(self, piece: torch.Tensor, out: torch.Tensor) -> Work:
        """The averaged pieces travel block-quantized with qgZ's bit width, decoded alike on every rank."""
        from .qwz import quantized_all_gather
        return quantized_all_gather(self.topology, self.ledger, piece, out, self.options.qgz_bits,
                                    self.options.quant_group_size, "qgz_all_gather")


class _QgzWork(Work):
    """Drives the stages of one bucket through three phases (see the module note).

    ``_INTRA``: the first hop of every stage is in flight (launched at construction). ``advance()`` -> ``_INTER``:
    the intra-node hops are completed in stage order, each followed by its requantization and the launch of that
    stage's inter-node hop. ``advance()`` -> ``_DONE``: the inter-node hops are completed and reduced into
    ``out_shard``. On one node the second phase writes the result; with one rank per node construction launches
    the inter-node hops directly.
    """

    _INTRA, _INTER, _DONE = range(3)

    def __init__(self, backend: QgzGradReduce, bucket: torch.Tensor, out_shard: torch.Tensor) -> None:
        from megatron_ext.kernels import swizzle_quantize
        from megatron_ext.kernels.layout import codes_dtype, swizzle_layout

        topo = backend.topology
        opts = backend.options
        self.topo, self.ledger, self.out = topo, backend.ledger, out_shard
        self.bits = bits = opts.qgz_bits
        N, D, P = topo.num_nodes, topo.ranks_per_node, topo.size
        n = out_shard.numel()
        S, sub, G, g, sub_pad = qgz_geometry(n, opts.qgz_pipeline_stages, opts.quant_group_size)
        self.N, self.D, self.P, self.n = N, D, P, n
        self.S, self.sub, self.G, self.g, self.sub_pad = S, sub, G, g, sub_pad

        # 1. swizzle + quantize: slot b*N + a of stage s = sub-slice s of partition a*D + b, padded to sub_pad
        # elements, written straight into the rows of the first hop (row b' of stage s: slots b'N .. b'N + N-1 for
        # local peer b'; with one rank per node row a': slot a' for node a').
        lay = swizzle_layout(bucket.numel(), bits, g, N, D, S)
        if lay.chunk_bytes != sub_pad * bits // 8 or lay.chunk_groups != G:
            raise RuntimeError(f"qgz: kernel layout ({lay.chunk_bytes} bytes, {lay.chunk_groups} groups a chunk) "
                               f"disagrees with the geometry (sub_pad={sub_pad}, groups={G}) for shard {n}, stages "
                               f"{S}, group {g}")
        self.code_dtype = codes_dtype(bits)
        R = D if D > 1 else N   # rows per stage
        W = N * D
        send_all, codes, scales = empty_rows(S * R, W // R * lay.chunk_bytes, W // R * G, self.code_dtype,
                                             bucket.device)
        swizzle_quantize(bucket.contiguous(), bits, g, N, D, S, out=(codes, scales))

        self._intra: List[Optional[Tuple[object, torch.Tensor]]] = [None] * S
        self._inter: List[Tuple[int, object, torch.Tensor]] = []
        for s in range(S):
            send = send_all[s * R:(s + 1) * R]
            if D > 1:   # 2. intra-node all-to-all: row b' (N sub-slices) to local peer b'
                recv = torch.empty_like(send)
                self.ledger.record("qgz_intra_all_to_all", intra=(D - 1) * send.shape[1])
                h = dist.all_to_all_single(recv.view(-1), send.view(-1), group=topo.intra_group, async_op=True)
                self._intra[s] = (h, recv)
            else:       # one rank per node: the inter-node hop is the first hop
                self._launch_inter(s, send)
        self._phase = self._INTRA if D > 1 else self._INTER

    def _launch_inter(self, s: int, send: torch.Tensor) -> None:
        # 4. inter-node all-to-all (same local index on every node): sub-slice a' to node a'
        recv = torch.empty_like(send)
        self.ledger.record("qgz_inter_all_to_all", inter=(self.N - 1) * send.shape[1])
        h = dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.topo.inter_group, async_op=True)
        self._inter.append((s, h, recv))

    def _finish_stage(self, s: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """5. dequantize + reduce the stage's contributions straight into the shard, with the one and only
        averaging (the fp32 sum times 1/P, in the shard's dtype) in the same pass."""
        from megatron_ext.kernels import dequantize_reduce

        lo = s * self.sub
        hi = min(lo + self.sub, self.n)
        if hi > lo:
            dequantize_reduce(codes, scales, bits=self.bits, group_size=self.g, numel=hi - lo, factor=1.0 / self.P,
                              dtype=self.out.dtype, out=self.out[lo:hi])

    def _complete_intra(self) -> None:
        from megatron_ext.kernels import dequantize_reduce_quantize

        N, D, g, sub_pad, bits = self.N, self.D, self.g, self.sub_pad, self.bits
        for s in range(self.S):
            h, recv = self._intra[s]
            self._intra[s] = None
            h.wait()
            c, sc = unpack_rows(recv, D, N * sub_pad * bits // 8, self.code_dtype)
            if N == 1:   # one-hop form: the intra-node exchange already gathered every contribution
                self._finish_stage(s, c, sc)
                continue
            # 3. dequantize + reduce over the D local contributions + requantize (the node's partial sums), written
            # straight into the inter-node hop's rows (row a' for node a')
            send, c2, sc2 = empty_rows(N, sub_pad * bits // 8, self.G, self.code_dtype, recv.device)
            dequantize_reduce_quantize(c, sc, bits, g, out=(c2, sc2))
            self._launch_inter(s, send)

    def _complete_inter(self) -> None:
        inter, self._inter = self._inter, []
        for s, h, recv in inter:
            h.wait()
            # over the N node partial sums
            self._finish_stage(s, *unpack_rows(recv, self.N, self.sub_pad * self.bits // 8, self.code_dtype))

    def advance(self) -> None:
        if self._phase == self._INTRA:
            self._complete_intra()
            self._phase = self._DONE if self.N == 1 else self._INTER
        elif self._phase == self._INTER:
            self._complete_inter()
            self._phase = self._DONE

    def wait(self) -> None:
        while self._phase != self._DONE:
            self.advance()

    @property
    def done(self) -> bool:
        return self._phase == self._DONE
