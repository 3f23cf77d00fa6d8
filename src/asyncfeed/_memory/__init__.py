"""Batch memory: the host buffer pool, the pinned slot ring and the device copy stream."""
