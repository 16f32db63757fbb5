"""Calibration: the alpha-beta fit recovers known costs, and ``tools/calibrate_comm.py`` run on a gloo world writes a
profile the planner reads and solves with."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from megatron_ext.planner import HardwareProfile, TrainingSetup, Workload, solve
from megatron_ext.planner.model_spec import ModelSpec
from megatron_ext.planner.profile import LinkCost, fit_link_cost, steps

from unit_tests.tool_loader import loaded_tool


def test_fit_recovers_alpha_and_bandwidth():
    truth = LinkCost(alpha_s=20e-6, bytes_per_s=3e9)
    samples = [(steps("all_gather", g), b, truth.time(steps("all_gather", g), b))
               for g in (2, 4, 8) for b in (1e4, 1e6, 1e8)]
    fit = fit_link_cost(samples)
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(truth.bytes_per_s, rel=1e-6)


def test_fit_never_returns_negative_terms():
    # Times that shrink with size (noise) would fit a negative slope: the fit keeps both terms >= 0.
    fit = fit_link_cost([(1.0, 1e3, 2e-3), (1.0, 1e6, 1e-3)])
    assert fit.alpha_s >= 0 and fit.bytes_per_s > 0


SHAPE = "1,64,4,128,32,1"


def _calibrate():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.compat import enable_cpu_compat

    enable_cpu_compat()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    with loaded_tool("calibrate_comm") as tool:
        a = argparse.Namespace(sizes="65536,262144", iters=1, windows=2, gpt=[SHAPE], backend="gloo", name="test",
                               rate="", peak_tflops=None)
        out = tool.calibrate(a, 2, torch.device("cpu"))
    ps.destroy_model_parallel()
    return out if dist.get_rank() == 0 else None


def test_calibration_writes_a_profile_the_planner_uses(spawn):
    out = spawn(_calibrate, 4)[0]
    prof = HardwareProfile.from_json(out)
    assert set(prof.links) == {"intra", "inter"}
    for link in prof.links.values():
        assert set(link) == {"reduce_scatter", "all_gather", "all_reduce", "all_to_all"}
        assert all(c.bytes_per_s > 0 and c.alpha_s >= 0 for c in link.values())
    assert list(prof.compute_by_model) == ["gpt-1x64"] and prof.compute_flops > 0
    assert list(out["fwd_bwd_flops_by_model"]) == ["gpt-1x64"]   # forward + backward alone, kept for reference
    assert prof.kernels_on_compute and prof.intra_on_compute and prof.algorithm == "ring"   # gloo rings too
    assert prof.reduce_scatter_as_all_reduce   # gloo's reduce-scatter is an all-reduce of the whole buffer
    assert prof.reduce_kernel_bytes_per_s > 0 and prof.requant_kernel_bytes_per_s > 0  # both reductions timed
    assert 0.0 <= prof.hop_cpu_s < 0.05 and "hop_cpu_s" in out   # a hop's processor time: measured, not seconds
    assert 0.0 <= prof.overlap_slowdown < 5.0   # paired windows beside the cross-node groups' all-reduces
    assert out["codec_host_s"] == 0.0   # CPU: the codecs' time is their kernel time, on the processor that trains
    assert len(out["samples"]["inter all_gather"]) == 2
    wl = Workload(ModelSpec("gpt-1x64", 1, 64, 4, 128, 32), 4, 2, 1, 2, setup=TrainingSetup(params_dtype="fp32"))
    ranking = solve(wl, prof, bucket_sizes=[4096])
    assert ranking.best.step_s > ranking.best.compute_s * 0.99 > 0


def test_compute_from_the_training_step_gives_the_step_back():
    """The compute rate is taken from a measured DP-1 step so that the cost model's compute-alone time of that step
    (forward + backward, gradient copies, optimizer) is the measured time again -- whatever the kernel rates are."""
    spec = ModelSpec("gpt-2x64", 2, 64, 4, 128, 32)
    with loaded_tool("calibrate_comm") as tool:
        M, step_s = tool.STEP_MICRO_BATCHES, 0.25
        link = {op: {"alpha_s": 1e-5, "bytes_per_s": 1e9}
                for op in ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")}
        base = HardwareProfile.from_json({"name": "t", "source": "test", "gpus_per_node": 1,
                                          "gpu_memory_bytes": 1 << 34, "peak_flops": 1e12, "compute_flops": 1e12,
                                          "links": {"intra": link, "inter": link},
                                          "optimizer_s_per_element": 3e-8, "grad_s_per_element": 1e-8})
        wl = Workload(spec, 1, 1, 2, M, setup=TrainingSetup(params_dtype="fp32"))
        numel = sum(spec.busiest_stage_numels(1, 1))
        fb = tool.fwd_bwd_from_step(step_s, numel, M, base.optimizer_s_per_element, base.grad_s_per_element)
    prof = dataclasses.replace(base, compute_by_model={spec.name: spec.flops_per_sequence() * wl.micro_batch / fb})
    for p in solve(wl, prof, bucket_sizes=[4096, 1 << 20]).ranked:
        assert p.compute_s == pytest.approx(step_s, rel=1e-9)


def test_codec_hop_decodes_what_it_quantized():
    """The calls whose host time ``codec_host_s`` measures on a GPU run (here on CPU) and decode what a plain
    quantize-dequantize gives."""
    from megatron_ext.kernels import dequantize_symmetric, quantize_symmetric

    with loaded_tool("calibrate_comm") as tool:
        x = torch.randn(5000)
        out = torch.empty(1, 5000)
        tool.codec_hop(x, out)
        codes, scales = quantize_symmetric(x, bits=8, group_size=2048)
        assert torch.equal(out[0], dequantize_symmetric(codes, scales, bits=8, group_size=2048, numel=5000))
        assert tool.measure_codec_host(torch.device("cpu")) == 0.0


def test_overlap_slowdown_background_outlasts_the_window_at_any_link_rate():
    """The background's collective count covers the whole compute window whether one collective takes 1 ms (a fast
    link) or 80 ms (200 Mbit/s) -- the old fixed count of 24 ended 0.4-0.6 s into a 1.2-1.4 s window at 1 Gbit/s."""
    with loaded_tool("calibrate_comm") as tool:
        for window, one in ((1.2, 0.001), (1.2, 0.019), (1.2, 0.085), (0.05, 0.2)):
            n = tool.background_count(window, one)
            assert n * one >= tool.SLOWDOWN_OUTLAST * window and n >= 2
            assert (n - 2) * one < tool.SLOWDOWN_OUTLAST * window or n == 2   # not far beyond it
        assert tool.background_count(1.0, 0.0, cap=500) == 500   # a collective timed at 0 s: bounded, not infinite
        # the beside window is the alone one times (1 + slowdown): 0.5-0.65 measured at 1 Gbit/s must stay covered
        assert tool.SLOWDOWN_OUTLAST >= 2.0


def test_overlap_slowdown_pairs_windows_against_host_drift():
    """Windows lengthening by a fifth of the first per round (a host slowing down): every pair reads the true 10%; an
    unpaired reading (the first alone window against the last beside one) would read 98%. One outlier pair (a slow
    alone window) moves the median by nothing; a faster beside window reads 0, not a negative slowdown."""
    with loaded_tool("calibrate_comm") as tool:
        alone = [1.0, 1.2, 1.4, 1.6, 1.8]
        beside = [1.1 * a for a in alone]
        assert tool.paired_slowdown(alone, beside) == pytest.approx(0.1)
        assert beside[-1] / alone[0] - 1 == pytest.approx(0.98)
        assert tool.paired_slowdown(alone + [2.0], beside + [1.4]) == pytest.approx(0.1)
        assert tool.paired_slowdown([1.0], [0.9]) == 0.0
        with pytest.raises(ValueError, match="same number"):
            tool.paired_slowdown([1.0, 1.0], [1.1])
