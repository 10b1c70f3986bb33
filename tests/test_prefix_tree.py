"""The prefix-aware router's trie: longest match, per-replica ownership, forgetting old prompts."""

import pytest

pytest.importorskip("ray.serve")  # the package tianxia.ray needs Ray Serve (extra `ray`)

from tianxia.ray.prefix_tree import PrefixTree  # noqa: E402


def test_longest_prefix_and_owners():
    t = PrefixTree()
    t.insert("system A. question 1", "r1")
    t.insert("system B. question 1", "r2")
    assert t.match("system A. question 2", {"r1", "r2"}) == (len("system A. question "), {"r1"})
    assert t.match("system ", {"r1", "r2"}) == (7, {"r1", "r2"})
    assert t.match("system A.", {"r2"}) == (len("system "), {"r2"})  # only live replicas count
    assert t.match("other", {"r1", "r2"}) == (0, set())


def test_old_prompts_and_dead_replicas_are_forgotten():
    t = PrefixTree(max_prompts=2)
    t.insert("aaaa", "r1")
    t.insert("aabb", "r1")
    t.insert("cccc", "r2")  # evicts "aaaa"; "aa" stays, "aabb" still passes through it
    assert t.match("aaaa", {"r1", "r2"}) == (2, {"r1"})
    t.remove_replica("r2")
    assert t.match("cccc", {"r1", "r2"}) == (0, set())
