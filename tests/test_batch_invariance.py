"""Same request, same answer (CPU, default settings): a request's greedy tokens, seeded samples
and logprobs are bit for bit the same whatever else is in its batch, whether its prompt was
computed in one chunk or several, whether its prefix came from the prefix cache, and after it was
preempted and recomputed, because every kernel computes a token's row the same way in a prompt
and in a decode step of any batch. For the default 8-bit activations and for float32 ones, on
packed GGUF weights (SmolLM2's Q4_1, Qwen2.5-Coder's Q5_0/Q4_K/Q6_K/Q8_0 mix) and on float weights.
The reference is each request computed alone on an engine without a prefix cache."""

from __future__ import annotations

import pytest

from tianxia import LLM, SamplingParams

SHARED = ("You are a helpful assistant. Answer briefly and precisely, and say so when you do not know "
          "the answer. Question: ")
PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):\n",
    SHARED + "What is the boiling point of water?",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    SHARED + "Who wrote Hamlet?",
    "import numpy as np\n\ndef mean(xs):\n    \"\"\"The arithmetic mean of xs.\"\"\"\n",
    "Translate to French: good morning, how are you today?",
    "SELECT name, email FROM users WHERE",
    SHARED + "Name three primary colours and say why they are called primary, in one sentence each.",
    "The theory of relativity " * 12,
    "Q: What is 7 times 8?\nA:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    SHARED + "How many legs does a spider have?",
    "A haiku about autumn leaves:\n",
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
# seeded sampling, two samples per request (seeds seed and seed + 1)
SEEDED = [(i, SamplingParams(temperature=0.9, top_p=0.95, max_tokens=6, logprobs=2, ignore_eos=True, n=2,
                             seed=100 + i)) for i in (1, 4, 10, 11)]
REQUESTS = [(p, GREEDY) for p in PROMPTS] + [(PROMPTS[i], params) for i, params in SEEDED]


def answers(llm: LLM, requests) -> list:
    """Per request: per sample its token ids and, per position, the (token, logprob, rank) of its
    top-2 and chosen tokens, exact floats."""
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [[(c.token_ids, [sorted((t, lp.logprob, lp.rank) for t, lp in pos.items()) for pos in c.logprobs])
             for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


def check_invariance(model: str, **kwargs) -> None:
    plain = LLM(model, enable_prefix_caching=False, num_kv_blocks=256, max_model_len=512, **kwargs)
    alone = [answers(plain, [r])[0] for r in REQUESTS]
    assert all(len(c[0]) == 6 for a in alone for c in a)
    assert alone[16][0] != alone[16][1]  # the two seeded samples differ
    assert answers(plain, REQUESTS) == alone, "batched"
    del plain
    # chunks of at most 24 tokens, a cache too small for every request at once (preemption), and
    # the prefix cache (the shared question prefix; the second round finds more)
    tight = LLM(model, max_num_batched_tokens=24, num_kv_blocks=12, max_model_len=192, **kwargs)
    assert answers(tight, REQUESTS) == alone, "chunked, preempted"
    assert tight.engine.scheduler.num_preemptions > 0
    hits = tight.engine.block_manager.prefix_hits
    assert hits > 0
    assert answers(tight, REQUESTS[::-1]) == alone[::-1], "prefix-cache hits"
    assert tight.engine.block_manager.prefix_hits > hits


@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_smollm2_answers_do_not_depend_on_batch_chunks_cache_or_preemption(smollm2_path, activations):
    check_invariance(str(smollm2_path), cpu_activations=activations)


def test_qwen_answers_do_not_depend_on_batch_chunks_cache_or_preemption(qwen_path):
    # (the float path of each of its layouts: tests/test_quant_linear.py)
    check_invariance(str(qwen_path))


def test_float_weights_answers_do_not_depend_on_batch_chunks_cache_or_preemption(tiny_models):
    check_invariance(str(tiny_models["qwen2"]))  # q/k/v biases; float32 products throughout
