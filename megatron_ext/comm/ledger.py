"""Communication ledger: bytes each rank puts on the wire, per collective and per link class.

[Note: what is counted]
Every backend records, for each collective it launches, the bytes *this rank sends*, split by link class:
``intra`` (peers on the same node) and ``inter`` (peers on another node). Volumes follow the pairwise-exchange
model of a collective: in a reduce-scatter or all-gather over P ranks of B bytes, a rank sends B/P to each of the
other P-1 ranks, so it sends ``(r-1)/P * B`` intra-node and ``(P-r)/P * B`` inter-node when r ranks share its
node. Scales, padding and metadata are counted: the ledger reports what went over the wire, not the payload.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from typing import Callable, Dict, Iterable, Optional, Tuple

LINKS: Tuple[str, str] = ("intra", "inter")


@dataclasses.dataclass
class LedgerEntry:
    calls: int = 0
    intra: int = 0
    inter: int = 0

    @property
    def total(self) -> int:
        return self.intra + self.inter


class CommLedger:
    """Accumulates bytes sent by this rank since the last :meth:`reset`."""

    def __init__(self) -> None:
        self._entries: Dict[str, LedgerEntry] = defaultdict(LedgerEntry)
        self.enabled = True
        # Called before every read or reset: the progress engine records from its own thread, so readers wait
        # until it has run every command submitted so far (see [Note: progress engine] in progress.py).
        self.sync: Optional[Callable[[], None]] = None
        self._lock = threading.Lock()   # the engine (reductions) and the training thread (gathers) both record

    def _synced(self) -> None:
        if self.sync is not None:
            self.sync()

    def record(self, collective: str, intra: int = 0, inter: int = 0, calls: int = 1) -> None:
        """Add ``intra``/``inter`` bytes sent by this rank under ``collective`` (e.g. ``"reduce_scatter"``)."""
        if not self.enabled:
            return
        if intra < 0 or inter < 0:
            raise ValueError(f"negative byte count for {collective}: intra={intra} inter={inter}")
        with self._lock:
            e = self._entries[collective]
            e.calls += calls
            e.intra += int(intra)
            e.inter += int(inter)

    def record_pairwise(self, collective: str, bytes_per_peer: int, intra_peers: int, inter_peers: int) -> None:
        """Record a collective in which this rank sends ``bytes_per_peer`` to each of the given peers."""
        self.record(collective, intra=bytes_per_peer * intra_peers, inter=bytes_per_peer * inter_peers)

    def reset(self) -> None:
        self._synced()
        self._entries.clear()

    def entries(self) -> Dict[str, LedgerEntry]:
        self._synced()
        return {k: dataclasses.replace(v) for k, v in self._entries.items()}

    def bytes(self, collective: str | None = None, link: str | None = None) -> int:
        """Bytes sent, optionally restricted to one collective and/or one link class."""
        if link is not None and link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        self._synced()
        total = 0
        for name, e in self._entries.items():
            if collective is not None and name != collective:
                continue
            total += e.total if link is None else getattr(e, link)
        return total

    def summary(self) -> Dict[str, Dict[str, int]]:
        """``{collective: {"calls", "intra", "inter", "total"}}`` plus a ``"total"`` row."""
        self._synced()
        out: Dict[str, Dict[str, int]] = {}
        for name in sorted(self._entries):
            e = self._entries[name]
            out[name] = {"calls": e.calls, "intra": e.intra, "inter": e.inter, "total": e.total}
        out["total"] = {
            "calls": sum(e.calls for e in self._entries.values()),
            "intra": self.bytes(link="intra"),
            "inter": self.bytes(link="inter"),
            "total": self.bytes(),
        }
        return out

    def format(self) -> str:
        rows: Iterable[str] = (
            f"{name:<28} calls={row['calls']:<6} intra={_fmt(row['intra']):>10} inter={_fmt(row['inter']):>10}"
            for name, row in self.summary().items()
        )
        return "\n".join(rows)


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return str(n)
