"""Collective backends, DP topology and the communication ledger."""
from .backend import (BackendOptions, GradReduce, ParamGather, Work, available_grad_reduce,
                      available_param_gather, build_grad_reduce, build_param_gather, register_grad_reduce,
                      register_param_gather)
from .ledger import CommLedger
from .topology import Topology, group_members_per_node

__all__ = ["BackendOptions", "CommLedger", "GradReduce", "ParamGather", "Topology", "Work",
           "available_grad_reduce", "available_param_gather", "build_grad_reduce", "build_param_gather",
           "group_members_per_node", "register_grad_reduce", "register_param_gather"]
