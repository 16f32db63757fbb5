"""ParameterBuffer: one flat tensor per dtype, every parameter's ``.data`` a view into it (no world needed)."""
import torch

from megatron_ext.optimizer.bucketing import assign_buckets
from megatron_ext.optimizer.param_buffer import ParameterBuffer


def _mixed_dtype_module() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.a = torch.nn.Linear(5, 7)                                           # fp32: 35 + 7
    m.h = torch.nn.Linear(7, 3).to(torch.bfloat16)                        # bf16: 21 + 3
    m.t = torch.nn.Parameter(torch.randn(4, 6).t())                       # fp32, non-contiguous (6, 4)
    m.hb = torch.nn.Parameter(torch.randn(9, dtype=torch.bfloat16))       # bf16
    return m


def test_params_are_views_into_one_flat_buffer_per_dtype():
    m = _mixed_dtype_module()
    params = list(m.parameters())
    values = [p.detach().clone() for p in params]
    dp = 3
    buckets = assign_buckets(params, bucket_size=30, num_shards=dp, alignment=8)
    pb = ParameterBuffer(buckets, torch.device("cpu"))
    assert set(pb.flat) == {torch.float32, torch.bfloat16}
    assert {b.dtype for b in buckets} == {torch.float32, torch.bfloat16} and len(buckets) > 2
    for p, v in zip(params, values):
        flat = pb.flat[p.dtype]
        b, off = pb.locate(p)
        assert b.dtype == p.dtype
        assert p.data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert p.data.storage_offset() == b.buffer_offset + off
        assert p.is_contiguous() and torch.equal(p.detach(), v)   # values kept, the transpose made contiguous
    for b in buckets:
        assert b.numel % dp == 0 and b.shard_numel % 8 == 0
        assert not pb.bucket_view(b)[b.data_numel:].any(), "padding is zero"
    # Writing the buffer (what the all-gather does) is what the parameters read.
    for dtype, flat in pb.flat.items():
        flat.add_(1)
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v + 1)
    # Buckets tile each dtype's buffer without overlap.
    for dtype, flat in pb.flat.items():
        mine = sorted((b.buffer_offset, b.numel) for b in buckets if b.dtype == dtype)
        assert [o for o, _ in mine] == [0] + [o + n for o, n in mine[:-1]] and sum(n for _, n in mine) == flat.numel()


def test_every_element_outside_a_parameter_is_zero_even_from_dirty_memory(monkeypatch):
    """The buffer is allocated uninitialised (so the model is never resident twice while it is filled): padding
    and alignment gaps must be zeroed explicitly. Dirty memory is simulated with a NaN-filled allocation."""
    import megatron_ext.optimizer.param_buffer as param_buffer

    real_empty = torch.empty
    monkeypatch.setattr(param_buffer.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    m = _mixed_dtype_module()
    params = list(m.parameters())
    pb = ParameterBuffer(assign_buckets(params, bucket_size=30, num_shards=3, alignment=8), torch.device("cpu"))
    monkeypatch.undo()
    for dtype, flat in pb.flat.items():
        covered = torch.zeros(flat.numel(), dtype=torch.bool)
        for p in params:
            if p.dtype == dtype:
                b, off = pb.locate(p)
                covered[b.buffer_offset + off:b.buffer_offset + off + p.numel()] = True
        assert not covered.all(), "the layout should have padding to check"
        assert not flat[covered].isnan().any()
        assert torch.equal(flat[~covered], torch.zeros_like(flat[~covered])), dtype
