"""Megatron-LM plug-in: ``add_args`` (an ``extra_args_provider``) and ``install()``; see plugin.py for the two lines.

Or, without editing the checkout: ``torchrun ... -m megatron_ext.megatron_lm.launch /path/to/pretrain_gpt.py ...``.
"""
from .plugin import add_args, chain, install, overlap_config_from_megatron_args, uninstall

__all__ = ["add_args", "chain", "install", "uninstall", "overlap_config_from_megatron_args"]
