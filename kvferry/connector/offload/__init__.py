"""Offload connector: KV blocks of computed prompts to CPU DRAM and disk tiers (see README.md)."""
