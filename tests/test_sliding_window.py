"""Sliding-window KV cache: blocks outside every layer's window go back to the pool.

A tiny random Mistral (every layer slides over ``WINDOW`` tokens) generates far past its window
with a KV cache that cannot hold a whole sequence; its tokens and logprobs must equal
``transformers``' (float32) and the blocks a sequence holds must stay bounded by the window.
A Gemma-3-style model with one global layer keeps every block.
"""

from __future__ import annotations

import pytest
import torch
from test_model_families import make_model, make_tiny_tokenizer
from transformers import AutoModelForCausalLM

from tianxia import LLM, SamplingParams
from tianxia.engine.block_manager import BlockManager
from tianxia.engine.sequence import Sequence

WINDOW = 13  # not a multiple of the block size, so the bound's +1s are exercised
BLOCK = 4
CHUNK = 8  # max_num_batched_tokens: long prompts are prefilled in chunks


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_model("mistral-swa", tmp_path_factory.mktemp("swa") / "mistral", tiny_tokenizer_dir,
                      sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mistral_ref(mistral_dir):
    return AutoModelForCausalLM.from_pretrained(str(mistral_dir), dtype=torch.float32).eval()


def prompt_ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_against_reference(ref, prompt: list[int], output) -> None:
    """Greedy tokens and their top logprobs equal the reference's, position by position (one
    forward over prompt + output: teacher forcing, equal to greedy generation while they agree)."""
    tokens = output.token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    ref_lp = logits.log_softmax(-1)
    assert tokens == ref_lp.argmax(-1).tolist()
    for i, step in enumerate(output.logprobs):
        for token, lp in step.items():
            assert lp.logprob == pytest.approx(float(ref_lp[i, token]), abs=1e-4)


def held_blocks(engine, seq: Sequence) -> int:
    return sum(b != engine.block_manager.null_block for b in seq.block_table)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Step the engine to the end; returns the outputs and the most blocks any sequence held."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    outputs, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        for seq in engine.scheduler.running:
            peak = max(peak, held_blocks(engine, seq))
    return outputs, peak


def test_long_generation_stays_within_the_window(mistral_dir, mistral_ref):
    llm = LLM(str(mistral_dir), num_kv_blocks=12, block_size=BLOCK, max_num_batched_tokens=CHUNK)
    engine, bm = llm.engine, llm.engine.block_manager
    assert bm.sliding_window == WINDOW and bm.null_block is not None
    prompt = prompt_ids(0, 50)  # longer than the whole cache: it is prefilled in chunks
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True, logprobs=3)
    assert len(prompt) > bm.num_usable_blocks * BLOCK and engine.max_model_len > len(prompt) + 90

    outputs, peak = run(engine, {"long": (prompt, params)})

    out = outputs["long"].outputs[0]
    assert len(out.token_ids) == 90 and out.finish_reason == "length"
    check_against_reference(mistral_ref, prompt, out)
    assert engine.stats()["num_preemptions"] == 0
    assert peak <= bm.max_blocks_per_seq(CHUNK) < bm.num_usable_blocks
    assert bm.num_free_blocks == bm.num_usable_blocks  # everything back after it finishes
    assert not engine.runner.kv_cache[:, :, bm.null_block].any()  # the null block was never written


def test_held_blocks_follow_the_window_each_step(mistral_dir):
    """Between steps a decoding sequence holds exactly the blocks from the one holding position
    ``computed - window + 1`` (the first its next query sees) to its last."""
    llm = LLM(str(mistral_dir), num_kv_blocks=12, block_size=BLOCK, max_num_batched_tokens=CHUNK)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("r", {"prompt_token_ids": prompt_ids(1, 5)},
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            n = seq.num_computed_tokens
            first_live = max(0, n - WINDOW + 1) // BLOCK
            assert all(b == bm.null_block for b in seq.block_table[:first_live])
            assert held_blocks(engine, seq) == len(seq.block_table) - first_live
            seen += first_live > 0
    assert seen > 10
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.mark.parametrize("num_blocks", [24, 10])
def test_concurrent_sequences_forks_and_prefix_hits(mistral_dir, mistral_ref, num_blocks):
    """Several long sequences at once, one with n=2 siblings and two sharing a cached prefix;
    with 10 blocks they also preempt each other and recompute, and still match the reference."""
    llm = LLM(str(mistral_dir), num_kv_blocks=num_blocks, block_size=BLOCK, max_num_batched_tokens=CHUNK)
    engine, bm = llm.engine, llm.engine.block_manager
    shared = prompt_ids(2, 20)
    greedy = {"temperature": 0, "ignore_eos": True, "logprobs": 2}
    # a runs first: its prompt blocks are cached, then given back by the window
    requests = {"a": (shared + [7], SamplingParams(max_tokens=8, **greedy))}
    outputs, _ = run(engine, requests)
    later = {
        "c": (shared + [9, 10], SamplingParams(max_tokens=40, **greedy)),  # hits a's prefix
        "b": (prompt_ids(3, 11), SamplingParams(max_tokens=60, **greedy)),
        "pair": (prompt_ids(4, 17), SamplingParams(n=2, max_tokens=45, **greedy)),
    }
    more, peak = run(engine, later)
    outputs.update(more)
    requests.update(later)

    for rid, (ids, _) in requests.items():
        for completion in outputs[rid].outputs:
            check_against_reference(mistral_ref, ids, completion)
    assert outputs["c"].num_cached_tokens > 0
    assert peak <= bm.max_blocks_per_seq(CHUNK)
    preempted = engine.stats()["num_preemptions"]
    assert preempted == 0 if num_blocks == 24 else preempted > 0
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not engine.runner.kv_cache[:, :, bm.null_block].any()


def test_a_global_layer_keeps_every_block(tmp_path, tiny_tokenizer_dir):
    """Gemma 3's pattern (sliding and full layers share one block table): nothing is freed,
    decoding past the window still equals transformers."""
    model_dir = make_model("gemma3", tmp_path / "gemma3", tiny_tokenizer_dir)
    llm = LLM(str(model_dir), num_kv_blocks=32, block_size=BLOCK, max_num_batched_tokens=CHUNK)
    engine, bm = llm.engine, llm.engine.block_manager
    assert bm.sliding_window is None and bm.null_block is None
    prompt = prompt_ids(5, 10)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    engine.add_request("g", {"prompt_token_ids": prompt}, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        for seq in engine.scheduler.running:
            assert held_blocks(engine, seq) == len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    check_against_reference(ref, prompt, out.outputs[0])
    assert bm.num_free_blocks == bm.num_blocks


def test_shared_and_cached_blocks_outlive_the_window():
    """Giving a block back drops one reference: a sibling's reference or a prefix-cache key keeps
    it alive for them; positions keep their table index through the null block."""
    bm = BlockManager(num_blocks=16, block_size=4, sliding_window=6)
    seq = Sequence("r", None, list(range(20)), SamplingParams(max_tokens=1))
    bm.allocate(seq, 20)
    seq.num_computed_tokens = 20
    bm.cache_full_blocks(seq)
    child = seq.fork(1)
    bm.share(child)
    first = list(seq.block_table)

    dead = bm.num_skipped_blocks(20)  # (20 - 6 + 1) // 4 = 3: positions 0..11
    assert dead == 3 and bm.free_out_of_window(seq) == dead
    assert seq.block_table[:dead] == [bm.null_block] * dead and seq.block_table[dead:] == first[dead:]
    assert all(bm.blocks[b].ref_count == 1 for b in first[:dead])  # the sibling still reads them
    assert bm.free_out_of_window(seq) == 0  # idempotent

    bm.free_out_of_window(child)
    assert all(bm.blocks[b].ref_count == 0 and b in bm.free for b in first[:dead])
    # freed but still cached: a new sequence with the same prefix finds them
    again = Sequence("s", None, list(range(20)) + [99], SamplingParams(max_tokens=1))
    assert bm.lookup_prefix(again) == first[:5]
    bm.free_seq(seq)
    bm.free_seq(child)
    assert bm.num_free_blocks == bm.num_usable_blocks == 15
