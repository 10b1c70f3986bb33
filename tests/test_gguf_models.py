"""Real GGUF models: our greedy tokens against transformers loading the same GGUF (float32)."""

from __future__ import annotations

import torch
from helpers import assert_greedy_match
from transformers import AutoModelForCausalLM

from tianxia import LLM, SamplingParams
from tianxia.layers.linear import SplitQuantizedLinear

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "The theory of relativity was developed by",
]
NEW_TOKENS = 32


def _reference(model, prompts_ids: list[list[int]]):
    results = []
    for ids in prompts_ids:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
            )
        tokens = out.sequences[0, len(ids):].tolist()
        results.append((tokens, [step[0] for step in out.logits]))
    return results


def _check_model(llm: LLM, reference) -> None:
    tok = llm.get_tokenizer()
    prompts_ids = [tok.encode(p) for p in PROMPTS]
    ours = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts_ids],
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    reports = []
    for prompt, (expected, logits), out in zip(PROMPTS, _reference(reference, prompts_ids), ours):
        reports.append(assert_greedy_match(expected, out.outputs[0].token_ids, lambda i: logits[i], repr(prompt)))
    print("\n".join(reports))


def test_smollm2_greedy_matches_transformers(smollm2_llm, smollm2_reference):
    _check_model(smollm2_llm, smollm2_reference)


def test_qwen2_greedy_matches_transformers(qwen_llm, qwen_path):
    llm = qwen_llm
    assert llm.engine.model_config.architecture == "qwen2"
    assert llm.engine.model_config.attention_bias
    reference = AutoModelForCausalLM.from_pretrained(
        str(qwen_path.parent), gguf_file=qwen_path.name, dtype=torch.float32
    ).eval()
    _check_model(llm, reference)


def test_qwen2_mixed_qkv_decodes_fused_as_in_the_module_path(qwen_llm):
    # half of this file's layers write v in Q8_0 beside a Q5_0 q and k: those projections keep
    # one packed part per type, in the module path and in the fused C++ decode step alike
    runner = qwen_llm.engine.runner
    model = runner.model.model
    split = [layer.self_attn.qkv_proj for layer in model.layers if isinstance(layer.self_attn.qkv_proj,
                                                                               SplitQuantizedLinear)]
    assert split and all(len(p.parts) == 2 for p in split)
    prompts = [{"prompt_token_ids": qwen_llm.get_tokenizer().encode(p)} for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    before = runner.route_counts["fused"]
    fused = qwen_llm.generate(prompts, params, use_tqdm=False)
    assert runner.route_counts["fused"] >= before + 11
    step, runner.decode_step = runner.decode_step, None  # the module forward
    try:
        plain = qwen_llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.decode_step = step
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t].logprob - step_b[t].logprob) < 1e-3 for t in step_a)


def test_gguf_metadata_gives_config_and_chat_template(smollm2_llm):
    cfg = smollm2_llm.engine.model_config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    ids = smollm2_llm.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert "<|im_start|>user\nHello<|im_end|>" in smollm2_llm.get_tokenizer().decode(ids)


def test_chat_answers_with_the_template(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )
    assert "Paris" in out[0].outputs[0].text
