"""Speculative decoding: proposals for the next tokens of decoding sequences, verified by the
target model in the same step (see :mod:`.rejection_sampler`).

The engine asks :class:`Speculator` for proposals before each step; the scheduler gives each
proposing decode ``1 + k`` tokens of its budget and KV slots; the runner scores those rows in the
flat batch and samples; the scheduler's update appends the accepted tokens and rolls back the rest
(``num_computed_tokens``, and the blocks past the last token).
"""

from __future__ import annotations

from tianxia.config import SpeculativeConfig
from tianxia.engine.spec_decode.speculator import Speculator

__all__ = ["SpeculativeConfig", "Speculator"]
