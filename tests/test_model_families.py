"""More architectures and RoPE scalings: tiny random transformers models, our logits vs theirs.

Every model here is saved as a Hugging Face directory with SmolLM2's tokenizer; our float32 logits
must match ``transformers`` (float32) to 1e-4 relative, with the prompt prefilled in chunks so
the paged-cache path (and its sliding windows) is exercised.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from tianxia import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. 天下 is a word; 🙂 emoji too, and 12345 digits."
VOCAB = 512  # the tiny byte-level BPE tokenizer below (GGUF round trips stay fast)
BASE = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "bos_token_id": 1, "eos_token_id": 2,
}

# arch -> (config class, model class, config overrides)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
    }),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_theta": 100000.0, "rope_local_base_freq": 1000.0,
    }),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24, "tie_word_embeddings": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "pad_token_id": 0}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16, "pad_token_id": 0}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {
        "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 256, "n_inner": None,
    }),
    "falcon": ("FalconConfig", "FalconForCausalLM", {
        "num_kv_heads": 2, "new_decoder_architecture": True, "bias": False,
    }),
    "falcon-mq": ("FalconConfig", "FalconForCausalLM", {
        "multi_query": True, "parallel_attn": True, "bias": True,
    }),
    "falcon-seq": ("FalconConfig", "FalconForCausalLM", {
        "multi_query": False, "parallel_attn": False, "bias": True,
    }),
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}
ARCHS = list(FAMILIES)

ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def make_model(name: str, out, tokenizer_dir, **overrides):
    import transformers

    if name in ROPE_SCALINGS:
        cfg_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
        kwargs = dict(BASE, rope_scaling=ROPE_SCALINGS[name], max_position_embeddings=16 if name == "dynamic" else 64)
    else:
        cfg_name, model_name, extra = FAMILIES[name]
        cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
        kwargs = dict(BASE)
        if name == "gpt2":
            kwargs = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2}
        elif name.startswith("falcon"):
            kwargs = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                          "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 1024}
        kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(sum(map(ord, name)))
    model = model_cls(cfg_cls(**kwargs)).eval()
    with torch.no_grad():  # random norms and biases, so offsets and biases are exercised for real
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname or ".ln_" in pname:
                p.normal_(0, 0.5) if pname.endswith("bias") else p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(out) -> None:
    """A byte-level BPE tokenizer with ``VOCAB`` entries, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = ["the", "a", "of", "river", "fox", "dog", "jumps", "over", "lazy", "quick", "brown", "cold", "wide", "line", "is", "and", "to", "in"]
    corpus = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(200)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("families")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = make_model(name, root / name, tiny_tokenizer_dir)
        return cache[name]

    return get


def reference_logits(model_dir, ids: list[int]) -> torch.Tensor:
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_family_logits_match_transformers(arch, family_dirs):
    model_dir = family_dirs(arch)
    llm = LLM(str(model_dir), num_kv_blocks=64, max_num_batched_tokens=8, block_size=4)
    ids = llm.get_tokenizer().encode(PROMPT)
    assert len(ids) > 16  # several chunks, and longer than the 8-token sliding windows
    err = rel_err(llm.engine.score(ids), reference_logits(model_dir, ids))
    assert err < 1e-4, err


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral-swa"])
def test_sliding_window_greedy_decode(arch, family_dirs):
    """Decoding past the window uses the windowed decode path; tokens equal transformers'."""
    model_dir = family_dirs(arch)
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4)
    ids = llm.get_tokenizer().encode(PROMPT)[:6]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = ref.generate(
        torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(ids):].tolist()
    assert out[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(kind, family_dirs):
    model_dir = family_dirs(kind)
    # dynamic NTK depends on the length of the forward pass, so it is scored in one chunk
    chunk = 256 if kind == "dynamic" else 8
    llm = LLM(str(model_dir), num_kv_blocks=64, max_num_batched_tokens=chunk, block_size=4, max_model_len=256)
    assert llm.engine.model_config.rope_scaling["rope_type"] == kind
    ids = llm.get_tokenizer().encode(PROMPT + " " + PROMPT)
    assert len(ids) > 48  # well past the original context (16), where the scalings differ
    err = rel_err(llm.engine.score(ids), reference_logits(model_dir, ids))
    assert err < 1e-4, err


# --- the real Gemma-3-270m GGUF (Q4_K_M mix), against transformers on the same file ---------------

GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
]
_FACTS = [
    "The lighthouse keeper counted {n} ships passing the harbour before noon.",
    "In the archive, drawer number {n} held letters written in faded blue ink.",
    "The baker sold {n} loaves of rye bread and kept the last one for himself.",
    "Station {n} on the mountain railway was closed every winter because of snow.",
]


def long_prompt(tokenizer, min_tokens: int = 600) -> list[int]:
    """A prompt longer than Gemma 3's 512-token sliding window, asking about its first line."""
    lines, i = ["The secret password is 'blue heron'. Remember it."], 0
    while len(tokenizer.encode(" ".join(lines))) < min_tokens:
        lines.append(_FACTS[i % len(_FACTS)].format(n=i + 3))
        i += 1
    lines.append("Question: what is the secret password? Answer: The secret password is")
    return tokenizer.encode(" ".join(lines))


@pytest.fixture(scope="module")
def gemma3_path():
    from tianxia.loader.hub import pull

    return pull("gemma-3-270m", quiet=True)


@pytest.mark.slow  # ~1-2 min: a 262K-token vocabulary, and transformers dequantizes the whole file
def test_gemma3_270m_gguf_greedy_matches_transformers(gemma3_path):
    from helpers import assert_greedy_match

    llm = LLM(str(gemma3_path), kv_cache_memory="256MiB", max_model_len=2048, cpu_activations="float32")
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.sliding_window, cfg.qk_norm) == ("gemma3", 512, True)
    assert cfg.layer_types.count("full_attention") == 3
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in GEMMA_PROMPTS] + [long_prompt(tok)]
    assert len(prompts[-1]) > 512
    new_tokens = 16
    ours = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
    )
    ref = AutoModelForCausalLM.from_pretrained(
        str(gemma3_path.parent), gguf_file=gemma3_path.name, dtype=torch.float32
    ).eval()
    reports = []
    for ids, out in zip(prompts, ours):
        with torch.no_grad():
            r = ref.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
            )
        expected = r.sequences[0, len(ids):].tolist()
        reports.append(assert_greedy_match(
            expected, out.outputs[0].token_ids, lambda i, r=r: r.logits[i][0], f"{len(ids)} tokens"
        ))
    print("\n".join(reports))


# --- long context -------------------------------------------------------------------------------


def test_32k_context_memory_per_token(tmp_path, tiny_tokenizer_dir):
    """A 32K-token context on a tiny model: the KV cache holds exactly the formula's bytes per token,
    the run allocates nothing that grows with the context, and the logits stay finite."""
    import transformers

    from tianxia.engine.model_runner import kv_bytes_per_token

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32768,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model_dir = tmp_path / "long"
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(model_dir))
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, model_dir / f.name)

    block = 16
    llm = LLM(str(model_dir), max_model_len=32768, kv_cache_memory="12MiB", block_size=block,
              max_num_batched_tokens=512, enable_prefix_caching=False)
    engine = llm.engine
    per_token = kv_bytes_per_token(engine.model_config, torch.float32)
    assert per_token == 2 * 1 * 1 * 16 * 4  # K and V x layers x kv heads x head_dim x fp32
    assert engine.runner.kv_cache_bytes == engine.runner.num_blocks * block * per_token
    assert engine.max_model_len == 32768

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    from tianxia.loader import release_freed_memory

    n = 32768 - 8
    ids = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    release_freed_memory()  # what earlier tests in this process freed must not count against the run
    before_rss = rss()
    engine.add_request("long", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
        for o in engine.step():
            out = o
        seq_len = n + (len(out.outputs[0].token_ids) if out else 0)
        if out is not None and not out.finished:
            # the sequence holds exactly ceil(len / block) blocks: bytes per token as predicted
            used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
            assert used == -(-seq_len // block)
            assert used * block * per_token / seq_len == pytest.approx(per_token, rel=block / seq_len)
    assert len(out.outputs[0].token_ids) == 8
    # no O(context^2) state survives the run (one 32K x 32K fp32 score matrix would be 4 GiB);
    # the KV cache itself was allocated up front. The bound leaves room for the allocator keeping
    # freed chunk-sized attention buffers.
    release_freed_memory()
    assert rss() - before_rss < 256 << 20


# --- the fused CPU decode step (models/llama_cpu_step.py) against the layer-by-layer path -----------

LLAMA_STYLE = ["llama", "qwen2", "qwen3", "phi3", "glm4", "gemma2", "gemma3", "mistral-swa"]


@pytest.mark.parametrize("arch", LLAMA_STYLE)
@pytest.mark.parametrize("kv", ["auto", "fp16"])
def test_fused_cpu_decode_matches_the_module_path(arch, kv, family_dirs):
    """Decode steps as one C++ call: the same tokens and logprobs as the module path, bit for bit
    (the same kernels in the same order), for a batch of sequences of different lengths decoding
    past the sliding windows (float32 and float16 caches)."""
    llm = LLM(str(family_dirs(arch)), num_kv_blocks=64, block_size=4, enable_prefix_caching=False,
              kv_cache_dtype=kv)
    runner = llm.engine.runner
    ids = llm.get_tokenizer().encode(PROMPT)
    prompts = [{"prompt_token_ids": ids[:n]} for n in (3, 6, 11)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=4)
    fused = llm.generate(prompts, params, use_tqdm=False)
    assert runner.route_counts["fused"] >= 13
    runner.decode_step = None  # every step takes the module forward
    plain = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
