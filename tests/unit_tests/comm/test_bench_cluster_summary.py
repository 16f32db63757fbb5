"""bench_cluster's honest summary (issue 14): best bucket per row, limit max(no-link step, wire bytes / rate), the
ratio to it and best-against-best speedups -- on hand-made results, no cluster needed."""
from __future__ import annotations

import pytest

from ..tool_loader import loaded_tool


def _row(ms: float, bucket: int, wire: float) -> dict:
    return {"times_s": [ms / 1e3], "bucket_numel": bucket, "wire_per_node": wire, "buckets": 3}


def test_rates_parse():
    with loaded_tool("bench_cluster") as bc:
        assert bc.rate_bits_per_s("1gbit") == 1e9 and bc.rate_bits_per_s("200mbit") == 2e8
        assert bc.rate_bits_per_s("unlimited") is None
        with pytest.raises(ValueError):
            bc.rate_bits_per_s("fast")


def test_summary_best_bucket_limit_and_speedup():
    mb = 2 ** 20
    results = {
        "unlimited": {"plain": _row(500, 400, 40 * mb), "quant": _row(520, 400, 5 * mb)},
        "200mbit": {"plain": _row(2000, 400, 40 * mb), "quant": _row(700, 400, 5 * mb)},
    }
    sweeps = {
        "unlimited": {"plain": {"4000": {"times_s": [0.45], "wire_per_node": 40 * mb}},
                      "quant": {"4000": {"times_s": [0.48], "wire_per_node": 5 * mb}}},
        "200mbit": {"plain": {"4000": {"times_s": [2.1], "wire_per_node": 40 * mb}},
                    "quant": {"4000": {"times_s": [0.6], "wire_per_node": 5 * mb}}},
    }
    with loaded_tool("bench_cluster") as bc:
        s = bc.summarize(results, sweeps, [])
        text = bc.render_summary(s)
    q = s["200mbit"]["quant"]
    assert q["best_bucket"] == "4000" and q["best_ms"] == pytest.approx(600)
    # limit: max(no-link step at the same bucket size = 480 ms, 5 MiB * 8 / 200 Mbit/s = 209.7 ms)
    assert q["limit_ms"] == pytest.approx(480) and q["ratio_to_limit"] == pytest.approx(600 / 480)
    p = s["200mbit"]["plain"]
    assert p["best_bucket"] == "400" and p["limit_ms"] == pytest.approx(40 * mb * 8 / 2e8 * 1e3)
    assert q["speedup_vs_best_plain"] == pytest.approx(2000 / 600)
    assert "quant" in text and "200mbit" in text


def test_phase_limit_hides_gathers_behind_forward_and_reductions_behind_backward():
    """Closed form: a 400 ms no-link step of forward 100 + update 20 + backward 200 (+ 80 ms rest); at 200 Mbit/s
    its 5 MiB of gathers take 209.7 ms (> forward + update: 89.7 ms exposed) and its 1 MiB of reductions 41.9 ms
    (< backward: hidden), so the phase limit is 80 + 209.7 + 200 = 489.7 ms, above the limit max(400, 251.7)."""
    mb = 2 ** 20
    phases = {"forward": [0.100], "update": [0.020], "backward": [0.200]}
    split = {"gather": 5 * mb, "reduce": 1 * mb}
    floor = {**_row(400, 400, 6 * mb), "phases_s": phases, "wire_split": split}
    slow = {**_row(560, 400, 6 * mb), "phases_s": phases, "wire_split": split}
    with loaded_tool("bench_cluster") as bc:
        s = bc.summarize({"unlimited": {"q": floor}, "200mbit": {"q": slow}}, {}, [])
        text = bc.render_summary(s)
        assert bc.phase_limit(floor, split, None) is None and bc.phase_limit(_row(400, 400, 0), split, 2e8) is None
    q = s["200mbit"]["q"]
    gather_s, reduce_s = 5 * mb * 8 / 2e8, 1 * mb * 8 / 2e8
    assert q["limit_ms"] == pytest.approx(400)
    assert q["phase_limit_ms"] == pytest.approx(1e3 * (0.080 + gather_s + 0.200))
    assert q["ratio_to_phase_limit"] == pytest.approx(560 / q["phase_limit_ms"])
    assert s["unlimited"]["q"]["phase_limit_ms"] == pytest.approx(400)   # no link: the floor itself
    # the gathers hidden too (a slower forward): the phase limit is the floor again
    slow_fwd = {**floor, "phases_s": {**phases, "forward": [0.190]}, "times_s": [0.490]}
    with loaded_tool("bench_cluster") as bc:
        assert bc.phase_limit(slow_fwd, split, 2e8) == pytest.approx(0.490)
    assert "x phase" in text
