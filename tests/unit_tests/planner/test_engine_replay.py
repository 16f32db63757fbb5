"""The cost model replays the progress engine's rule (comm/progress.py), including its completion by launch number."""
from __future__ import annotations

import dataclasses

from megatron_ext.planner import hardware_preset
from megatron_ext.planner.cost import _Replay, _Timed


def _hops(n: int, seconds: float = 1.0):
    return [_Timed(None, seconds, ("inter",), 0.0, 0.0) for _ in range(n)]


def test_complete_of_an_already_finished_work_still_finishes_the_older_ones():
    rp = _Replay(hardware_preset("dgx-a100"))
    long = rp.launch(_hops(5))          # a multi-hop reduction: one hop now, one more per later launch
    short = rp.launch(_hops(1, 1e-6))   # a one-hop work launched after it
    rp.now += 100.0                     # backward goes on; the short work ends long before the next launch
    rp.launch(_hops(1, 1e-6))           # this launch retires the short work and advances the long one a hop
    assert long.next == 3 and short not in rp.inflight
    rp.complete(short)                  # the engine's COMPLETE(short): every work launched up to it is finished
    assert long.next == len(long.hops)
    assert rp.engine >= long.end and long not in rp.inflight


def test_quantized_hop_charges_its_codec_host_time_to_the_training_thread():
    """On a GPU a quantized hop's codec calls run on the host that drives training (inline engine); a plain hop
    (no kernel work) costs only its launch."""
    prof = dataclasses.replace(hardware_preset("h100"), launch_s=1e-5, codec_host_s=2e-4, hop_cpu_s=0.0)
    assert hardware_preset("h100").codec_host_s > 0
    rp = _Replay(prof)
    rp.launch([_Timed(None, 1.0, ("inter",), 0.0, 0.0)])
    assert abs(rp.now - 1e-5) < 1e-12
    rp.launch([_Timed(None, 1.0, ("inter",), 1e-3, 0.0), _Timed(None, 1.0, ("inter",), 1e-3, 0.0)])
    # the new work's first hop: launch + codec host time (its kernel time runs on the device, not the host)
    assert abs(rp.now - (1e-5 + 1e-5 + 2e-4)) < 1e-12


def test_complete_advances_the_newer_works_in_rounds_as_the_engine_does():
    """The engine's COMPLETE(a) (test_progress_engine.py, same program): on CPU a's hops a2, a3 with b's b1, b2
    between them, so b's hops queue on the link behind a's instead of after a's last one."""
    for device, b_next in (("cpu", 3), ("cuda", 1)):    # the inline engine (CUDA) finishes a alone
        rp = _Replay(dataclasses.replace(hardware_preset("dgx-a100"), device=device))
        a = rp.launch(_hops(4))
        b = rp.launch(_hops(4))      # advances a by one hop
        assert (a.next, b.next) == (2, 1)
        rp.complete(a)
        assert (a.next, b.next) == (4, b_next) and rp.inflight == [b]
        if device == "cpu":
            assert b.end > a.end     # b's third hop was issued in the round of a's last one and queued behind it

