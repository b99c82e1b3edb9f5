"""Embedding lookups through tiers (lookup.py)."""
from deployment.serving.tiers.lookup import (POLICIES, IdError, LookupTiers, TierConfig, cache_capacities,
                                             open_npy_table, store_state, store_version)

__all__ = ["POLICIES", "IdError", "LookupTiers", "TierConfig", "cache_capacities", "open_npy_table",
           "store_state", "store_version"]
