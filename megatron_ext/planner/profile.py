"""What the planner knows of a cluster: alpha-beta costs per collective and link class, compute and kernel speed.

[Note: the cost of a collective]
Seed 004 (IV-A) times a collective by profiling its effective bandwidth per size and device mesh. We keep its
profile-first approach in an alpha-beta form that extrapolates to group sizes that were not profiled:

    t = max(t_intra, t_inter),  t_link = alpha_link(op) * steps(op, ranks) + bytes_link / bw_link(op)

- ``bytes_intra`` is what one rank sends to peers of its node (the ledger's count; ranks of a node send in
  parallel over NVLink / shared memory), ``bytes_inter`` what one *node* sends across nodes (the sum over its
  ranks: they share the node's NICs), so concurrent groups sharing a link are charged once each;
- ``steps`` is the number of sequential latency hops: ``ranks - 1`` for ring reduce-scatter / all-gather,
  ``2 (ranks - 1)`` for all-reduce, 1 for all-to-all (pairwise sends in parallel), ``log2(ranks)`` for
  reduce / broadcast;
- ``algorithm = "ring"`` (NCCL's rings over nodes; gloo's collectives too, checked against the emulated nodes'
  eth0 counters) counts a ring's cross-node bytes per node, ``(G-1)/G`` of the payload, where the ledger's
  pairwise model counts ``D (G-D)/G`` (D ranks of the group per node); ``"pairwise"`` keeps the ledger's count.
  A calibrated profile fits ``alpha`` and ``bw`` with the same formula it is used with.
- ``reduce_scatter_as_all_reduce`` (gloo): torch's gloo process group runs a reduce-scatter as a full all-reduce of
  a copy of the input and keeps its own chunk (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), so it sends
  an all-reduce's bytes and takes an all-reduce's time: the planner costs it as the all-reduce it is. NCCL runs a
  real reduce-scatter.

Overlap is not free: collectives take GPU SMs and memory bandwidth (CPU: cores) from the compute they hide
behind, so compute overlapped by communication is ``overlap_slowdown`` slower (a calibrated profile measures it:
compute timed alone and beside a collective that outlasts it, the median of paired windows). On CPU ranks it grows
with the link's rate (more bytes per second through the same cores): 0.05-0.14 at 200 Mbit/s and 0.42-0.63 at 1
Gbit/s on the emulated 2 x 2 cluster (docs/benchmarks, stop 54).

On a CPU the node-local transfers are memory copies made by the same cores that compute (``intra_on_compute``):
their time is charged to the compute timeline as well.

[Note: the memory cap]
``gpu_memory_bytes`` is the device's memory as ``nvidia-smi`` reports it (``DEVICE_MEMORY_BYTES``; a calibrated
profile stores torch's ``total_memory``, which leaves out the driver's own ~0.5 GiB). Not all of it holds the
model: the CUDA context, NCCL's buffers (per communicator and channel) and the caching allocator's fragmentation
take their share, none of which the memory model counts. So the *default* cap (``default_memory_cap``) is the
device memory less ``MEMORY_RESERVE_BYTES`` (context + NCCL) and ``MEMORY_RESERVE_FRACTION`` of it
(fragmentation): 73.7 GiB of an H100 80GB's 79.6. A cap the user gives (``--gpu-memory``, ``--plan-gpu-memory``)
is taken as it is, reserve included.

Compute is ``FLOPs / compute_flops`` (achieved, not peak: MFU = FLOPs / (step time x peak)); the quantization
kernels cost ``4 bytes * elements / kernel_bytes_per_s``, on the compute timeline where they share the processor
(CPU) and on the communication timeline otherwise (GPU: they run beside the collectives on the comm stream).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Dict, Optional, Sequence, Tuple

OPS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all", "reduce", "broadcast")
LINKS = ("intra", "inter")
_COSTED_AS = {"scatter": "broadcast"}   # ops without a profiled cost of their own


@dataclasses.dataclass(frozen=True)
class LinkCost:
    alpha_s: float           # latency per sequential step
    bytes_per_s: float       # effective bandwidth for the bytes the note counts

    def time(self, steps: float, nbytes: float) -> float:
        return self.alpha_s * steps + nbytes / self.bytes_per_s


def steps(op: str, ranks: int) -> float:
    if ranks <= 1:
        return 0.0
    if op in ("reduce_scatter", "all_gather"):
        return ranks - 1.0
    if op == "all_reduce":
        return 2.0 * (ranks - 1)
    if op == "all_to_all":
        return 1.0
    return math.ceil(math.log2(ranks))


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    source: str
    gpus_per_node: int
    gpu_memory_bytes: int
    peak_flops: float                          # per GPU, for MFU
    compute_flops: float                       # achieved per GPU in dense training (no communication)
    links: Dict[str, Dict[str, LinkCost]]      # links[link][op]
    algorithm: str = "ring"                    # "ring" | "pairwise": see the module note
    reduce_scatter_as_all_reduce: bool = False  # gloo: a reduce-scatter is an all-reduce (see the module note)
    kernel_bytes_per_s: float = 1e12
    kernels_on_compute: bool = False
    reduce_kernel_bytes_per_s: float = 0.0     # qgZ's fused dequantize-reduce kernels (0: as kernel_bytes_per_s)
    requant_kernel_bytes_per_s: float = 0.0    # qgZ's INT4 dequantize-reduce-requantize (0: as the reduce kernels)
    optimizer_s_per_element: float = 2e-11     # Adam update of one owned element (masters, states, cast)
    launch_s: float = 5e-6                     # host time to issue one collective (per hop)
    codec_host_s: float = 0.0                  # GPU: host time of a quantized hop's codec calls (CPU: in kernel_s)
    hop_cpu_s: float = 0.0                     # CPU ranks: compute time a hop takes from the training beside it
    overlap_slowdown: float = 0.0              # compute slows by this fraction while a collective runs beside it
    grad_s_per_element: float = 0.0            # per micro-batch: a gradient element added into its bucket buffer
    intra_on_compute: bool = False             # node-local transfers are copies by the processor that computes (CPU)
    compute_by_model: Dict[str, float] = dataclasses.field(default_factory=dict)  # measured, per model name
    stores_attention_scores: bool = False      # activation formula: True for CPU "local" attention
    device: str = "cuda"

    @property
    def default_memory_cap(self) -> int:
        """Bytes per GPU the planner fills when no cap is given: the device less the reserve (module note)."""
        return max(0, int(self.gpu_memory_bytes * (1.0 - MEMORY_RESERVE_FRACTION)) - MEMORY_RESERVE_BYTES)

    def link(self, link: str, op: str) -> LinkCost:
        costs = self.links[link]
        # A scatter is costed as the broadcast it resembles (one root, log-depth), with its smaller byte count.
        return costs.get(op) or costs.get(_COSTED_AS.get(op, "")) or costs["all_gather"]

    def compute_for(self, num_layers: int, hidden_size: int) -> float:
        """The measured rate of this GPT shape (keyed by ``gpt_name``, as calibrate_comm writes it, whatever name a
        preset shows), else the profile's ``compute_flops``."""
        from .model_spec import gpt_name

        return self.compute_by_model.get(gpt_name(num_layers, hidden_size), self.compute_flops)

    # -- JSON ---------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["links"] = {l: {op: dataclasses.asdict(c) for op, c in ops.items()} for l, ops in self.links.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "HardwareProfile":
        """A profile from its JSON form, checked field by field so that a hand-written file fails here, naming the
        field, and not as a KeyError or ZeroDivisionError deep inside the cost model."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        d = dict(d)
        for f in ("name", "source", "gpus_per_node", "gpu_memory_bytes", "peak_flops", "compute_flops", "links"):
            if f not in d:
                raise ValueError(f"field {f!r} is missing")
        for f in ("name", "source"):
            if not isinstance(d[f], str):
                raise ValueError(f"field {f!r} must be a string, got {d[f]!r}")
        for f in ("gpus_per_node", "gpu_memory_bytes"):
            _check_number(f, d[f], positive=True, integer=True)
        for f in ("peak_flops", "compute_flops", "kernel_bytes_per_s"):
            if f in d:
                _check_number(f, d[f], positive=True)
        for f in ("reduce_kernel_bytes_per_s", "requant_kernel_bytes_per_s", "optimizer_s_per_element", "launch_s",
                  "codec_host_s", "hop_cpu_s", "overlap_slowdown", "grad_s_per_element"):
            if f in d:
                _check_number(f, d[f], positive=False)
        if d.get("algorithm", "ring") not in ("ring", "pairwise"):
            raise ValueError(f"field 'algorithm' must be 'ring' or 'pairwise', got {d['algorithm']!r}")
        by_model = d.get("compute_by_model", {})
        if not isinstance(by_model, dict):
            raise ValueError(f"field 'compute_by_model' must be an object of model name: FLOP/s, got {by_model!r}")
        for name, rate in by_model.items():
            _check_number(f"compute_by_model.{name}", rate, positive=True)
        d["links"] = _links_from_json(d["links"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "HardwareProfile":
        """Read and check a profile JSON; any problem is a ValueError naming the file (and the field). The callers
        put their flag in front (``--profile``, ``--plan-profile``)."""
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a usable planner profile: {e}; write one with tools/calibrate_comm.py") from e


def _check_number(field: str, value: object, *, positive: bool, integer: bool = False) -> None:
    """A profile field must be a (finite) number, > 0 or >= 0: a string or a zero would fail later, unnamed."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or (value <= 0 if positive else value < 0):
        what = ("a positive integer" if integer else "a positive number") if positive else "a number >= 0"
        raise ValueError(f"field {field!r} must be {what}, got {value!r}")


def _links_from_json(links: object) -> Dict[str, Dict[str, LinkCost]]:
    """``links[link][op] = {alpha_s, bytes_per_s}`` for both link classes; every class needs ``all_gather``, the
    cost of the ops it does not list (``HardwareProfile.link``)."""
    if not isinstance(links, dict):
        raise ValueError(f"field 'links' must be an object {{intra: ..., inter: ...}}, got {links!r}")
    out: Dict[str, Dict[str, LinkCost]] = {}
    for link in LINKS:
        ops = links.get(link)
        if not isinstance(ops, dict):
            raise ValueError(f"field 'links.{link}' is missing (an object of op: {{alpha_s, bytes_per_s}})")
        if "all_gather" not in ops:
            raise ValueError(f"field 'links.{link}.all_gather' is missing (it also costs the ops not listed)")
        out[link] = {}
        for op, c in ops.items():
            if op not in OPS:
                raise ValueError(f"field 'links.{link}.{op}': unknown collective (one of {', '.join(OPS)})")
            if not isinstance(c, dict) or set(c) != {"alpha_s", "bytes_per_s"}:
                raise ValueError(f"field 'links.{link}.{op}' must be {{\"alpha_s\": s, \"bytes_per_s\": B/s}}, "
                                 f"got {c!r}")
            _check_number(f"links.{link}.{op}.alpha_s", c["alpha_s"], positive=False)
            _check_number(f"links.{link}.{op}.bytes_per_s", c["bytes_per_s"], positive=True)
            out[link][op] = LinkCost(float(c["alpha_s"]), float(c["bytes_per_s"]))
    unknown = set(links) - set(LINKS)
    if unknown:
        raise ValueError(f"field 'links': unknown link class(es) {sorted(unknown)} (intra, inter)")
    return out


def fit_link_cost(samples: Sequence[Tuple[float, float, float]]) -> LinkCost:
    """Least-squares ``t = alpha * steps + bytes / bw`` from ``(steps, bytes, seconds)`` samples, both terms kept
    non-negative (a negative fit falls back to the other term alone)."""
    if not samples:
        raise ValueError("no samples to fit")
    sxx = sum(s * s for s, _, _ in samples)
    syy = sum(b * b for _, b, _ in samples)
    sxy = sum(s * b for s, b, _ in samples)
    sxt = sum(s * t for s, _, t in samples)
    syt = sum(b * t for _, b, t in samples)
    det = sxx * syy - sxy * sxy
    alpha = inv_bw = None
    if det > 0:
        alpha = (sxt * syy - syt * sxy) / det
        inv_bw = (syt * sxx - sxt * sxy) / det
    if alpha is None or alpha < 0 or inv_bw is None or inv_bw <= 0:
        alpha = 0.0 if syy > 0 else (sxt / sxx if sxx else 0.0)
        inv_bw = max(syt / syy, 1e-15) if syy > 0 else 1e-15
    return LinkCost(alpha_s=max(alpha, 0.0), bytes_per_s=1.0 / inv_bw)


# -- presets -------------------------------------------------------------------------------------------------
def _uniform(alpha: float, bw: float) -> Dict[str, LinkCost]:
    return {op: LinkCost(alpha, bw) for op in OPS}


GB = 1e9
MiB = 2 ** 20
# Device memory per card as nvidia-smi reports it on real ones ("80GB" is not 80 GiB for every card).
DEVICE_MEMORY_BYTES: Dict[str, int] = {
    "V100-SXM3-32GB": 32480 * MiB,     # nvidia-smi of a V100 32GB (PCIe; the DGX-2's SXM3 not checked here)
    "A100-SXM4-80GB": 81920 * MiB,     # A800 80GB: the same memory
    "H100-SXM5-80GB": 81559 * MiB,     # torch: 79.18 GiB total (the driver keeps the rest)
}
# The default cap's reserve (module note [the memory cap]): CUDA context, driver, NCCL's buffers; fragmentation.
MEMORY_RESERVE_BYTES = 2 * 2 ** 30
MEMORY_RESERVE_FRACTION = 0.05
_ASSUMED = ("effective bandwidths 80% of line rate and compute 20% slower beside running NCCL kernels "
            "(assumptions); 0.17 ms of host time per quantized hop (calibrate_comm's codec probe on an H100 host; "
            "docs/benchmarks/README.md 'Host time per bucket')")
# Host time of one quantized hop on a GPU: what tools/calibrate_comm.py measures (measure_codec_host) on one H100
# host, 0.17 ms (168-175 us in three rounds). A lower bound: that host's whole qgZ reduction took 0.54-0.61 ms for
# its two hops and a qwZ gather 0.28-0.31 ms. The presets' own hosts are not measured.
_CODEC_HOST_S = 1.7e-4


def _dgx2(ib_links: int) -> HardwareProfile:
    return HardwareProfile(
        f"dgx2-v100-{ib_links}ib", f"seed 000 section 5.1: DGX-2 nodes of 16 V100-SXM3 32 GB (NVSwitch, 150 GB/s per "
        f"GPU per direction), {ib_links} x 100 Gbit/s InfiniBand per node; 120 TFLOP/s peak (seed 000 eq. 3); "
        f"achieved compute 50% of peak, {_ASSUMED}",
        16, DEVICE_MEMORY_BYTES["V100-SXM3-32GB"], 120e12, 60e12,
        {"intra": _uniform(3e-6, 120 * GB), "inter": _uniform(6e-6, 0.8 * 12.5 * GB * ib_links)},
        kernel_bytes_per_s=450 * GB, optimizer_s_per_element=36 / 450e9, overlap_slowdown=0.2,
        codec_host_s=_CODEC_HOST_S)


PRESETS: Dict[str, HardwareProfile] = {p.name: p for p in (
    _dgx2(1),
    _dgx2(8),
    HardwareProfile(
        "dgx-a100", "seed 004 section VI-A: 8 A800 80 GB per node with NVLink, 4 x 200 Gbit/s HDR InfiniBand "
        "(800 Gbit/s per node, no SHARP); 312 TFLOP/s bf16 peak; achieved compute 65% of peak (seed 004: ZeRO-1 "
        f"on 8 GPUs reaches 63% MFU); {_ASSUMED}",
        8, DEVICE_MEMORY_BYTES["A100-SXM4-80GB"], 312e12, 0.65 * 312e12,
        {"intra": _uniform(3e-6, 0.8 * 200 * GB), "inter": _uniform(6e-6, 0.8 * 100 * GB)},
        kernel_bytes_per_s=1000 * GB, optimizer_s_per_element=36 / 1000e9, overlap_slowdown=0.2,
        codec_host_s=_CODEC_HOST_S),
    HardwareProfile(
        "h100", "DGX H100 datasheet: 8 H100 80 GB per node, NVLink 4 (450 GB/s per GPU per direction), 8 x 400 "
        f"Gbit/s NDR InfiniBand; 989 TFLOP/s bf16 dense peak; achieved compute 45% of peak, {_ASSUMED}",
        8, DEVICE_MEMORY_BYTES["H100-SXM5-80GB"], 989e12, 0.45 * 989e12,
        {"intra": _uniform(3e-6, 0.8 * 450 * GB), "inter": _uniform(5e-6, 0.8 * 400 * GB)},
        kernel_bytes_per_s=2500 * GB, optimizer_s_per_element=36 / 2500e9, overlap_slowdown=0.2,
        codec_host_s=_CODEC_HOST_S),
)}


def hardware_preset(name: str) -> HardwareProfile:
    if name not in PRESETS:
        raise ValueError(f"--hardware must be one of {sorted(PRESETS)}, got {name!r} (or give --profile FILE)")
    return PRESETS[name]


def load_profile(hardware: Optional[str], profile: Optional[str]) -> HardwareProfile:
    """``--profile FILE`` wins over ``--hardware NAME``; one of them is required."""
    if profile:
        try:
            return HardwareProfile.load(profile)
        except ValueError as e:
            raise ValueError(f"--profile {e}") from e
    if hardware:
        return hardware_preset(hardware)
    raise ValueError("give --hardware NAME (" + ", ".join(sorted(PRESETS)) + ") or --profile FILE")
