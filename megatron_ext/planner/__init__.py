"""AMSP-style planner: picks the sharding plan, backends and bucket size for a model and cluster (seed 004)."""
