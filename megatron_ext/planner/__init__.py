"""AMSP-style planner (seed 004): picks the sharding plan, backends and bucket size for a model and a cluster.

``solve(workload, profile, memory_cap)`` ranks every admissible candidate by a step-time model (``cost.py``) built
on the closed-form traffic of the ODO (``volumes.py``) and its exact memory (``memory.py``); profiles are named
presets or measured by ``tools/calibrate_comm.py``. ``python -m megatron_ext.planner --help`` is the CLI.
"""
from .candidate import Candidate, parse_candidate
from .cost import Prediction, Workload, predict
from .memory import TrainingSetup
from .model_spec import MODEL_PRESETS, ModelSpec, model_preset
from .profile import PRESETS, HardwareProfile, LinkCost, hardware_preset, load_profile
from .search import Ranking, enumerate_candidates, solve

__all__ = ["Candidate", "parse_candidate", "Prediction", "Workload", "predict", "TrainingSetup", "MODEL_PRESETS",
           "ModelSpec", "model_preset", "PRESETS", "HardwareProfile", "LinkCost", "hardware_preset", "load_profile",
           "Ranking", "enumerate_candidates", "solve"]
