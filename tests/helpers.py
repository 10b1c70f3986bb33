"""Comparison helpers shared by the tests."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import torch

NEAR_TIE = 1e-3
# With 8-bit activations (--cpu-activations int8) SmolLM2's logits move by up to 0.6-1.9 from the
# float32 path's (max over the vocabulary, measured on three prompts), and a float rounding
# difference between two int8 paths (BLAS blocking in prefill, say) can flip an activation's
# rounding: ties closer than this may break either way.
INT8_NEAR_TIE = 1.0

# transformers' tiny random models, one per architecture of the llama family
TINY_ARCHS = ("llama", "qwen2", "mistral")


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_match(
    expected: list[int],
    got: list[int],
    logits_at: Callable[[int], torch.Tensor],
    label: str = "",
    near_tie: float = NEAR_TIE,
) -> str:
    """Greedy tokens must match; a divergence is accepted only at a near-tie of the reference
    (a top-2 logit gap below ``near_tie``).

    ``logits_at(i)`` returns the reference's logits for output position ``i``. Returns a short
    report line (the tests print it so a run shows where ties happened).
    """
    i = first_divergence(expected, got)
    if i is None:
        return f"{label}: all {len(expected)} tokens equal"
    if i >= min(len(expected), len(got)):
        raise AssertionError(f"{label}: lengths differ ({len(expected)} vs {len(got)}) with equal prefix")
    gap = top2_gap(logits_at(i))
    assert gap < near_tie, (
        f"{label}: diverged at output token {i} ({expected[i]} vs {got[i]}) where the reference's "
        f"top-2 logit gap is {gap:.2e} (not a near-tie)\nexpected {expected}\ngot      {got}"
    )
    return f"{label}: diverged at token {i} at a near-tie (gap {gap:.2e})"


def make_tiny_hf_model(
    arch: str, out: Path, tokenizer_dir: Path, max_shard_size: str = "5GB", **overrides
) -> Path:
    """Save a randomly initialised transformers model of ``arch`` with a real tokenizer."""
    import shutil

    import transformers

    cls_cfg = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    kwargs = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=arch == "qwen2", bos_token_id=1, eos_token_id=2,
    )
    kwargs.update(overrides)
    # a seed of the name's bytes: hash() of a str changes with every process (PYTHONHASHSEED), and
    # a run that drew near-tied logits compared greedy tokens with transformers' / peft's unluckily
    torch.manual_seed(zlib.crc32(arch.encode()) % 1000)
    model = cls_cfg[1](cls_cfg[0](**kwargs)).eval()
    with torch.no_grad():  # random biases, so the qwen2 bias path is exercised for real
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def make_word_level_tokenizer(out: Path, vocab_size: int = 49152) -> Path:
    """A tokenizer of words ``t0`` .. ``t{vocab_size - 1}`` (EOS ``t2``): for tiny models on a
    machine without the pulled models (the GPU machine)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", unk_token="t0").save_pretrained(out)
    return out


def make_adapter(base: torch.nn.Module, out: Path, seed: int, **lora) -> Path:
    """A PEFT adapter over ``base`` with random, non-zero A and B (a trained adapter's shape)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(str(out))
    model.unload()  # the base's modules back as they were, for the next adapter
    return out


def reference(base: torch.nn.Module, adapter: Path | None, prompt_ids: list[int], tokens: list[int]):
    """transformers (+ peft) float32 at each output position given ``tokens`` as the output so far
    (one forward, teacher-forced): its greedy token and log-softmax per position. Where the
    greedy tokens equal ``tokens`` they are the reference's own greedy output."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, str(adapter)) if adapter else base
    try:
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt_ids) + list(tokens)])).logits[0]
    finally:
        if adapter:
            model.unload()
    lps = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)].float().log_softmax(-1)
    return [int(t) for t in lps.argmax(-1)], list(lps)


def use_triton_interpreter() -> bool:
    """Call at the top of a test module that runs Triton kernels, before they are imported: skips
    the module without Triton; without a GPU turns on Triton's interpreter (CPU tensors) and
    works around its NumPy >= 2.4 issue. Returns whether a GPU runs them instead."""
    import importlib.util
    import os
    import sys

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    if torch.cuda.is_available():
        return True
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter must be on before triton's own jit functions are defined
        pytest.skip("triton was imported before TRITON_INTERPRET could be set; run with "
                    "TRITON_INTERPRET=1", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    if not getattr(interpreter._patch_lang_tensor, "_loop_bound_fix", False):
        # the interpreter turns a loaded scalar (a 1-element array) into a loop bound with int(),
        # which NumPy >= 2.4 refuses for 1-d arrays; take the element instead
        original = interpreter._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _patch_lang_tensor._loop_bound_fix = True
        interpreter._patch_lang_tensor = _patch_lang_tensor
    return False


def exact_fp8_conversion(monkeypatch) -> None:
    """Make Triton's interpreter convert float32 to float8 e4m3 as the GPU and torch do (round to
    nearest even): its own conversion drops the carry of a round-up into the next binade (7.99 ->
    4 where it should be 8) and rounds ties away from zero."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            as_fp8 = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.float8_e4m3fn)
            return TensorHandle(as_fp8.view(torch.uint8).numpy(), dst_type.scalar)
        return original(self, src, dst_type, rounding_mode)

    monkeypatch.setattr(InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
