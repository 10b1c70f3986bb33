"""Which replica most likely still holds a prompt's prefix in its KV cache.

A character trie over the prompts recently routed to each replica (as SGLang's router and Ray's
``PrefixCacheAffinityRouter`` keep); pure Python, no Ray, so it is testable on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    owners: set[str] = field(default_factory=set)


class PrefixTree:
    """Prompts inserted per replica; the oldest prompts are forgotten past ``max_prompts`` (a
    replica's cache evicts too, so an old match is worth little)."""

    def __init__(self, max_prompts: int = 2048, max_chars: int = 8192) -> None:
        self.max_prompts = max_prompts
        self.max_chars = max_chars  # a longer prompt is keyed by its head only
        self._root = _Node()
        self._recent: OrderedDict[tuple[str, str], None] = OrderedDict()

    def insert(self, text: str, replica: str) -> None:
        text = text[: self.max_chars]
        key = (replica, text)
        if key in self._recent:
            self._recent.move_to_end(key)
            return
        self._recent[key] = None
        node = self._root
        for ch in text:
            node = node.children.setdefault(ch, _Node())
            node.owners.add(replica)
        while len(self._recent) > self.max_prompts:
            (old_replica, old_text), _ = self._recent.popitem(last=False)
            self._forget(old_text, old_replica)

    def _forget(self, text: str, replica: str) -> None:
        # the replica stays an owner of a node another of its recent prompts still passes through
        still = {t for (r, t) in self._recent if r == replica}
        node = self._root
        for i, ch in enumerate(text):
            child = node.children.get(ch)
            if child is None:
                return
            prefix = text[: i + 1]
            if not any(t.startswith(prefix) for t in still):
                child.owners.discard(replica)
            if not child.owners:
                del node.children[ch]
                return
            node = child

    def remove_replica(self, replica: str) -> None:
        for key in [k for k in self._recent if k[0] == replica]:
            del self._recent[key]
        stack = [self._root]
        while stack:
            node = stack.pop()
            for ch, child in list(node.children.items()):
                child.owners.discard(replica)
                if child.owners:
                    stack.append(child)
                else:
                    del node.children[ch]

    def match(self, text: str, replicas: set[str]) -> tuple[int, set[str]]:
        """The longest prefix of ``text`` held by one of ``replicas``: (its length in characters,
        the replicas that hold it)."""
        node, depth, best = self._root, 0, set()
        for ch in text[: self.max_chars]:
            child = node.children.get(ch)
            if child is None:
                break
            owners = child.owners & replicas
            if not owners:
                break
            node, depth, best = child, depth + 1, owners
        return depth, best
