"""Ray Serve request routers: to the replica that most likely holds a prompt's prefix, or in turn.

``PrefixAwareRequestRouter``: prefix match over the token ids recently routed (``PrefixTree``),
among the replicas under their queue bound (``max_ongoing_requests``, from Ray's queue-length
cache); a request whose match is shorter than ``min_match_tokens`` (or ``match_ratio`` of its
prompt) goes by plain power of two choices, as does a request when the matching replicas are all
full, or when the holders have over ``imbalanced_threshold`` more requests in flight than the least
loaded replica. ``RoundRobinRequestRouter``: the baseline it is measured against.
"""

from __future__ import annotations

import random

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from tianxia.ray.prefix_tree import PrefixTree, prefix_holders


def routing_tokens(pending_request: PendingRequest | None) -> list[int]:
    """The prompt's token ids the ingress put on the forwarded request ([] when there are none)."""
    if pending_request is None or not pending_request.args:
        return []
    return getattr(pending_request.args[0], "routing_tokens", None) or []


class PrefixAwareRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(
        self, block_size: int = 16, min_match_tokens: int = 32, match_ratio: float = 0.1,
        max_blocks: int = 1 << 16, imbalanced_threshold: int = 4,
    ) -> None:
        self._tree = PrefixTree(block_size=block_size, max_blocks=max_blocks)
        self._min_match_tokens = min_match_tokens
        self._match_ratio = match_ratio
        self._imbalanced_threshold = imbalanced_threshold

    def _load(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    def _two_choices(self, replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        return [random.sample(replicas, k=min(2, len(replicas)))]

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        available = self.select_available_replicas(candidate_replicas)
        if not available:
            # all full: let Ray probe and back off over the candidates
            return self._two_choices(candidate_replicas) if candidate_replicas else []
        by_id = {r.replica_id.to_full_id_str(): r for r in available}
        holders = prefix_holders(
            self._tree, routing_tokens(pending_request),
            {key: self._load(r) for key, r in by_id.items()},
            min_match_tokens=self._min_match_tokens, match_ratio=self._match_ratio,
            imbalanced_threshold=self._imbalanced_threshold,
        )
        if holders:  # the others as a fallback rank
            return [[by_id[h] for h in holders], self._two_choices(available)[0]]
        return self._two_choices(available)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result
    ) -> None:
        tokens = routing_tokens(pending_request)
        if tokens:
            self._tree.insert(tokens, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._tree.remove_replica(replica_id.to_full_id_str())


class RoundRobinRequestRouter(FIFOMixin, RequestRouter):
    """Each request to the next replica in turn, blind to prompts and load (full replicas are
    skipped): the baseline prefix-aware routing is measured against."""

    def initialize_state(self) -> None:
        self._next = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        available = self.select_available_replicas(candidate_replicas) or candidate_replicas
        if not available:
            return []
        ordered = sorted(available, key=lambda r: r.replica_id.unique_id)
        self._next += 1
        return [[ordered[(self._next - 1) % len(ordered)]]]
