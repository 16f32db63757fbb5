"""Published numbers the at-scale simulation (``tools/planner_scale.py``) is compared with, as data.

Kept apart from the simulation so the reference values are read in one place, with where each comes from, and can
never be edited by accident while the model is changed. Nothing here feeds the model: these are only printed next
to its predictions.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

# Seed 000 (ZeRO++), Table 2: end-to-end ZeRO++ over ZeRO-3 on 384 V100 (24 DGX-2 x 16), per model and tokens
# per GPU: (baseline TFLOPs, ZeRO++ TFLOPs, speedup) with 1 IB link, then with 8 IB links per node.
ZEROPP_TABLE2: Dict[Tuple[str, str], Tuple[Tuple[float, float, float], Tuple[float, float, float]]] = {
    ("gpt-138b", "2K"): ((19.96, 37.90, 1.90), (47.55, 55.30, 1.16)),
    ("gpt-138b", "1K"): ((11.25, 21.81, 1.94), (34.19, 44.38, 1.30)),
    ("gpt-91b", "2K"): ((19.99, 38.06, 1.90), (47.74, 56.26, 1.18)),
    ("gpt-91b", "1K"): ((11.27, 21.93, 1.95), (34.49, 44.36, 1.29)),
    ("gpt-49b", "2K"): ((20.06, 38.08, 1.90), (48.05, 56.24, 1.17)),
    ("gpt-49b", "1K"): ((11.27, 21.95, 1.95), (34.54, 44.46, 1.29)),
    ("gpt-18b", "2K"): ((25.98, 46.40, 1.79), (47.31, 53.65, 1.13)),
    ("gpt-18b", "1K"): ((14.15, 30.57, 2.16), (31.27, 37.87, 1.21)),
}
ZEROPP_GPUS = 384
ZEROPP_HARDWARE = {"1ib": "dgx2-v100-1ib", "8ib": "dgx2-v100-8ib"}

# Seed 004 (AMSP), MFU in percent that the text states (Fig. 11 itself is a plot the seed has no numbers of):
# section I and VI-B at 1024 GPUs; section II-C / III-A and VI-B at 8 GPUs.
AMSP_MFU_TEXT: Dict[Tuple[str, int], Dict[str, float]] = {
    ("llama-7b", 1024): {"AMSP": 51, "MiCS": 35, "ZeRO++": 4, "ZeRO-1": 36, "ZeRO-3": 4},
    ("llama-13b", 1024): {"AMSP": 52, "MiCS": 33, "ZeRO++": 6, "ZeRO-3": 4},
    ("llama-30b", 1024): {"AMSP": 42, "MiCS": 29, "ZeRO++": 5},
    ("llama-7b", 8): {"AMSP": 64, "ZeRO-1": 63, "MiCS": 50},
    ("llama-13b", 8): {"ZeRO-3": 47},
}
# Section VI-B: "when training LLaMA-30B on 32 GPUs, ZeRO++ encountered an OOM situation, whereas other methods
# achieved an MFU of around 40%".
AMSP_30B_32_GPUS_NOTE = "ZeRO++ OOM, others about 40% MFU"

# Seed 004 Table IV, the plans as (s_p, s_g, s_os) group sizes on nodes of 8 (``None``: the whole DP group).
# LLaMA-30B's AMSP row lost one cell in the seed's text ("8 1 8 1 8"): read as p = g = os = 8 inside a node.
AMSP_TABLE_IV: Dict[str, Dict[str, Tuple[Optional[int], Optional[int], Optional[int]]]] = {
    "llama-7b": {"AMSP": (1, 1, 8), "ZeRO-1": (1, 1, None), "ZeRO-3": (None, None, None), "MiCS": (8, 8, 8),
                 "ZeRO++": (None, None, None)},
    "llama-13b": {"AMSP": (4, 4, 8), "ZeRO-3": (None, None, None), "MiCS": (8, 8, 8), "ZeRO++": (None, None, None)},
    "llama-30b": {"AMSP": (8, 8, 8), "ZeRO-3": (None, None, None), "MiCS": (16, 16, 16),
                  "ZeRO++": (None, None, None)},
}
AMSP_GPUS: List[int] = [8, 16, 32, 64, 128, 256, 512, 1024]
AMSP_HARDWARE = "dgx-a100"
AMSP_GLOBAL_BATCH = 1024          # sequences of 4096 tokens: seed 004's 4M-token global batch
AMSP_RECOMPUTE = {"llama-7b": "none", "llama-13b": "none", "llama-30b": "full"}
