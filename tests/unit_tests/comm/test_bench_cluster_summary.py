"""bench_cluster's honest summary (issue 14): best bucket per row, limit max(no-link step, wire bytes / rate), the
ratio to it and best-against-best speedups -- on hand-made results, no cluster needed."""
from __future__ import annotations

import json

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


def test_worker_flags_are_refused_before_anything_starts(capsys):
    """--out is the workers' flag (the orchestrator forwards its own argv to them): given by a user, every worker
    would write there and the orchestrator would find no results after the whole run; refused up front instead."""
    with loaded_tool("bench_cluster") as bc:
        with pytest.raises(SystemExit) as exc:
            bc.main(["--out", "results.json"])
        assert exc.value.code == 2
        assert "--json FILE" in capsys.readouterr().err


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
    assert q["speedup_vs_best_lossless"] == pytest.approx(2000 / 600)   # no ring row: plain is the baseline
    assert "quant" in text and "200mbit" in text
    # with a ring row (NCCL's reduce-scatter) faster than plain, the lossless baseline is the ring
    results["200mbit"]["ring"] = _row(1500, 400, 27 * mb)
    results["unlimited"]["ring"] = _row(510, 400, 27 * mb)
    with loaded_tool("bench_cluster") as bc:
        s = bc.summarize(results, sweeps, [])
    q = s["200mbit"]["quant"]
    assert q["speedup_vs_best_plain"] == pytest.approx(2000 / 600)
    assert q["speedup_vs_best_lossless"] == pytest.approx(1500 / 600)
    assert s["unlimited"]["quant"]["speedup_vs_best_lossless"] == pytest.approx(450 / 480)   # plain's 4000 point


def test_phase_limit_pipes_gathers_through_forward_and_reductions_through_backward():
    """Closed form: a 400 ms no-link step of forward 100 + update 20 + backward 200 (+ 80 ms rest), 3 buckets; at
    200 Mbit/s its 5 MiB of gathers take 209.7 ms and its 1 MiB of reductions 41.9 ms. Gathers: the link is the
    longer stage, plus one bucket's forward (33.3 ms, the pipe's drain); reductions: backward, plus one bucket's
    link time (14.0 ms). Phase limit 80 + 20 + 243.0 + 214.0 = 557.0 ms, above the limit max(400, 251.7)."""
    mb = 2 ** 20
    phases = {"forward": [0.100], "update": [0.020], "backward": [0.200]}
    split = {"gather": 5 * mb, "reduce": 1 * mb}
    floor = {**_row(400, 400, 6 * mb), "phases_s": phases, "wire_split": split}
    slow = {**_row(600, 400, 6 * mb), "phases_s": phases, "wire_split": split}
    with loaded_tool("bench_cluster") as bc:
        s = bc.summarize({"unlimited": {"q": floor}, "200mbit": {"q": slow}}, {}, [])
        text = bc.render_summary(s)
        assert bc.phase_limit(floor, split, None) is None and bc.phase_limit(_row(400, 400, 0), split, 2e8) is None
        # without a bucket count there is no fill or drain: rest + update + max + max
        unpiped = bc.phase_limit(floor, split, 2e8)
        # the link hidden in both phases: the floor plus one bucket of each link stage
        quiet = bc.phase_limit(floor, {"gather": 0.5 * mb, "reduce": 0.5 * mb}, 2e8, 3)
    gather_s, reduce_s = 5 * mb * 8 / 2e8, 1 * mb * 8 / 2e8
    q = s["200mbit"]["q"]
    assert q["limit_ms"] == pytest.approx(400)
    assert q["phase_limit_ms"] == pytest.approx(1e3 * (0.080 + 0.020 + gather_s + 0.100 / 3 + 0.200 + reduce_s / 3))
    assert q["ratio_to_phase_limit"] == pytest.approx(600 / q["phase_limit_ms"])
    assert unpiped == pytest.approx(0.080 + 0.020 + gather_s + 0.200)
    assert quiet == pytest.approx(0.400 + 2 * (0.5 * mb * 8 / 2e8) / 3)
    assert s["unlimited"]["q"]["phase_limit_ms"] == pytest.approx(400)   # no link: the floor itself
    assert "x phase" in text


def test_rescore_recomputes_a_stored_summary(tmp_path):
    mb = 2 ** 20
    doc = {"config": {"peers": ""}, "results": {"unlimited": {"plain": _row(500, 400, 40 * mb)},
                                                 "200mbit": {"plain": _row(2000, 400, 40 * mb)}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    with loaded_tool("bench_cluster") as bc:
        assert bc.main(["--rescore", str(path)]) == 0
    summ = json.loads(path.read_text())["summary"]
    assert summ["200mbit"]["plain"]["limit_ms"] == pytest.approx(40 * mb * 8 / 2e8 * 1e3)
    assert summ["200mbit"]["plain"]["phase_limit_ms"] is None   # a run without phase times


def test_common_size_overhead_against_plain_in_wall_and_cpu_time():
    """The per-bucket overhead check: each row's common-size step and CPU seconds per step over plain's; repeats are
    merged by _add (the medians are reported), and a row without CPU times gets no CPU ratio."""
    with loaded_tool("bench_cluster") as bc:
        results: dict = {}
        for plain_ms, plain_cpu, q_ms, q_cpu in ((500, 0.90, 540, 0.95), (520, 1.00, 560, 1.08),
                                                 (900, 1.10, 520, 1.20)):
            bc._add(results, "plain", {**_row(plain_ms, 400, 0), "cpu_s": [plain_cpu]})
            bc._add(results, "quant", {**_row(q_ms, 400, 0), "cpu_s": [q_cpu],
                                       "phases_s": {"forward": [0.1]}})
        bc._add(results, "peer", _row(700, 400, 0))
        assert results["plain"]["times_s"] == [0.5, 0.52, 0.9] and results["quant"]["cpu_s"] == [0.95, 1.08, 1.2]
        assert results["quant"]["phases_s"] == {"forward": [0.1, 0.1, 0.1]} and "cpu_s" not in results["peer"]
        s = bc.summarize({"unlimited": results}, {}, ["peer"])
        text = bc.render_summary(s)
    q = s["unlimited"]["quant"]
    assert q["common_cpu_s"] == pytest.approx(1.08)
    assert q["common_vs_plain"] == pytest.approx(540 / 520) and q["cpu_vs_plain"] == pytest.approx(1.08 / 1.00)
    assert s["unlimited"]["plain"]["cpu_vs_plain"] == pytest.approx(1.0)
    assert s["unlimited"]["peer"]["cpu_vs_plain"] is None
    assert "cpu/plain" in text


def test_compute_floor_updates_each_parameter_on_exactly_one_rank():
    """The ``compute`` row's Adam runs over a rank's share: together the shares are the model, never overlapping."""
    import torch

    params = [torch.empty(n) for n in (7, 1, 300, 5, 5, 64, 2, 90)]
    with loaded_tool("bench_cluster") as bc:
        for size in (1, 2, 4, 8):
            shares = [bc.owned_share(params, r, size) for r in range(size)]
            # each exactly once, and in order: rank r's share precedes rank r + 1's
            assert [id(p) for share in shares for p in share] == [id(p) for p in params]
        assert [len(bc.owned_share(params, r, 2)) for r in range(2)] == [3, 5]   # 308 | 166 elements of 474


def test_link_phases_give_each_phase_its_bytes_and_busy_share():
    """Where the link idles: a phase's bytes over the rate, divided by its time; what the phases leave of the step
    and of the step's bytes is ``other``; a row without per-phase bytes (no link counters) has none."""
    row = {"times_s": [1.0, 1.2], "wire_per_node": 20e6,
           "phases_s": {"forward": [0.4], "backward": [0.5], "sync": [0.05], "update": [0.05]},
           "wire_phases": {"forward": [8e6], "backward": [10e6], "sync": [0.5e6], "update": [0.0]}}
    with loaded_tool("bench_cluster") as bc:
        ph = bc.link_phases(row, 2e8)                                # 25 MB/s
        assert ph["forward"]["busy"] == pytest.approx(8e6 / 25e6 / 0.4)
        assert ph["backward"]["mb"] == pytest.approx(10.0) and ph["update"]["busy"] == 0.0
        assert ph["other"]["ms"] == pytest.approx(100.0) and ph["other"]["mb"] == pytest.approx(1.5)
        assert ph["other"]["busy"] is None
        assert bc.link_phases({k: v for k, v in row.items() if k != "wire_phases"}, 2e8) is None
        text = bc.render_link_phases({"200mbit": {"ring": row}, "unlimited": {"ring": row}})
    assert "forward 400/8.0/80%" in text and "unlimited" not in text


def test_link_timeline_windows_and_rendering():
    """--link-timeline: counter samples every 2 ms become a rate per 25 ms window (idle, then 25 MB/s = a 200 Mbit/s
    link fully busy), printed as busy percentages beside the phases' ends."""
    t0 = 100.0
    samples = [(t0 + 0.002 * i, 0 if i <= 25 else int((i - 25) * 0.002 * 25e6)) for i in range(51)]
    with loaded_tool("bench_cluster") as bc:
        w = bc.link_windows(samples, t0, 0.025)
        assert [round(ms) for ms, _ in w] == [0, 25, 50, 75]
        assert w[0][1] == 0 and w[2][1] == pytest.approx(25e6)
        row = {"link_timeline": {"marks_ms": {"forward_end": 40.0, "backward_end": 90.0}, "window_ms": 25.0,
                                 "bytes_per_s": w}}
        text = bc.render_link_timeline({"200mbit": {"ring": row}, "unlimited": {"ring": row}})
    assert "ring at 200mbit" in text and "forward 40, backward 90" in text and "unlimited" not in text
    assert text.splitlines()[1].split(":")[1].split()[:4] == ["0", "0", "100", "100"]


def test_odo_step_phases_with_several_micro_batches(monkeypatch):
    """``forward`` is the first micro-batch's, ``backward`` the last one's alone (not its forward), ``sync`` the
    wait after it, ``update`` the optimizer step: on a fake clock that each fake operation advances."""
    import contextlib
    import types

    clock = [0.0]

    class Loss:
        def __truediv__(self, m):
            return self

        def backward(self):
            clock[0] += 20.0

    def loss_of(model, batch):
        clock[0] += 10.0
        return Loss()

    ddp = types.SimpleNamespace(no_sync=contextlib.nullcontext,
                                finish_grad_sync=lambda: clock.__setitem__(0, clock[0] + 5.0))
    opt = types.SimpleNamespace(scale_loss=lambda x: x, step=lambda: clock.__setitem__(0, clock[0] + 3.0),
                                zero_grad=lambda: None)
    with loaded_tool("bench_cluster") as bc:
        monkeypatch.setattr(bc, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        monkeypatch.setattr(bc, "_gpt_loss", loss_of)
        step = bc.OdoStep(ddp, opt, [None, None, None])
        step()
        assert step.phase_s == {"forward": 10.0, "backward": 20.0, "sync": 5.0, "update": 3.0}
        assert clock[0] == 3 * 30.0 + 5.0 + 3.0


def test_interleaved_rates_measure_every_row_and_sweep_point_at_each_rate(monkeypatch):
    """--rate-order interleave (the default): rank 0 re-shapes the links, every rank waits at the barrier, then the
    row runs; each result lands under the rate the links had while it ran (the fake measurement reads the shaped
    rate), and the common bucket size's sweep point is that rate's own row. One rate: nothing is re-shaped, no extra
    barrier."""
    import types

    events, link = [], ["unshaped"]

    def shape(nodes, rate, prefix):
        events.append(("rate", rate))
        link[0] = rate

    def fake_gpt(topo, label, gr, pg, extra, a, plan_name="zero2", bucket=None, engine=True, speculative=False):
        size = bucket or a.bucket_numel
        events.append(("run", label, size, link[0]))
        # "buckets" carries the shaped rate through the sweep's point (which keeps only a few fields)
        return {"times_s": [len(events) / 1e3], "bucket_numel": size, "buckets": link[0], "rate_seen": link[0]}

    a = types.SimpleNamespace(mode="gpt", speculative_step="off", combos="plain,qwZ", bucket_numel=400, rank=0)
    with loaded_tool("bench_cluster") as bc:
        monkeypatch.setattr(bc, "set_link_rate", shape)
        monkeypatch.setattr(bc, "_gpt_combo", fake_gpt)
        monkeypatch.setattr(bc, "print", lambda *x, **k: None, raising=False)
        switch = bc.RateSwitch(["unlimited", "200mbit"], 2, "p", 0, lambda: events.append(("barrier",)))
        results, sweep = {}, {}
        bc._measure_rows(None, a, ["zero2"], [True], [4000, 400], switch, results, sweep)
        assert events[:8] == [("rate", "unlimited"), ("barrier",), ("run", "plain", 400, "unlimited"),
                              ("rate", "200mbit"), ("barrier",), ("run", "plain", 400, "200mbit"),
                              ("rate", "unlimited"), ("barrier",)]
        for rate in ("unlimited", "200mbit"):
            assert set(results[rate]) == {"plain", "qwZ"}
            for label in ("plain", "qwZ"):
                assert results[rate][label]["rate_seen"] == rate
                assert sweep[rate][label]["400"]["times_s"] == results[rate][label]["times_s"]
                assert sweep[rate][label]["4000"]["buckets"] == rate
        assert sum(e[0] == "run" for e in events) == 2 * 2 * 2   # 2 rows x 2 sizes x 2 rates
        # the next round goes through the rates the other way round
        events.clear()
        switch.next_round()
        assert list(switch.each()) == ["200mbit", "unlimited"]
        assert events[0] == ("rate", "200mbit")
        # rank 1 only waits; a single rate (a pass per rate) neither re-shapes nor waits
        events.clear()
        assert list(bc.RateSwitch(["a", "b"], 2, "p", 1, lambda: events.append(("barrier",))).each()) == ["a", "b"]
        assert events == [("barrier",), ("barrier",)]
        events.clear()
        assert list(bc.RateSwitch(["a"], 2, "p", 0, lambda: events.append(("barrier",))).each()) == ["a"]
        assert events == []


def test_main_runs_one_set_of_ranks_over_every_rate_or_one_per_rate(monkeypatch, tmp_path):
    """The orchestrator's side of --rate-order: interleave starts the ranks once with every rate (the links shaped to
    the first), pass once per rate; either way the JSON holds each rate's rows, in the order given. Worker-only flags
    are refused even when empty."""
    import types

    calls = []

    class FakeCluster:
        def __init__(self, nodes, rate, prefix):
            self.rate = rate

        def set_rate(self, rate):
            self.rate = rate

        def down(self):
            pass

    def fake_run_rates(cluster, a, rates, forward):
        calls.append((cluster.rate, list(rates)))
        return {r: {"rows": {"plain": {"times_s": [0.5], "bucket_numel": 400}}, "sweep": {}} for r in rates}

    with loaded_tool("bench_cluster") as bc:
        monkeypatch.setattr(bc, "Cluster", FakeCluster)
        monkeypatch.setattr(bc, "run_rates", fake_run_rates)
        monkeypatch.setattr(bc.os, "geteuid", lambda: 0)
        monkeypatch.setattr(bc, "render", lambda results, a: "")
        monkeypatch.setattr(bc, "render_link_phases", lambda results: "")
        for order, expected in (("interleave", [("unlimited", ["unlimited", "1gbit", "200mbit"])]),
                                ("pass", [("unlimited", ["unlimited"]), ("1gbit", ["1gbit"]),
                                          ("200mbit", ["200mbit"])])):
            calls.clear()
            out = tmp_path / f"{order}.json"
            assert bc.main(["--mode", "gpt", "--rates", "1gbit,200mbit", "--floor", "--peers", "", "--rate-order",
                            order, "--extensions-dir", str(tmp_path), "--json", str(out)]) == 0
            assert calls == expected
            doc = json.loads(out.read_text())
            assert list(doc["results"]) == ["unlimited", "1gbit", "200mbit"]
            assert doc["config"]["rate_order"] == order and "at_rates" not in doc["config"]
        with pytest.raises(SystemExit):
            bc.main(["--at-rates", ""])
