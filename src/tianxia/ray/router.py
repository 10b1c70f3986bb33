"""Ray Serve request router: a request goes to the replica that most likely holds its prefix.

Prefix match over the prompts recently routed (``PrefixTree``), among the replicas under their
queue bound (``max_ongoing_requests``, from Ray's queue-length cache); a request whose match is
shorter than ``min_match_chars`` (or ``match_ratio`` of its prompt) goes by plain power of two
choices, as does a request when the matching replicas are all full.
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

from tianxia.ray.prefix_tree import PrefixTree


def routing_text(pending_request: PendingRequest | None) -> str:
    """The prompt text the ingress put on the forwarded request ("" when there is none)."""
    if pending_request is None or not pending_request.args:
        return ""
    return getattr(pending_request.args[0], "routing_text", "") or ""


class PrefixAwareRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(
        self, min_match_chars: int = 64, match_ratio: float = 0.1, max_prompts: int = 2048
    ) -> None:
        self._tree = PrefixTree(max_prompts=max_prompts)
        self._min_match_chars = min_match_chars
        self._match_ratio = match_ratio

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
        text = routing_text(pending_request)
        if text:
            by_id = {r.replica_id.to_full_id_str(): r for r in available}
            depth, owners = self._tree.match(text, set(by_id))
            if depth >= max(self._min_match_chars, self._match_ratio * len(text)):
                # the least loaded of the holders first; the others as a fallback rank
                holders = sorted(
                    (by_id[o] for o in owners),
                    key=lambda r: self._replica_queue_len_cache.get(r.replica_id) or 0,
                )
                return [holders, self._two_choices(available)[0]]
        return self._two_choices(available)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result
    ) -> None:
        text = routing_text(pending_request)
        if text:
            self._tree.insert(text, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._tree.remove_replica(replica_id.to_full_id_str())
