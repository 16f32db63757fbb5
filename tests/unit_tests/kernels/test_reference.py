"""Torch reference quantizers: hand-written expected codes, round-trip error bounds, layouts, input checks."""
import pytest
import torch

from megatron_ext.kernels import (dequantize_minmax_uint8, dequantize_reduce, dequantize_reduce_quantize,
                                  dequantize_symmetric, quantize_minmax_uint8, quantize_symmetric, reference,
                                  swizzle_layout, swizzle_permutation, swizzle_quantize, use_backend)
from megatron_ext.kernels.layout import check_int32_offsets

from . import contract_cases

U = 2.0 ** -24  # fp32 unit roundoff
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _torch_backend():
    with use_backend("torch"):
        yield


def test_int8_codes_hand_written():
    # absmax 127 -> scale exactly 1; round half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0
    x = torch.tensor([127.0, -127.0, 0.5, 1.5, 2.5, -0.5, -3.5, 100.0])
    codes, scales = quantize_symmetric(x, bits=8, group_size=8)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert codes.tolist() == [127, -127, 0, 2, 2, 0, -4, 100]
    assert scales.tolist() == [1.0]


def test_int4_packing_order_hand_written():
    # absmax 7 -> scale 1; even element in the high nibble, signed nibbles: 7 -> 0x7, -7 -> 0x9, -1 -> 0xF
    x = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.0, 3.0, -2.0, 5.0])
    codes, scales = quantize_symmetric(x, bits=4, group_size=8)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [0x79, 0x1F, 0x03, 0xE5]
    assert scales.tolist() == [1.0]
    back = dequantize_symmetric(codes, scales, bits=4, group_size=8, numel=8)
    assert back.tolist() == x.tolist()


def test_partial_group_is_zero_padded():
    x = torch.tensor([7.0, -7.0, 2.0, 14.0, 0.0])  # groups of 4: [7,-7,2,14] and [0, pad, pad, pad]
    codes, scales = quantize_symmetric(x, bits=4, group_size=4)
    assert codes.numel() == 4 and scales.tolist() == [2.0, 0.0]
    # 7/2 = 3.5 -> 4 and -3.5 -> -4 = 0xC (half to even), 2/2 -> 1, 14/2 -> 7; the padded group is all zero
    assert codes.tolist() == [0x4C, 0x17, 0x00, 0x00]

def test_swizzle_permutation_hand_written():
    assert swizzle_permutation(2, 4) == [0, 4, 1, 5, 2, 6, 3, 7]  # DeepSpeed, 2 nodes x 4 ranks
    assert swizzle_permutation(2, 2) == [0, 2, 1, 3]  # seed 000 Fig. 9: swap slices 1 and 2
    assert swizzle_permutation(4, 2) == [0, 2, 4, 6, 1, 3, 5, 7]
    # two stages, 2 x 2: slices i = p*S + s; stage 0 holds the first halves in slot order, then stage 1
    assert swizzle_permutation(2, 2, 2) == [0, 4, 2, 6, 1, 5, 3, 7]


@pytest.mark.parametrize("nodes,rpn", [(2, 4), (4, 2), (3, 2), (1, 4), (4, 1)])
def test_swizzle_matches_deepspeed_view_transpose(nodes, rpn):
    w = nodes * rpn
    x = torch.randn(w * 64)
    perm = swizzle_permutation(nodes, rpn)
    expect = x.view(nodes, rpn, -1).transpose(0, 1).reshape(w, -1)
    assert torch.equal(x.view(w, -1)[perm], expect)
    codes, scales = swizzle_quantize(x, 8, 32, nodes, rpn, 1)
    ref_codes, ref_scales = quantize_symmetric(expect.contiguous(), bits=8, group_size=32)
    assert torch.equal(codes.view(-1), ref_codes) and torch.equal(scales.view(-1), ref_scales)


def test_swizzle_quantize_hand_written_stages():
    # 2 nodes x 2 ranks, 2 stages, 16 elements: partition p = [4p, 4p+4), stage s = its half [4p+2s, 4p+2s+2).
    x = torch.arange(16, dtype=torch.float32)
    codes, scales = swizzle_quantize(x, 8, 2, 2, 2, 2)
    lay = swizzle_layout(16, 8, 2, 2, 2, 2)
    assert tuple(codes.shape) == lay.codes_shape == (2, 4, 2) and tuple(scales.shape) == (2, 4, 1)
    # absmax of each stage chunk reveals which slice sits in which slot
    expect_absmax = [[1, 9, 5, 13], [3, 11, 7, 15]]
    assert torch.allclose(scales.view(2, 4) * 127, torch.tensor(expect_absmax, dtype=torch.float32))
    # padded: 13 elements -> n = 4; partition 3 = [12] + 3 zeros; stage 1 of partition 3 is all padding
    codes, scales = swizzle_quantize(x[:13], 8, 2, 2, 2, 2)
    assert scales[1, 3].item() == 0.0 and codes[1, 3].tolist() == [0, 0]
    assert codes[0, 3].tolist() == [127, 0]


def test_swizzle_layout_padding():
    lay = swizzle_layout(1000, 4, 8, 2, 3, 2)  # W = 6: n = 167, m = 84, chunk = 88
    assert (lay.partition_numel, lay.stage_numel, lay.chunk_numel) == (167, 84, 88)
    assert lay.chunk_bytes == 44 and lay.chunk_groups == 11
    assert [lay.stage_valid_numel(s) for s in range(2)] == [84, 83]


def _group_scales(scales, numel, g):
    return scales.repeat_interleave(g)[:numel].double()


def _signed_codes(codes, bits):
    """int8 codes, INT4 bytes unpacked by hand (high nibble first, sign-extended)."""
    if bits == 8:
        return codes
    return torch.stack([codes.view(torch.int8) >> 4, (codes << 4).view(torch.int8) >> 4], -1).view(-1)


@pytest.mark.parametrize("bits,absmax,back", [(8, 63.5625, 63.562503814697266), (4, 1.9375, 1.9374998807907104)])
def test_absmax_code_and_one_ulp(bits, absmax, back):
    """The largest element's code is +-qmax, but fl(fl(a / qmax) * qmax) need not be a (it is for ~99.4% of INT8
    and ~92% of INT4 absmax values): it is a or an fp32 neighbour, since fl(a/q) * q = a(1 + d), |d| <= 2^-24, lies
    strictly within one ulp of a and rounding to nearest cannot pass a's neighbours. Hand-found counterexamples."""
    x = torch.tensor([absmax, -absmax / 2, 0.0, -absmax])
    codes, scales = quantize_symmetric(x, bits=bits, group_size=4)
    qm = 2 ** (bits - 1) - 1
    assert _signed_codes(codes, bits).tolist()[::3] == [qm, -qm]
    y = dequantize_symmetric(codes, scales, bits=bits, group_size=4, numel=4)
    assert y[0].item() == back != absmax and y[3].item() == -back
    assert abs(back - absmax) == abs(torch.nextafter(torch.tensor(absmax), torch.tensor(back)).item() - absmax)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,g", [(1, 4), (1000, 64), (4099, 128), (777, 6)])
def test_symmetric_round_trip_bound(dtype, bits, numel, g):
    torch.manual_seed(numel + bits)
    x = (torch.randn(numel) * torch.rand(numel).pow(4) * 10).to(dtype)
    codes, scales = quantize_symmetric(x, bits=bits, group_size=g)
    y = dequantize_symmetric(codes, scales, bits=bits, group_size=g, numel=numel, dtype=torch.float32)
    assert y.shape == (numel,) and y.dtype == torch.float32
    # Exact bound: q = rint(fl(x/s)) with |fl(x/s) - x/s| <= qmax*u, so |q - x/s| <= 1/2 + qmax*u, and
    # fl(q*s) adds |q*s|*u <= qmax*s*u: |x - deq| <= s/2 + 2*qmax*s*u = s/2 * (1 + 4*qmax*u) < s/2 * (1 + 2^-15).
    bound = _group_scales(scales, numel, g) / 2 * (1 + 2.0 ** -15)
    err = (x.double() - y.double()).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    # Every group's largest element gets the code +-qmax (scale = absmax / qmax: never clipped, unlike DeepSpeed's
    # absmax / 2^(b-1)) and dequantizes to absmax or an fp32 neighbour (see test_absmax_code_and_one_ulp).
    groups = scales.numel()
    xg = torch.cat([x.float(), torch.zeros(groups * g - numel)]).view(groups, g)
    top = xg.abs().argmax(dim=1, keepdim=True)
    amax = xg.gather(1, top).view(-1)
    real = amax != 0  # all-zero groups have scale 0 and no largest element
    qm = 2 ** (bits - 1) - 1
    assert torch.equal(_signed_codes(codes, bits).view(groups, g).gather(1, top).view(-1)[real],
                       (torch.sign(amax) * qm).to(torch.int8)[real])
    yg = torch.cat([y, torch.zeros(groups * g - numel)]).view(groups, g).gather(1, top).view(-1)
    inf = torch.tensor(float("inf"))
    assert bool(((yg >= torch.nextafter(amax, -inf)) & (yg <= torch.nextafter(amax, inf)))[real].all())
    # requested output dtype
    z = dequantize_symmetric(codes, scales, bits=bits, group_size=g, numel=numel, dtype=dtype)
    assert z.dtype == dtype and torch.equal(z, y.to(dtype))


def test_all_zero_group_dequantizes_to_exact_zero():
    x = torch.zeros(300)
    x[200:] = torch.randn(100)
    for bits in (8, 4):
        codes, scales = quantize_symmetric(x, bits=bits, group_size=64)
        assert scales[:3].tolist() == [0.0, 0.0, 0.0]
        y = dequantize_symmetric(codes, scales, bits=bits, group_size=64, numel=300)
        assert torch.equal(y[:192], torch.zeros(192)) and not torch.isnan(y).any()


def _weight_like(tensors: int, n: int, seed: int) -> torch.Tensor:
    """``[tensors, n]`` weight-like rows: N(0, 0.02^2) bulk (a trained layer's weights), with ``n / 4096`` positions
    per row (drawn with replacement) replaced by outliers of random sign and magnitude U(0.5, 1.5), 25-75 sigma."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(tensors, n, generator=g) * 0.02
    k = n // 4096
    idx = torch.randint(0, n, (tensors, k), generator=g)
    sign = torch.where(torch.rand(tensors, k, generator=g) < 0.5, -1.0, 1.0)
    return w.scatter_(1, idx, sign * (0.5 + torch.rand(tensors, k, generator=g)))


def test_block_quantization_beats_per_tensor(record_property):
    """Seed 000 Fig. 2: block INT8 (groups of 2048) error is >= 3x lower than per-tensor INT8 on weights with outliers.

    Expected ratio for :func:`_weight_like`: per tensor the scale is set by the largest of 64 outliers (~1.48), so the
    bulk's mean |error| is ~1.48/127/4; in blocks, the ~61% of blocks without an outlier (e^-0.5) get a ~20x finer
    scale and the rest pay ~1/127/4: ratio ~3.3. One 2^18-element tensor alone measures 3.27 +- 0.16 (240 tensors:
    min 2.91), so asserting on a single tensor passes or fails by the seed's luck. The ratio of mean errors pooled over
    12 tensors is 3.27 +- 0.03 (20 generator seeds: min 3.21), ten standard deviations above 3: that is asserted.
    """
    tensors, n = 12, 1 << 18
    w = _weight_like(tensors, n, seed=0).view(-1)

    def mean_abs_err(group: int) -> torch.Tensor:  # per tensor; group n = one scale per tensor (per-tensor INT8)
        c, s = quantize_symmetric(w, bits=8, group_size=group)
        y = dequantize_symmetric(c, s, bits=8, group_size=group, numel=w.numel())
        return (w - y).abs().view(tensors, n).mean(dim=1)

    per_tensor, block = mean_abs_err(n), mean_abs_err(2048)
    pooled = (per_tensor.mean() / block.mean()).item()
    each = per_tensor / block
    msg = (f"INT8 mean |error| per-tensor {per_tensor.mean().item():.3e}, block(2048) {block.mean().item():.3e}: "
           f"pooled ratio {pooled:.2f}x over {tensors} tensors (each: min {each.min().item():.2f}x, "
           f"max {each.max().item():.2f}x)")
    record_property("block_vs_per_tensor_int8_error_ratio", round(pooled, 3))
    record_property("block_vs_per_tensor_int8_error_ratio_min_tensor", round(each.min().item(), 3))
    print("\n" + msg)
    assert pooled >= 3.0, msg


EPS32 = torch.tensor(1e-7).item()  # ByteGrad's 1e-7 as the fp32 constant the kernels add


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,chunk", [(1, 1), (1000, 100), (4097, 1024), (333, 1000)])
def test_minmax_round_trip_bound(dtype, numel, chunk):
    """|x - deq| <= (R + e)/510 + 4u(R + e) + 5u*A per chunk, R = max - min, e = fl32(1e-7), A = max(|min|, |max|).

    Derivation (ByteGrad's arithmetic in fp32, unit roundoff u = 2^-24, every |d_i| <= u):
      s = fl(255 / fl(fl(R) + e)) = 255 (1 + d3) / ((R (1 + d1) + e)(1 + d2)), so 1/(2s) <= (R + e)/510 (1 + 3.01u);
      ub = rint(fl(max * s)), lb = fl(ub - 255); r = rint(fl(x * s)); q = clamp(min(r, ub) - lb, 0, 255);
      deq = fl(fl(q + lb) / s).
    Chunks with |max s| < 2^24 - 255 (here every chunk with R > 0: |max| * 255 / R < 300), where ub, lb and q + lb
    are exact integers:
      * r <= ub (fl and rint are monotone and x <= max): the min() with ub never bites.
      * lb <= r: q + lb = r and |x s - r| <= 1/2 + |x s| u, so |x - (q + lb)/s| <= 1/(2s) + |x| u.
      * r < lb (ByteGrad's uint8 cast would wrap; we clamp to q = 0, see the hand-computed test): x s >= min s,
        lb <= max s (1 + d4) + 1/2 - 255 and R s <= 255 (1 + u)/(1 - u)^2 < 255 (1 + 3.01u), so
        |x s - lb| <= 1/2 + |max s| u + 765.1u and |x - lb/s| <= 1/(2s) + |max| u + 3.01u (R + e)(1 + 3.01u).
      * the division adds |(q + lb)/s| u <= (A + 1/(2s)) u.
      Sum: (R + e)/510 (1 + 4.02u) + 3.02u (R + e) + 2u A + O(u^2).
    Constant chunks (R = 0, e.g. the one-element last chunk): every x is max. If |max s| >= 2^24, ub = fl(max s) and
    ub - lb is 255 up to half an ulp of ub, so fl(q + lb) is ub or its neighbour (relative 2u) and
    |deq - max| <= 4u |max|; otherwise the first case applies. Both are inside the bound.
    The issue's (max - min)/255/2 is the exact-arithmetic half step without ByteGrad's e:
    test_minmax_strict_half_step_bound asserts it where no rounding happens.
    """
    torch.manual_seed(numel)
    x = (torch.randn(numel) * 3 + 0.5).to(dtype)
    q, mins, maxs = quantize_minmax_uint8(x, chunk)
    assert q.dtype == torch.uint8 and q.shape == (numel,) and mins.shape == maxs.shape == (-(-numel // chunk),)
    xf = x.float()
    nchunks = mins.numel()
    for c in range(nchunks):
        part = xf[c * chunk:(c + 1) * chunk]
        assert mins[c].item() == part.min().item() and maxs[c].item() == part.max().item()
    y = dequantize_minmax_uint8(q, mins, maxs, chunk, numel, torch.float32)
    span = maxs.double() - mins.double() + EPS32
    mag = torch.maximum(mins.double().abs(), maxs.double().abs())
    varying = maxs > mins
    assert bool((mag[varying] * 255 / span[varying] < 2 ** 24 - 255).all())  # the derivation's precondition
    bound = (span / 510 + 4 * U * span + 5 * U * mag).repeat_interleave(chunk)[:numel]
    err = (xf.double() - y.double()).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    z = dequantize_minmax_uint8(q, mins, maxs, chunk, numel, dtype)
    assert z.dtype == dtype and torch.equal(z, y.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("log2_step", [0, -3, -6])
def test_minmax_strict_half_step_bound(dtype, log2_step):
    """The issue's bound |x - deq| <= (max - min)/255/2, on inputs where fp32 arithmetic is exact.

    Each chunk spans exactly 255 steps h = 2^log2_step, from min = -k h: fl(255h + 1e-7) = 255h (1e-7 is below half an
    ulp of 255h for h >= 2^-6), so s = 1/h exactly; x is on a grid of h/8, so x*s, rint, q + lb and (q + lb)/s are
    all exact and the error is h * |x/h - rint(x/h)| <= h/2. Grid points at half steps reach the bound exactly.
    """
    h, chunk, k = 2.0 ** log2_step, 512, 100
    g = torch.Generator().manual_seed(-log2_step)
    fine = torch.randint(0, 255 * 8 + 1, (4, chunk), generator=g)  # eighths of a step above min
    fine[:, 0], fine[:, 1], fine[:, 2] = 0, 255 * 8, 4 + 8 * torch.arange(4)  # min, max and exact half steps
    x = ((fine.double() / 8 - k) * h).view(-1).to(dtype)
    q, mins, maxs = quantize_minmax_uint8(x, chunk)
    assert (maxs - mins).tolist() == [255 * h] * 4
    y = dequantize_minmax_uint8(q, mins, maxs, chunk, x.numel())
    err = (x.double() - y.double()).abs().view(4, chunk)
    half_step = ((maxs.double() - mins.double()) / 255 / 2).unsqueeze(1)
    assert bool((err <= half_step).all()), float((err - half_step).max())
    assert torch.equal(err.amax(dim=1, keepdim=True), half_step)  # the bound is tight: ties land exactly on it


def test_minmax_bytegrad_conventions_hand_computed():
    x = torch.tensor([-1.0, 0.0, 0.25, 1.0])
    q, mins, maxs = quantize_minmax_uint8(x, 4)
    s = torch.tensor(255.0) / (torch.tensor(2.0) + 1e-7)
    ub = torch.round(torch.tensor(1.0) * s)
    lb = ub - 255
    raw = torch.minimum(torch.round(x * s), ub) - lb
    # fl(2 + 1e-7) = 2, so s = 127.5 exactly and both ends are ties: ub = rint(127.5) = 128 but rint(-127.5) = -128,
    # one step below lb. ByteGrad's uint8 cast would wrap that -1 to 255; we clamp it to 0 (the nearest code).
    assert raw.tolist() == [-1.0, 127.0, 159.0, 255.0]
    assert q.tolist() == raw.clamp(0, 255).to(torch.uint8).tolist() == [0, 127, 159, 255]
    y = dequantize_minmax_uint8(q, mins, maxs, 4, 4)
    assert torch.equal(y, (q.float() + lb) / s)


def test_constant_chunk():
    x = torch.full((10,), 3.0)
    q, mins, maxs = quantize_minmax_uint8(x, 5)
    y = dequantize_minmax_uint8(q, mins, maxs, 5, 10)
    assert torch.allclose(y, x, rtol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_reduce_quantize_and_reduce(bits):
    torch.manual_seed(bits)
    k, g, n = 3, 32, 320
    xs = [torch.randn(n) for _ in range(k)]
    qs = [quantize_symmetric(x, bits=bits, group_size=g) for x in xs]
    chunks = torch.stack([c for c, _ in qs])
    scales = torch.stack([s for _, s in qs])
    deq = [dequantize_symmetric(c, s, bits=bits, group_size=g, numel=n) for c, s in qs]
    total = (deq[0] + deq[1]) + deq[2]
    out = dequantize_reduce(chunks, scales, bits=bits, group_size=g)
    assert torch.equal(out, total)
    assert torch.equal(dequantize_reduce(chunks, scales, bits=bits, group_size=g, numel=100, dtype=torch.bfloat16),
                       total[:100].bfloat16())
    c2, s2 = dequantize_reduce_quantize(chunks, scales, bits, g)
    r2 = quantize_symmetric(total, bits=bits, group_size=g)
    assert torch.equal(c2, r2[0]) and torch.equal(s2, r2[1])


def test_non_contiguous_input_is_an_error():
    x = torch.randn(16, 8).t()
    with pytest.raises(ValueError, match="contiguous"):
        quantize_symmetric(x, bits=8, group_size=8)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_minmax_uint8(x, 8)
    with pytest.raises(ValueError, match="contiguous"):
        swizzle_quantize(x, 4, 8, 2, 2, 1)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_symmetric(torch.randn(64)[::2], bits=8, group_size=8)


def test_strided_codes_scales_chunks_are_clear_errors():
    """The same ValueError as the Triton path (triton_cases), before any view of the strided tensor is taken; and
    the same for arguments that would make a kernel read past its arrays."""
    contract_cases.run_non_contiguous_rejected(reference)
    contract_cases.run_bad_arguments_rejected(reference)


def test_row_strided_inputs():
    """Rows of a received buffer read in place: the same bits as contiguous inputs (and dequantize_rows as a
    per-row dequantize)."""
    contract_cases.run_row_strided_inputs(reference)


def test_out_rows():
    """The quantizing ops write wire rows in place (out=): the bytes they return otherwise."""
    contract_cases.run_out_rows(reference)


def test_round_half_to_even_ties():
    """Exact .5 ties, hand-written codes: plain quantize, the fused swizzle and the fused requantize."""
    contract_cases.run_symmetric_ties(reference)
    contract_cases.run_swizzle_ties(reference)
    contract_cases.run_requantize_ties(reference)


def test_minmax_overflowing_constant_chunk():
    contract_cases.run_minmax_overflow(reference)
    contract_cases.run_minmax_reduce(reference)
    contract_cases.run_minmax_rows(reference)
    contract_cases.run_minmax_out_rows(reference)
    contract_cases.run_out_aliasing_rejected(reference)


def test_reduce_factor_and_out():
    """qgZ's last step: the averaging factor and the shard as out."""
    contract_cases.run_reduce_factor_out(reference)


def test_int32_offset_guard():
    """Triton kernels index with int32: the guard admits offsets up to 2^31 - 1 and names the limit beyond."""
    check_int32_offsets(2 ** 31, "quantize")  # largest offset 2^31 - 1: still addressable
    with pytest.raises(ValueError, match=r"quantize needs offsets up to 2147483648, beyond .*int32.*2147483647"):
        check_int32_offsets(2 ** 31 + 1, "quantize")


def test_bad_arguments():
    x = torch.randn(64)
    with pytest.raises(ValueError, match="bits"):
        quantize_symmetric(x, bits=2, group_size=8)
    with pytest.raises(ValueError, match="even"):
        quantize_symmetric(x, bits=4, group_size=7)
    with pytest.raises(TypeError, match="float"):
        quantize_symmetric(torch.arange(8), bits=8, group_size=8)
    c, s = quantize_symmetric(x, bits=8, group_size=8)
    with pytest.raises(TypeError, match="int8"):
        dequantize_symmetric(c.view(torch.uint8), s, bits=8, group_size=8, numel=64)


@pytest.mark.parametrize("numel", [256, 250, 7])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("one_block", [True, False])
def test_swizzle_quantize_equals_quantizing_the_gathered_layout(numel, stages, one_block, monkeypatch):
    """Fused reorder + quantize == quantize(reordered, zero-padded copy): both paths, the bucket-sized one (the
    gathered block quantized in one pass) and the chunk-by-chunk one (each chunk read in place, its last group padded
    on its own), which larger inputs take."""
    from megatron_ext.kernels import reference
    from megatron_ext.kernels.reference import swizzle_gather
    if not one_block:
        monkeypatch.setattr(reference, "_ONE_BLOCK_MAX", 0)
    x = torch.randn(numel)
    for bits in (8, 4):
        lay = swizzle_layout(numel, bits, 8, 2, 4, stages)
        codes, scales = swizzle_quantize(x, bits, 8, 2, 4, stages)
        want_c, want_s = quantize_symmetric(swizzle_gather(x, lay).view(-1), bits=bits, group_size=8)
        assert torch.equal(codes.view(-1), want_c) and torch.equal(scales.view(-1), want_s)


def test_cache_block_size_does_not_change_results(monkeypatch):
    """The torch path works in cache blocks; a tiny block (many blocks, chunks split across blocks) is bit-identical."""
    from megatron_ext.kernels import reference
    x = torch.randn(5000) * 3
    qs = [quantize_minmax_uint8(x, c) for c in (7, 100, 3000)]
    sym = [quantize_symmetric(x, bits=b, group_size=32) for b in (8, 4)]
    swz = swizzle_quantize(x, 4, 32, 2, 2, 2)
    monkeypatch.setattr(reference, "_BLOCK", 64)
    for c, want in zip((7, 100, 3000), qs):
        got = quantize_minmax_uint8(x, c)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(dequantize_minmax_uint8(*got, c, 5000), dequantize_minmax_uint8(*want, c, 5000))
    for b, want in zip((8, 4), sym):
        got = quantize_symmetric(x, bits=b, group_size=32)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = swizzle_quantize(x, 4, 32, 2, 2, 2)
    assert torch.equal(got[0], swz[0]) and torch.equal(got[1], swz[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,g", [(1, 4), (1000, 64), (4099, 128), (100_000, 2042)])
def test_one_block_path_equals_the_blockwise_path(dtype, bits, numel, g, monkeypatch):
    """Inputs with a partial last group up to _ONE_BLOCK_MAX padded elements are (de)quantized as one zero-padded
    block; larger ones as cache blocks of whole groups plus the padded rest. Both give the same bits."""
    from megatron_ext.kernels import reference
    x = (torch.randn(numel) * 3).to(dtype)
    one = quantize_symmetric(x, bits=bits, group_size=g)
    one_back = dequantize_symmetric(*one, bits=bits, group_size=g, numel=numel, dtype=dtype)
    monkeypatch.setattr(reference, "_ONE_BLOCK_MAX", 0)
    monkeypatch.setattr(reference, "_BLOCK", 4 * g)   # several cache blocks, then the rest
    blockwise = quantize_symmetric(x, bits=bits, group_size=g)
    assert torch.equal(one[0], blockwise[0]) and torch.equal(one[1], blockwise[1])
    back = dequantize_symmetric(*blockwise, bits=bits, group_size=g, numel=numel, dtype=dtype)
    assert back.shape == one_back.shape == (numel,)
    assert torch.equal(back.view(torch.uint8) if dtype == torch.bfloat16 else back,
                       one_back.view(torch.uint8) if dtype == torch.bfloat16 else one_back)


def test_subnormal_scales_stay_in_range():
    x = torch.tensor([1e-40, -3e-41, 2e-42, 0.0, 5e-39, -5e-39, 1e-45, 0.0])
    for bits in (8, 4):
        codes, scales = quantize_symmetric(x, bits=bits, group_size=8)
        q = codes if bits == 8 else torch.stack([codes.view(torch.int8) >> 4, (codes << 4).view(torch.int8) >> 4], -1)
        qm = 2 ** (bits - 1) - 1
        assert int(q.min()) >= -qm and int(q.max()) <= qm
