"""The prefix-aware router's tree over token ids: block-aligned longest match, per-replica
ownership, forgetting the least recently used blocks, and dead replicas; and its choice of
replicas: the holders of the longest prefix, unless the match is short or they are too busy."""

import pytest

pytest.importorskip("ray.serve")  # the package tianxia.ray needs Ray Serve (extra `ray`)

from tianxia.ray.prefix_tree import PrefixTree, prefix_holders  # noqa: E402

SYSTEM_A = list(range(100, 140))  # 40 tokens: two full blocks of 16 and 8 more
SYSTEM_B = list(range(200, 240))


def test_longest_block_aligned_prefix_and_owners():
    t = PrefixTree(block_size=16)
    t.insert(SYSTEM_A + [1, 2, 3], "r1")
    t.insert(SYSTEM_B + [1, 2, 3], "r2")
    # only whole blocks count: the 8 shared tokens past the second block are no KV block
    assert t.match(SYSTEM_A + [9, 9, 9], {"r1", "r2"}) == (32, {"r1"})
    assert t.match(SYSTEM_A[:20], {"r1", "r2"}) == (16, {"r1"})
    assert t.match(SYSTEM_A[:15], {"r1", "r2"}) == (0, set())  # shorter than a block
    assert t.match(SYSTEM_A, {"r2"}) == (0, set())  # only live replicas count
    assert t.match([7] * 48, {"r1", "r2"}) == (0, set())
    # a block equal to one of A's, but after a different first block, is another node
    assert t.match(SYSTEM_B[:16] + SYSTEM_A[16:32], {"r1", "r2"}) == (16, {"r2"})
    t.insert(SYSTEM_A[:16] + [5] * 16, "r2")
    assert t.match(SYSTEM_A[:16] + [0] * 16, {"r1", "r2"}) == (16, {"r1", "r2"})
    assert t.match(SYSTEM_A, {"r1", "r2"}) == (32, {"r1"})  # the longest holder wins


def test_least_recent_blocks_and_dead_replicas_are_forgotten():
    t = PrefixTree(block_size=4, max_blocks=3)
    t.insert([1, 2, 3, 4, 5, 6, 7, 8], "r1")  # 2 blocks
    t.insert([9, 9, 9, 9], "r2")
    t.insert([1, 2, 3, 4, 0, 0, 0, 0], "r1")  # touches [1,2,3,4] again: 4 entries, one goes
    # the oldest entry is r1's [5,6,7,8] block: its prefix [1,2,3,4] stays reachable
    assert t.match([1, 2, 3, 4, 5, 6, 7, 8], {"r1", "r2"}) == (4, {"r1"})
    assert t.match([1, 2, 3, 4, 0, 0, 0, 0], {"r1", "r2"}) == (8, {"r1"})
    t.insert([8, 8, 8, 8, 8, 8, 8, 8], "r1")  # two more: r2's block and the next oldest go
    assert t.match([9, 9, 9, 9], {"r1", "r2"}) == (0, set())
    # inserting deepest first: what is forgotten is the tail, never a prefix in the middle
    assert t.match([1, 2, 3, 4, 0, 0, 0, 0], {"r1"}) == (4, {"r1"})
    t.remove_replica("r1")
    assert t.match([8, 8, 8, 8], {"r1", "r2"}) == (0, set())
    assert not t._owners and not t._recent


def test_holders_unless_the_match_is_short_or_they_are_too_busy():
    t = PrefixTree(block_size=16)
    t.insert(SYSTEM_A + [1] * 24, "r1")  # 64 tokens: 4 blocks
    t.insert(SYSTEM_A + [1] * 24, "r2")
    t.insert(SYSTEM_A[:16], "r3")

    def choose(tokens, loads):
        return prefix_holders(t, tokens, loads, min_match_tokens=32, match_ratio=0.5,
                              imbalanced_threshold=4)

    prompt = SYSTEM_A + [1] * 24 + [2] * 40  # 104 tokens, 64 of them held by r1 and r2
    assert choose(prompt, {"r1": 3, "r2": 1, "r3": 0}) == ["r2", "r1"]  # least loaded first
    assert choose(prompt, {"r1": 3, "r3": 0}) == ["r1"]  # r2 is full or gone
    assert choose(prompt, {"r1": 5, "r2": 5, "r3": 0}) == []  # 5 over the idle r3: balance
    assert choose(prompt, {"r1": 4, "r2": 9, "r3": 0}) == ["r1", "r2"]
    assert choose(prompt + [3] * 40, {"r1": 0, "r2": 0}) == []  # 64 of 144: under half
    assert choose(SYSTEM_A[:20], {"r1": 0, "r3": 0}) == []  # one block: under 32 tokens
    assert choose([], {"r1": 0}) == [] and choose(prompt, {}) == []
