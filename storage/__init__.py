"""Disk tier: record format and block stores (installed as ``tiered_kv.storage``)."""
