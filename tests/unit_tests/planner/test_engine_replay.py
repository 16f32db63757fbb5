"""The cost model replays the progress engine's rule (comm/progress.py), including its completion by launch number."""
from __future__ import annotations

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
