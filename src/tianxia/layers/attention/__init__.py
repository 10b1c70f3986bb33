"""Attention over the paged KV cache, behind a small backend interface.

A backend receives the flat batch of the step (all sequences' new tokens concatenated, no padding)
plus an :class:`AttentionMetadata` describing where each sequence's tokens and cache blocks are.
"""

from tianxia.layers.attention.backend import AttentionBackend, AttentionMetadata, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
