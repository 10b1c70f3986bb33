"""Tensor parallelism on CPU (gloo): the sharded model gives what the whole one gives.

Tiny random llama, qwen2 (tied head, q/k/v biases), qwen3 (q/k norms) and gemma3 (GeGLU,
sliding windows, Gemma norms) models and SmolLM2 dequantized to float32 (3 KV heads: an uneven
split) at TP=2: greedy tokens equal TP=1 and their logprobs agree within 1e-4, over prompts
prefilled in
chunks beside decodes, a prefix-cache hit and an n=2 request whose fork copies a block. Then
``tianxia serve -tp 2`` through the ``openai`` client, a killed worker, and the clean errors.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import time

import openai
import pytest

from tianxia import LLM, SamplingParams
from tianxia.server.testing import ServerProcess
from test_model_families import family_dirs, make_model, tiny_tokenizer_dir  # noqa: F401 (fixtures)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "a river of the cold wide line is the dog and the fox over the quick brown river " * 3,
    "The quick brown fox jumps over the lazy dog, and the river",  # shares a prefix with the first
    "fox",
]
LOGPROB_TOL = 1e-4


def _generate(model: str, tp: int, quantization: str = "none", **kwargs) -> list:
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory="64MiB", max_model_len=512,
              max_num_batched_tokens=24, quantization=quantization, cpu_activations="float32", **kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=4)
    forked = SamplingParams(temperature=0, max_tokens=6, n=2, logprobs=4)
    try:
        return llm.generate(PROMPTS + ["the dog jumps"], [greedy] * len(PROMPTS) + [forked], use_tqdm=False)
    finally:
        del llm
        gc.collect()  # stops rank 1 and ends the process group, so the next engine can start one


def _assert_same(one: list, two: list) -> None:
    for a, b in zip(one, two, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids, (a.prompt, ca.token_ids, cb.token_ids)
            for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert la.keys() == lb.keys()
                for tok in la:
                    assert abs(la[tok].logprob - lb[tok].logprob) < LOGPROB_TOL, (a.prompt, tok)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tiny_models_tp2_equal_tp1(arch, family_dirs):
    model = str(family_dirs(arch))
    _assert_same(_generate(model, 1), _generate(model, 2))


def test_kv_heads_replicated_when_ranks_exceed_them(tmp_path, tiny_tokenizer_dir):
    """One KV head, two ranks: each rank keeps its query heads and a copy of the KV head."""
    model = str(make_model("llama", tmp_path / "mqa", tiny_tokenizer_dir, num_key_value_heads=1))
    _assert_same(_generate(model, 1), _generate(model, 2))


def test_smollm2_tp2_equals_tp1(smollm2_path):
    """SmolLM2-135M's 3 KV heads (9 query heads) split unevenly: rank 0 holds 2, rank 1 one."""
    _assert_same(_generate(str(smollm2_path), 1), _generate(str(smollm2_path), 2))


def test_smollm2_packed_gguf_tp2_equals_tp1(smollm2_path):
    """Q4_1 projections and a Q8_0 tied embedding stay packed: each rank keeps whole rows and
    whole 32-value blocks."""
    _assert_same(_generate(str(smollm2_path), 1, "auto"), _generate(str(smollm2_path), 2, "auto"))


def test_indivisible_heads_is_a_clear_error(family_dirs):
    with pytest.raises(ValueError, match="does not divide this model's 4 attention heads and 2 KV heads"):
        LLM(str(family_dirs("llama")), tensor_parallel_size=3)


def test_port_in_use_is_a_clear_error(family_dirs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"--master-port {port} on 127.0.0.1 is in use"):
            LLM(str(family_dirs("llama")), tensor_parallel_size=2, master_port=port)


def test_a_hung_rank_times_out_with_its_name(family_dirs, monkeypatch):
    monkeypatch.setenv("TIANXIA_TP_TIMEOUT", "3")
    llm = LLM(str(family_dirs("llama")), tensor_parallel_size=2, kv_cache_memory="16MiB")
    worker = llm.engine.runner.model.workers.procs[0]
    os.kill(worker.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) stopped; collectives time out after 3s"):
        llm.generate("the fox", SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 15
    assert not worker.is_alive()  # stopped with the engine


def test_serve_tp2_matches_tp1_then_a_killed_worker_ends_it(smollm2_path):
    prompt = "The capital of France is"
    ref = LLM(str(smollm2_path), kv_cache_memory="64MiB", max_model_len=512, quantization="none",
              cpu_activations="float32")
    expected = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logprobs=1),
                            use_tqdm=False)[0].outputs[0]
    del ref
    gc.collect()
    srv = ServerProcess(["smollm2-135m", "-tp", "2", "--kv-cache-memory", "64MiB", "--max-model-len", "512",
                         "--cpu-activations", "float32", "--log-level", "info"])
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=10, temperature=0,
                                        logprobs=1)
        choice = out.choices[0]
        assert choice.text == expected.text
        for got, tok, want in zip(choice.logprobs.token_logprobs, expected.token_ids, expected.logprobs,
                                  strict=True):
            assert abs(got - want[tok].logprob) < LOGPROB_TOL

        worker = int(re.search(r"rank 1 ready \(pid (\d+)\)", srv.log()).group(1))
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        code = srv.wait(timeout=20)
        assert code != 0
        assert time.monotonic() - t0 < 10
        assert "tensor-parallel rank 1" in srv.log() and "exited with code -9" in srv.log()
