"""qwZ, qgZ and ByteGrad against the plain backend: error bounds, bit-identical weights, averaging, ledger volumes.

Each configuration spawns one gloo world that runs every backend on the same inputs (see ``_worlds.py``); the
tests below read its results. Nodes are simulated by ``ranks_per_node``; shard lengths are deliberately awkward.
"""
from __future__ import annotations

import functools

import pytest
import torch

from unit_tests.comm import _worlds as W
from unit_tests.dist_harness import run_distributed
from megatron_ext.comm.bytegrad import bytegrad_bytes, bytegrad_row_bytes
from megatron_ext.comm.qgz import qgz_bytes, qgz_geometry
from megatron_ext.comm.topology import group_members_per_node
from megatron_ext.comm.qwz import qwz_group, qwz_row_bytes
from megatron_ext.comm.ring import ring_bytes

# name: (world, ranks_per_node, shard numel n, options, dtype)
CONFIGS = {
    "dp4_rpn2": (4, 2, 1001, dict(quant_group_size=64, qgz_pipeline_stages=3), "float32"),
    "dp4_rpn4_one_node": (4, 4, 777, dict(quant_group_size=50, qgz_pipeline_stages=2, bytegrad_chunk_size=100),
                          "float32"),
    "dp4_rpn1_bf16": (4, 1, 333, dict(quant_group_size=32, qgz_pipeline_stages=1), "bfloat16"),
    "dp8_rpn4": (8, 4, 257, dict(quant_group_size=40, qgz_pipeline_stages=2, bytegrad_chunk_size=300), "float32"),
    # 4 nodes of 2: N > 2 and D > 1 (the requantizing path with several inter-node peers); an odd group size whose
    # old geometry (group rounded up to even) gave fewer groups than the rows assumed.
    "dp8_rpn2_odd_group": (8, 2, 1155, dict(quant_group_size=33, qgz_pipeline_stages=2, bytegrad_chunk_size=500),
                           "float32"),
}
SEED = 7


@functools.lru_cache(maxsize=None)
def world(name: str):
    P, rpn, n, opts, dtype = CONFIGS[name]
    res = run_distributed(W.run_all_backends, P, rpn, n, SEED, opts, dtype, timeout=300)
    xs = [W.make_bucket(SEED, r, P * n, getattr(torch, dtype)).double() for r in range(P)]
    return res, xs


def _gathered(res, label):
    return torch.cat([r["grad"][label].double() for r in res])


def _bound(name, label, xs):
    P, rpn, n, opts, dtype = CONFIGS[name]
    nodes = P // rpn
    if label.startswith("qgz"):
        return W.qgz_bound(xs, nodes, rpn, n, int(label[3:]), opts.get("qgz_pipeline_stages", 2),
                           opts.get("quant_group_size", 2048))
    return W.bytegrad_bound(xs, nodes, rpn, opts.get("bytegrad_chunk_size", 0))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grad_reduce_within_analytic_bound_of_plain(name):
    res, xs = world(name)
    P, rpn, n, opts, dtype = CONFIGS[name]
    exact = sum(xs) / len(xs)
    plain = _gathered(res, "plain")
    bf16 = dtype == "bfloat16"
    scale = max(x.abs().max().item() for x in xs)
    # plain itself: fp32 sum (tiny error) or bf16 reduce-scatter (one bf16 rounding per partial sum)
    plain_err = (plain - exact).abs()
    assert plain_err.max() <= (P * 2 ** -8 * scale if bf16 else 1e-5 * scale)
    for label in ("qgz4", "qgz8", "bytegrad"):
        got = _gathered(res, label)
        assert torch.isfinite(got).all(), label
        bound = _bound(name, label, xs)
        slack = 2 ** -8 * (exact.abs() + bound) if bf16 else 1e-5 * scale
        err = (got - plain).abs()
        excess = err - (bound + plain_err + slack)
        assert excess.max() <= 0, (f"{label}: worst element {int(excess.argmax())} err {err.max():.3g} exceeds "
                                   f"bound {bound[int(excess.argmax())]:.3g}")
        assert err.max() > 0, f"{label} did not quantize anything?"
    # ring: the same sum in another order (fp32: rounding only; bf16: one bf16 rounding per partial sum, as plain)
    ring = _gathered(res, "ring")
    assert (ring - exact).abs().max() <= (P * 2 ** -8 * scale if bf16 else 1e-5 * scale)
    # sanity on the bounds themselves: INT8 is tighter than INT4, and actually observed errors follow
    assert (_gathered(res, "qgz8") - exact).abs().mean() < (_gathered(res, "qgz4") - exact).abs().mean()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bytegrad_all_reduce_identical_everywhere_and_within_two_round_bound(name):
    """The replica all-reduce runs Bagua's whole flow: every rank holds the same bucket, within two rounds' bound
    (the reduce-scatter, one round, is checked against the tighter one-round bound above)."""
    res, xs = world(name)
    P, rpn, n, opts, dtype = CONFIGS[name]
    got = [r["bytegrad_all_reduce"]["result"] for r in res]
    assert all(torch.equal(g.view(torch.uint8), got[0].view(torch.uint8)) for g in got[1:])
    # the reduce-scatter into the bucket's own shard gives the bits of the one into separate memory
    assert all(torch.equal(r["bytegrad_in_place"].view(torch.uint8), r["grad"]["bytegrad"].view(torch.uint8))
               for r in res)
    exact = sum(xs) / P
    bound = W.bytegrad_bound(xs, P // rpn, rpn, opts.get("bytegrad_chunk_size", 0), all_reduce=True)
    slack = 2 ** -8 * (exact.abs() + bound) if dtype == "bfloat16" else 1e-5 * max(x.abs().max() for x in xs)
    assert ((got[0].double() - exact).abs() - bound - slack).max() <= 0
    one_round = W.bytegrad_bound(xs, P // rpn, rpn, opts.get("bytegrad_chunk_size", 0))
    assert (bound > one_round).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_qwz_weights_bit_identical_and_within_bound(name):
    res, xs = world(name)
    P, rpn, n, opts, dtype = CONFIGS[name]
    bufs = [r["grad"]["qwz"] for r in res]
    for b in bufs[1:]:
        assert torch.equal(b.view(torch.uint8) if b.dtype == torch.bfloat16 else b,
                           bufs[0].view(torch.uint8) if b.dtype == torch.bfloat16 else bufs[0])
    ref = xs[0].clone()
    for r in range(P):   # shard r of the weights is rank r's slice of its own bucket
        ref[r * n:(r + 1) * n] = xs[r][r * n:(r + 1) * n]
    got = bufs[0].double()
    bound = W.qwz_bound(ref, P, n, opts["quant_group_size"])
    slack = 2 ** -8 * ref.abs() if dtype == "bfloat16" else 1e-6 * ref.abs()
    assert ((got - ref).abs() - bound - slack).max() <= 0
    assert not torch.equal(got, ref), "qwZ must overwrite the owner's slice with the decoded value too"
    assert torch.equal(res[0]["grad"]["plain_ag"].double(), ref)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_averaging_happens_exactly_once(name):
    res, _ = world(name)
    for r in res:
        for label, shard in r["const"].items():
            torch.testing.assert_close(shard, torch.full_like(shard, 0.75), rtol=1e-6, atol=1e-6, msg=label)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ledger_equals_closed_form(name):
    res, _ = world(name)
    P, rpn, n, opts, dtype = CONFIGS[name]
    N = P // rpn
    e = torch.finfo(getattr(torch, dtype)).bits // 8
    g = opts["quant_group_size"]
    S = opts.get("qgz_pipeline_stages", 2)
    for r, out in enumerate(res):
        led = out["ledger"]
        tot = {k: (v["total"]["intra"], v["total"]["inter"]) for k, v in led.items()}
        assert tot["plain"] == (n * e * (rpn - 1), n * e * (P - rpn))
        assert tot["plain_ag"] == (n * e * (rpn - 1), n * e * (P - rpn))
        # ring: (P-1)*n elements to the next rank, across nodes from the last rank of each node (NCCL's ring)
        assert tot["ring"] == ring_bytes(n, e, P, rpn, r)
        assert sum(ring_bytes(n, e, P, rpn, q)[1] for q in range(P)) == (P // rpn if rpn < P else 0) * (P - 1) * n * e
        assert led["ring"]["ring_reduce_scatter"]["calls"] == P - 1
        for bits in (4, 8):
            assert tot[f"qgz{bits}"] == qgz_bytes(n, N, rpn, bits, S, g)
        assert tot["bytegrad"] == bytegrad_bytes(n, N, rpn, e, opts.get("bytegrad_chunk_size", 0),
                                                 leader=(r % rpn == 0))
        ar = out["bytegrad_all_reduce"]["ledger"]
        assert (ar["total"]["intra"], ar["total"]["inter"]) == bytegrad_bytes(
            n, N, rpn, e, opts.get("bytegrad_chunk_size", 0), leader=(r % rpn == 0), all_reduce=True)
        groups = -(-n // g)
        gb = -(-n // groups)                               # balanced groups: padding < groups elements
        row = -(-groups * gb // 4) * 4 + 4 * groups        # INT8 codes of whole groups, padded to 4 bytes, + scales
        assert row == qwz_row_bytes(n, g)
        assert tot["qwz"] == (row * (rpn - 1), row * (P - rpn))


def test_cross_node_volumes_match_seed_closed_forms():
    """2 simulated nodes, M = bytes of the bf16 gradient (= bf16 weights) of the whole bucket, summed over ranks.

    qgZ INT4 sends exactly M/4 across nodes plus its fp32 scales and padding (INT8: M/2 plus ...); qwZ sends half
    of the plain all-gather's cross-node bytes plus scales and padding; ByteGrad's reduce-scatter sends (N-1)*M/2
    (its UINT8 all-to-all) plus (min, max) pairs, its all-reduce twice that (Bagua's all-gather too). The plain backend's pairwise reduce-scatter sends (P - D)*M = D*(N-1)*M (seed 000 counts a ring: M).
    """
    res, _ = world("dp4_rpn2")
    P, rpn, n, opts, _ = CONFIGS["dp4_rpn2"]
    N, g, S = P // rpn, opts["quant_group_size"], opts["qgz_pipeline_stages"]
    M = P * n * 2

    def inter(label):
        return sum(r["ledger"][label]["total"]["inter"] for r in res)

    S_, sub, G, gg, sub_pad = qgz_geometry(n, S, g)
    for bits, frac in ((4, 4), (8, 2)):
        scales = (N - 1) * P * S_ * G * 4
        pad = (N - 1) * P * S_ * (-(-sub_pad * bits // 8 // 4) * 4) - (N - 1) * M // frac
        assert inter(f"qgz{bits}") == (N - 1) * M // frac + scales + pad
        assert pad <= (N - 1) * P * S_ * (2 * gg * bits // 8 + 4)            # at most ~one group per sub-slice
    plain_rs = inter("plain") // 2                                          # fp32 run -> bf16 bytes
    assert plain_rs == (P - rpn) * M
    groups = -(-n // g)
    qwz_scales = (N - 1) * P * rpn * groups * 4
    qwz_pad = (N - 1) * P * rpn * (-(-groups * qwz_group(n, g) // 4) * 4 - n)
    assert qwz_pad <= (N - 1) * P * rpn * (groups + 3)
    assert inter("qwz") == (inter("plain_ag") // 2) // 2 + qwz_scales + qwz_pad
    L = P * n // N
    row = bytegrad_row_bytes(L, 0)
    pad = -(-L // 4) * 4 - L
    assert inter("bytegrad") == N * (N - 1) * row == (N - 1) * M // 2 + N * (N - 1) * (8 + pad)
    ar_inter = sum(r["bytegrad_all_reduce"]["ledger"]["total"]["inter"] for r in res)
    assert ar_inter == 2 * N * (N - 1) * row == (N - 1) * M + 2 * N * (N - 1) * (8 + pad)


def test_bad_ranks_per_node_is_a_clear_error():
    res, _ = world("dp4_rpn2")
    msg = res[0]["bad_rpn_error"]
    assert msg is not None and "ranks_per_node" in msg and "does not divide" in msg


def test_qgz_pipelines_intra_and_inter_node_hops():
    """All intra-node hops start before wait(); stage s's inter-node hop is in flight before stage s+1's intra-node
    hop is waited for (seed 000 4.1.2), so both link classes carry data at once."""
    res, _ = world("dp4_rpn2")
    ev = res[0]["qgz_events"]
    S = CONFIGS["dp4_rpn2"][3]["qgz_pipeline_stages"]
    assert ev[:S + 1] == [f"launch intra{s}" for s in range(S)] + ["constructed"]
    for s in range(S - 1):
        assert ev.index(f"launch inter{s}") < ev.index(f"wait intra{s + 1}")
        assert ev.index(f"wait inter{s}") > ev.index(f"launch inter{s + 1}")
    assert sum(e.startswith("launch inter") for e in ev) == S


@pytest.mark.parametrize("name", ["dp4_rpn2", "dp8_rpn4"])
def test_tiny_and_empty_buckets(name):
    res, _ = world(name)
    P = CONFIGS[name][0]
    for tiny in (0, 1, 3):
        xs = [W.make_bucket(SEED + 1, r, P * tiny).double() for r in range(P)]
        exact = sum(xs) / P
        scale = max([x.abs().max().item() for x in xs if x.numel()] + [0.0])
        for label in ("plain", "qgz4", "qgz8", "bytegrad", "ring"):
            got = torch.cat([r["tiny"][(label, tiny)].double() for r in res])
            assert got.shape == exact.shape
            assert torch.isfinite(got).all()
            assert ((got - exact).abs() <= 0.5 * scale + 1e-6).all(), (label, tiny)
        q = [r["tiny"][("qwz", tiny)] for r in res]
        assert all(torch.equal(b, q[0]) for b in q)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_advance_in_fifo_order_is_bit_identical_and_launches_the_next_hop(name):
    """In-flight buckets advanced oldest-first at each new launch (the ODO's schedule) give exactly the results of
    waiting for each at once, and each advance() puts the next hop on the wire: qgZ's inter-node all-to-alls and
    ByteGrad's leader all-to-all / all-gather are launched before the caller waits (ledger calls are recorded at
    launch)."""
    res, _ = world(name)
    P, rpn, n, opts, dtype = CONFIGS[name]
    N = P // rpn
    S = qgz_geometry(n, opts.get("qgz_pipeline_stages", 2), opts.get("quant_group_size", 2048))[0]
    for r, out in enumerate(res):
        for label, case in out["advance"].items():
            for k, (ref, got) in enumerate(zip(case["ref"], case["fifo"])):
                assert torch.equal(ref, got), f"rank {r} {label} bucket {k}: advance() changed the result"
            for k, calls in enumerate(case["calls"]):   # after launching bucket k and advancing buckets < k
                if label.startswith("qgz"):
                    intra = S * (k + 1) if rpn > 1 else 0
                    inter = 0 if N == 1 else S * (k + 1) if rpn == 1 else S * k
                    assert calls.get("qgz_intra_all_to_all", 0) == intra, (r, label, k, calls)
                    assert calls.get("qgz_inter_all_to_all", 0) == inter, (r, label, k, calls)
                elif label == "bytegrad":   # bucket j < k advanced k - j times: all-to-all at 1, scatter at 2
                    leader = N == 1 or r % rpn == 0
                    assert calls.get("bytegrad_inter_all_to_all", 0) == (k if leader else 0), (r, k, calls)
                    scatters = max(0, k - 1) if N > 1 and rpn > 1 else 0
                    assert calls.get("bytegrad_intra_scatter", 0) == scatters, (r, k, calls)
                    assert "bytegrad_inter_all_gather" not in calls and "bytegrad_intra_broadcast" not in calls
                elif label == "ring":       # bucket j < k advanced k - j times, one hop each, P - 1 hops at most
                    hops = sum(min(P - 1, 1 + k - j) for j in range(k + 1))
                    assert calls.get("ring_reduce_scatter", 0) == hops, (r, k, calls)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_hop_fallback_announced_once_per_job(name):
    res, _ = world(name)
    P, rpn, *_ = CONFIGS[name]
    for backend in ("qgz", "bytegrad"):
        said = [sum(m.startswith(f"{backend} on a single node") for m in out["logs"]) for out in res]
        assert said == ([1] + [0] * (P - 1) if rpn == P else [0] * P), (backend, said)


@pytest.mark.parametrize("name", ["dp4_rpn2", "dp8_rpn2_odd_group"])
def test_ranks_per_node_semantics(name):
    """Larger than the DP group: a clear error naming the flag (no silent clamp to one node). Unset: derived from
    LOCAL_WORLD_SIZE; an irregular layout becomes one node and DP rank 0 says so, once."""
    res, _ = world(name)
    P = CONFIGS[name][0]
    msg = res[0]["topology"]["too_large"]
    assert msg is not None and "--ranks-per-node" in msg and "larger than the data-parallel group" in msg
    for out in res:
        assert out["topology"]["lws2"] == P // 2
        assert out["topology"]["lws3"] == 1
    said = [sum("treating the data-parallel group as one node" in m for m in out["logs"]) for out in res]
    assert said == [1] + [0] * (P - 1)


def test_dp_ranks_per_node_from_physical_layout():
    assert group_members_per_node(range(8), 4) == 4                    # DP over the whole world
    assert group_members_per_node([0, 2, 4, 6], 4) == 2                 # TP=2 x DP=4, nodes of 4 processes
    assert group_members_per_node([0, 2, 4, 6], 8) == 4                 # ... nodes of 8: the group on one node
    assert group_members_per_node([8, 10, 12, 14], 12) == 2             # PP stage 1 straddling two nodes of 12
    assert group_members_per_node([1, 5, 9, 13], 2) == 1                # TP=4: one member per node
    with pytest.raises(ValueError, match="uneven"):
        group_members_per_node(range(6), 4)
    with pytest.raises(ValueError, match="interleave"):
        group_members_per_node([0, 4, 1, 5], 4)


@pytest.mark.parametrize("group_size", [1, 2, 7, 33, 99, 100, 255, 256, 2048])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_qgz_geometry_agrees_with_kernel_layout_for_any_group_size(group_size, stages):
    """Odd --quant-group-size used to round the group up to even, leaving fewer groups than the rows assumed
    (n=9998 with 99, n=65534 with 255). Now: even group <= the flag (at least 2), whole groups covering the
    sub-slice, and the kernels' chunk equals the backend's padded sub-slice."""
    from megatron_ext.kernels.layout import swizzle_layout

    for n in (1, 2, 3, 97, 1153, 1155, 4999, 9998, 65534):
        S, sub, G, g, sub_pad = qgz_geometry(n, stages, group_size)
        assert g % 2 == 0 and g <= max(2, group_size), (n, g)
        assert -(-sub // g) == G and sub <= sub_pad == G * g < sub + g, (n, sub, G, g)
        lay = swizzle_layout(8 * n, 4, g, 4, 2, S)
        assert lay.stage_numel == sub and lay.chunk_numel == sub_pad, (n, lay)


def test_bytegrad_large_buffers_go_row_by_row_with_the_same_bits(monkeypatch):
    """Row buffers past the one-call size (the Triton kernels' int32 offsets; lowered here) are quantized and decoded
    one row a call: the same wire bytes and the same averaged block, fp32 and bf16, returned or written into ``out``,
    on the torch and compiled paths."""
    from megatron_ext.comm import bytegrad
    from megatron_ext.kernels import use_backend

    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 96, generator=g) * 3
    for backend in ("torch", "compiled"):
        with use_backend(backend):
            rows = bytegrad._compress_rows(x, 32)
            want = {dt: bytegrad._decode_average(rows, 96, 32, 6, dt) for dt in (torch.float32, torch.bfloat16)}
            monkeypatch.setattr(bytegrad, "_ONE_CALL_BYTES", 64)
            assert torch.equal(bytegrad._compress_rows(x, 32), rows)
            for dt, w in want.items():
                got = bytegrad._decode_average(rows, 96, 32, 6, dt)
                assert torch.equal(got.view(torch.uint8), w.view(torch.uint8)), (backend, dt)
                out = torch.empty(96, dtype=dt)   # into a given shard, as the reduce-scatter at D == 1 decodes
                assert bytegrad._decode_average(rows, 96, 32, 6, dt, out=out) is out
                assert torch.equal(out.view(torch.uint8), w.view(torch.uint8)), (backend, dt)
            monkeypatch.undo()


def test_bytegrad_rows_compressed_at_once_equal_row_by_row():
    """ByteGrad's leader compresses all nodes' chunks in one call when the (min, max) chunk divides the row: the same
    codes, the same mins and maxs as values (a min of 0 may keep either sign) and bit-identical decoded values as one
    call per row (no chunk straddles two rows), on the torch and compiled paths. The all-reduce's decode of the
    gathered rows straight into the bucket (one-row decode-and-average calls, factor 1) gives the plain decode's bits.
    A decoded value is never -0.0 (the reason is in ``average``), so the node sum may start from node 0's version
    instead of zeros."""
    from megatron_ext.comm.bytegrad import _compress_rows, _decode_rows
    from megatron_ext.kernels import dequantize_minmax_uint8, use_backend

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 96, generator=g) * 4
    x[1, :32] = 0.0
    x[2, 40:72] = -0.0
    x[0, 10] = -0.0
    for backend in ("torch", "compiled"):
        with use_backend(backend):
            for c in (32, 96, 48):
                rows = _compress_rows(x, c)
                k = 96 // c
                bucket = torch.full((3 * 96 + 1,), 7.0)
                _decode_rows(rows, 96, c, bucket[:-1])
                assert bucket[-1].item() == 7.0
                for i in range(3):
                    alone = _compress_rows(x[i:i + 1].clone(), c)[0]
                    assert torch.equal(rows[i, :96], alone[:96])     # the codes
                    assert torch.equal(rows[i, 96:].view(torch.float32), alone[96:].view(torch.float32))
                    mm = alone[96:].view(torch.float32)
                    d = bucket[i * 96:(i + 1) * 96]
                    want = dequantize_minmax_uint8(alone[:96], mm[:k], mm[k:], c, 96)
                    assert torch.equal(d.view(torch.int32), want.view(torch.int32))
                    assert not torch.any(torch.signbit(d) & (d == 0))
                    assert rows.shape[1] == 96 + 8 * k
            # a chunk that does not divide the row: row by row, each row as its own call
            rows = _compress_rows(x, 40)
            assert all(torch.equal(rows[i], _compress_rows(x[i:i + 1].clone(), 40)[0]) for i in range(3))
