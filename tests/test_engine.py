"""The paged, continuously batched engine on the real SmolLM2 model: batching, preemption,
prefix caching, chunked prefill, and the errors users hit first."""

from __future__ import annotations

import shutil

import pytest
from helpers import INT8_NEAR_TIE, NEAR_TIE, assert_greedy_match

from tianxia import LLM, SamplingParams
from tianxia.loader.errors import ModelLoadError
from tianxia.loader.hub import ModelNotFoundError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

# 16 prompts of quite different lengths (4 to ~200 tokens)
MIXED_PROMPTS = [
    "Hi",
    "The capital of Italy is",
    "Write a haiku about autumn leaves falling on a quiet pond.",
    "def quicksort(arr):\n    ",
    "In 1492, Columbus sailed the ocean blue. " * 6,
    "Translate to French: I would like a cup of coffee, please.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time " * 20,
    "import numpy as np\nimport torch\n\n# a function that",
    "The mitochondria is",
    "Here is a list of fruits: apple, banana, cherry, " + "grape, " * 30,
    "Dear Sir or Madam,\n",
    "Explain gradient descent to a five-year-old.",
    "SELECT name FROM users WHERE",
    "The three laws of robotics are",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _check_same(llm: LLM, prompts, expected, got, label: str, near_tie: float = NEAR_TIE) -> None:
    """Greedy runs must agree; where they don't, it must be at a near-tie of our own logits."""
    tok = llm.get_tokenizer()
    for p, e, g in zip(prompts, expected, got):
        ids = tok.encode(p) if isinstance(p, str) else p["prompt_token_ids"]
        assert_greedy_match(e, g, lambda i: llm.engine.score(ids + e[:i])[-1], f"{label} {p[:20]!r}",
                            near_tie=near_tie)


# The structural invariants (batching, preemption, prefix cache, chunking) are checked with exact
# products (float32 activations, as smollm2_llm has), where any difference beyond float rounding
# is a bug; the default 8-bit activations get their own batch-invariance test, at their
# rounding's tolerance.
EXACT = {"cpu_activations": "float32", "seed": 0}


@pytest.fixture(scope="module")
def exact(smollm2_llm):
    return smollm2_llm


@pytest.fixture(scope="module")
def alone(exact):
    return [_tokens(exact.generate(p, GREEDY, use_tqdm=False))[0] for p in MIXED_PROMPTS]


def test_batch_invariance(exact, alone):
    batched = _tokens(exact.generate(MIXED_PROMPTS, GREEDY))
    _check_same(exact, MIXED_PROMPTS, alone, batched, "batched")


def test_batch_invariance_with_int8_activations(smollm2_path):
    llm = LLM(str(smollm2_path), kv_cache_memory="128MiB", max_model_len=1024, seed=0)  # the default
    assert llm.engine.runner.model.int8_activations
    prompts = MIXED_PROMPTS[:8]
    single = [_tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    batched = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    _check_same(llm, prompts, single, batched, "batched int8", near_tie=INT8_NEAR_TIE)


def test_preemption_under_a_tiny_cache(smollm2_path, exact, alone):
    # 24 blocks of 16 = 384 tokens; the 16 requests need ~1,100 tokens at once
    llm = LLM(str(smollm2_path), num_kv_blocks=24, max_model_len=384, **EXACT)
    out = _tokens(llm.generate(MIXED_PROMPTS, GREEDY))
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == 24 and stats["num_running"] == 0
    _check_same(llm, MIXED_PROMPTS, alone, out, "preempted")


def test_prefix_cache_computes_only_new_tokens(smollm2_path):
    llm = LLM(str(smollm2_path), kv_cache_memory="64MiB", **EXACT)
    nocache = LLM(str(smollm2_path), kv_cache_memory="64MiB", enable_prefix_caching=False, **EXACT)
    tok = llm.get_tokenizer()
    system = "You are a careful assistant. Answer briefly and precisely. " * 12
    first, second = system + "What is 2+2?", system + "Name a color."
    shared = len(tok.encode(system))
    llm.generate(first, GREEDY, use_tqdm=False)
    before = llm.engine.stats()
    out = llm.generate(second, GREEDY, use_tqdm=False)[0]
    after = llm.engine.stats()
    n_prompt = len(out.prompt_token_ids)
    computed = after["prompt_tokens"] - before["prompt_tokens"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits == out.num_cached_tokens and hits >= shared - 16  # all full blocks of the shared part
    assert computed == n_prompt - hits
    assert computed < n_prompt - 100
    ref = nocache.generate(second, GREEDY, use_tqdm=False)[0]
    assert nocache.engine.stats()["prefix_cache_hits"] == 0
    _check_same(nocache, [second], [ref.outputs[0].token_ids], [out.outputs[0].token_ids], "prefix")


def test_prefix_cache_keys_do_not_collide_where_the_builtin_hash_does():
    """Two different blocks whose (parent, tokens) tuples have the same Python ``hash`` (the old
    key) get different keys, and a cached block is not served to the other sequence."""
    from tianxia.engine.block_manager import BlockManager, block_key
    from tianxia.engine.sequence import Sequence

    a, b = (0, 0), (2**61 - 1, 2**61 - 1)  # CPython hashes ints modulo 2**61 - 1
    assert hash((None, a)) == hash((None, b))
    assert block_key(None, a) != block_key(None, b)
    bm = BlockManager(num_blocks=8, block_size=2)
    first = Sequence("a", None, [*a, 5], SamplingParams())
    bm.allocate(first, len(first))
    first.num_computed_tokens = len(first)
    bm.cache_full_blocks(first)
    assert bm.lookup_prefix(Sequence("a2", None, [*a, 7], SamplingParams())) == first.block_table[:1]
    assert bm.lookup_prefix(Sequence("b", None, [*b, 5], SamplingParams())) == []


def test_cache_salt_keeps_prefixes_apart(smollm2_llm):
    """vLLM's ``cache_salt``: the same prompt under another salt is computed again (no shared
    blocks), under the same salt it hits the cache."""
    prompt = "Tenants keep their prefixes apart. " * 8 + "The answer is"
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(salt):
        request = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        return smollm2_llm.generate(request, params, use_tqdm=False)[0].num_cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 32
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    with pytest.raises(ValueError, match="cache_salt"):
        smollm2_llm.generate({"prompt": prompt, "cache_salt": ""}, params, use_tqdm=False)


def test_chunked_prefill_matches_unchunked(smollm2_path, exact):
    prompt = "The history of the printing press begins " + "in the fifteenth century, " * 40
    chunked = LLM(str(smollm2_path), kv_cache_memory="64MiB", max_num_batched_tokens=64, **EXACT)
    n = len(chunked.get_tokenizer().encode(prompt))
    assert n > 3 * 64
    got = _tokens(chunked.generate(prompt, GREEDY, use_tqdm=False))
    ref = _tokens(exact.generate(prompt, GREEDY, use_tqdm=False))
    _check_same(exact, [prompt], ref, got, "chunked")


def test_the_last_mlp_runs_on_the_sampled_rows_only(smollm2_llm, smollm2_reference):
    # a prompt needs every token's K/V but only its last row's hidden state: the last layer's MLP
    # sees one row per prompt (all rows where prompt logprobs need them), and the first token's
    # logprobs still match transformers
    import torch

    mlp = smollm2_llm.engine.runner.model.model.layers[-1].mlp
    rows: list[int] = []
    hook = mlp.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    prompts = ["The three primary colors are", "def fibonacci(n):\n    "]
    try:
        outs = smollm2_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                                    use_tqdm=False)
        assert rows == [2]
        rows.clear()
        smollm2_llm.generate(prompts[0] + " red,", SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        assert len(rows) == 1 and rows[0] > 1
    finally:
        hook.remove()
    for out in outs:
        with torch.no_grad():
            ref = smollm2_reference(torch.tensor([out.prompt_token_ids])).logits[0, -1].float().log_softmax(-1)
        entry = out.outputs[0].logprobs[0]
        assert out.outputs[0].token_ids[0] == int(ref.argmax())
        for token, lp in entry.items():
            assert abs(lp.logprob - ref[token].item()) < 1e-4


def test_stop_strings_eos_and_max_tokens(smollm2_llm):
    base = smollm2_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20))[0]
    text = base.outputs[0].text
    assert base.outputs[0].finish_reason in ("length", "stop")
    assert len(base.outputs[0].token_ids) <= 20
    stop = text.strip().split()[1]  # a word the model really produces
    out = smollm2_llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=20, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and text.startswith(out.text)
    chat = smollm2_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200))
    assert chat[0].outputs[0].finish_reason == "stop"  # ended by the model's EOS (<|im_end|>)


def test_seeded_sampling_is_reproducible(smollm2_llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    a = smollm2_llm.generate("Tell me a story about", p, use_tqdm=False)[0].outputs[0].token_ids
    b = smollm2_llm.generate(["Hello", "Tell me a story about", "World"], p)[1].outputs[0].token_ids
    c = smollm2_llm.generate("Tell me a story about", SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert a == b and a != c[0].outputs[0].token_ids


def test_prompt_longer_than_max_model_len(smollm2_llm):
    long = "word " * 3000
    with pytest.raises(ValueError, match="maximum context length is 2048"):
        smollm2_llm.generate(long, GREEDY, use_tqdm=False)
    assert smollm2_llm.engine.stats()["num_free_blocks"] == smollm2_llm.engine.block_manager.num_blocks


def test_unknown_model_lists_known_names():
    with pytest.raises(ModelNotFoundError) as e:
        LLM("no-such-model")
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"):
        assert name in str(e.value)


def test_truncated_gguf_is_a_clear_error(smollm2_path, tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(smollm2_path.stat().st_size // 2))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(bad))
    assert str(bad) in str(e.value) and "truncated" in str(e.value)


def test_garbage_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 4096)
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        LLM(str(bad))


def test_missing_tensor_is_named(smollm2_path, tmp_path):
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(smollm2_path))
    out = tmp_path / "missing.gguf"
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name == "blk.3.ffn_up.weight":
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=shape if t.tensor_type.name == "F32" else None,
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\): blk\.3\.ffn_up\.weight"):
        LLM(str(out))


def test_copied_gguf_path_loads(smollm2_path, tmp_path):
    # a GGUF anywhere on disk works, not just pulled names
    copy = tmp_path / "model.gguf"
    shutil.copy(smollm2_path, copy)
    llm = LLM(str(copy), kv_cache_memory="32MiB")
    assert llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def test_end_of_sequence_ids_outside_the_vocabulary_are_ignored(tmp_path, caplog):
    """A config whose eos_token_id the model cannot produce (copied from another model): the
    engine warns and ignores it, so min_tokens, which bans the EOS ids, still runs."""
    from helpers import make_tiny_hf_model, make_word_level_tokenizer

    tok = make_word_level_tokenizer(tmp_path / "tok", vocab_size=512)
    model = make_tiny_hf_model("qwen2", tmp_path / "m", tok, vocab_size=512, eos_token_id=151643,
                               num_hidden_layers=1)
    with caplog.at_level("WARNING", logger="tianxia.engine.llm_engine"):
        llm = LLM(str(model), kv_cache_memory="16MiB", max_model_len=128)
    assert "151643" in caplog.text and 151643 not in llm.engine.eos_ids
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, min_tokens=6),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
