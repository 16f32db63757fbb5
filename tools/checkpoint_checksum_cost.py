#!/usr/bin/env python
"""Cost of the checkpoint checksums: CRC-32 while writing (the save) and verifying (``--load``), on a real checkpoint.

For every file of a pretrain_gpt checkpoint directory (e.g. the main job's, ``/tmp/megatron_ext_cpu_demo/ckpt/
iter_0000100``) it loads the object and times ``torch.save`` into a fresh file with and without the CRC-32 writer
``--load`` relies on, then times the verification read (``file_crc32``). Prints a table and writes JSON.

    python tools/checkpoint_checksum_cost.py /tmp/megatron_ext_cpu_demo/ckpt/iter_0000100 --json crc_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_ext.training.checkpointing import _CrcWriter, file_crc32  # noqa: E402


def _best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(ckpt: str, repeat: int = 3) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for root, _, names in os.walk(ckpt):
            for name in sorted(names):
                if not name.endswith(".pt"):
                    continue
                path = os.path.join(root, name)
                obj = torch.load(path, map_location="cpu", weights_only=False)
                out = os.path.join(d, "f.pt")

                def plain():
                    with open(out, "wb") as f:
                        torch.save(obj, f)

                def with_crc():
                    with open(out, "wb") as f:
                        torch.save(obj, _CrcWriter(f))

                rows.append({"file": os.path.relpath(path, ckpt), "bytes": os.path.getsize(path),
                             "save_s": _best_of(plain, repeat), "save_crc_s": _best_of(with_crc, repeat),
                             "verify_s": _best_of(lambda: file_crc32(path), repeat)})
    total = {k: sum(r[k] for r in rows) for k in ("bytes", "save_s", "save_crc_s", "verify_s")}
    return {"checkpoint": ckpt, "files": rows, "total": total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="an iter_NNNNNNN directory of a pretrain_gpt checkpoint")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="", help="where to write the JSON result")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.checkpoint, "manifest.json")):
        ap.error(f"{a.checkpoint} is not a checkpoint directory (no manifest.json)")
    res = measure(a.checkpoint, a.repeat)
    print(f"{'file':<36} {'MB':>8} {'save ms':>9} {'save+CRC ms':>12} {'verify ms':>10}")
    for r in res["files"] + [dict(res["total"], file="total")]:
        print(f"{r['file']:<36} {r['bytes'] / 1e6:>8.2f} {1e3 * r['save_s']:>9.1f} {1e3 * r['save_crc_s']:>12.1f} "
              f"{1e3 * r['verify_s']:>10.1f}")
    t = res["total"]
    print(f"CRC while writing: +{100 * (t['save_crc_s'] / t['save_s'] - 1):.1f}% of the save time; verifying: "
          f"{t['bytes'] / 1e6 / t['verify_s']:.0f} MB/s ({1e3 * t['verify_s']:.0f} ms for the whole checkpoint, "
          "shared among the ranks at --load)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
