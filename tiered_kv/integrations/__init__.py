"""Adapters that plug tiered_kv stores into serving engines.

Each adapter imports its engine, so none is imported here: import the one you need
(e.g. ``tiered_kv.integrations.sglang``) in the engine's own environment.
"""
