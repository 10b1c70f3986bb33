"""``-ngl`` / ``--n-gpu-layers``: llama.cpp's placement of layers between CPU and GPU, the refusal of
what it cannot be combined with, the warning without a GPU, and on a GPU (skipped on CPU-only
machines) that a split model computes what the whole model computes on the GPU, through the
engine (continuous batching, prefix caching) and the server.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tianxia.config import EngineConfig
from tianxia.loader.layer_split import LayerPlacement, LayerSplit
from tianxia.models.llama import LlamaForCausalLM

from helpers import make_tiny_hf_model, make_word_level_tokenizer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    ("n", "gpu_layers", "output_on_gpu"),
    [(0, 0, False), (1, 1, False), (4, 4, False), (6, 6, False), (7, 6, True), (99, 6, True)],
)
def test_placement_follows_llama_cpp(n, gpu_layers, output_on_gpu):
    """The last N layers go to the GPU; the output layer only when N exceeds the layer count."""
    p = LayerPlacement.from_n_gpu_layers(n, 6)
    assert (p.gpu_layers, p.output_on_gpu) == (gpu_layers, output_on_gpu)
    assert [p.layer_on_gpu(i) for i in range(6)] == [i >= 6 - gpu_layers for i in range(6)]
    assert p.split == (not output_on_gpu)


def test_modules_and_checkpoint_tensors_are_placed_by_layer():
    split = LayerSplit(LlamaForCausalLM.layer_split_plan, LayerPlacement.from_n_gpu_layers(2, 4),
                       torch.device("cuda"), torch.bfloat16)
    assert not split.on_gpu("model.layers.1.self_attn.qkv_proj")
    assert split.on_gpu("model.layers.2.mlp.down_proj.weight")
    assert split.on_gpu("model.layers.3")
    assert not split.on_gpu("model.embed_tokens.weight")  # llama.cpp's input layer: the CPU
    assert not split.on_gpu("lm_head.weight") and not split.on_gpu("model.norm.weight")
    assert split.packed("model.layers.0.mlp.gate_proj.weight") and not split.packed("model.layers.3.mlp.up_proj.weight")
    assert split.place("model.layers.0")[1] == torch.float32 and split.place("model.layers.3")[1] == torch.bfloat16


@pytest.mark.parametrize("clash", [dict(cpu_offload_gb=1.0), dict(tensor_parallel_size=2),
                                   dict(kv_cache_dtype="fp8")])
def test_combinations_not_built_are_refused(clash):
    with pytest.raises(ValueError, match="--n-gpu-layers cannot be combined with"):
        EngineConfig(model="m", n_gpu_layers=2, **clash)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_without_a_gpu_the_option_is_ignored_with_a_warning(tiny_models, caplog):
    from tianxia import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 300, 42]}]
    plain = LLM(str(tiny_models["llama"]), device="cpu", num_kv_blocks=16).generate(prompt, params, use_tqdm=False)
    with caplog.at_level(logging.WARNING):
        split = LLM(str(tiny_models["llama"]), device="cpu", num_kv_blocks=16, n_gpu_layers=1)
    assert "--n-gpu-layers 1 ignored: no GPU" in caplog.text
    assert split.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


# --- on a GPU --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random llama (untied head) and qwen2 (tied, biases) models with a word-level tokenizer
    (no tokenizer download needed on a GPU machine)."""
    root = tmp_path_factory.mktemp("split")
    tok_dir = make_word_level_tokenizer(root / "tok")
    return {a: make_tiny_hf_model(a, root / a, tok_dir, num_hidden_layers=4) for a in ("llama", "qwen2")}


def _generate(llm, prompts: list[list[int]], n: int = 12):
    from tianxia import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs]


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_split_model_computes_what_the_gpu_computes(gpu_models, arch):
    """float32 on both sides: -ngl 0 (all on the CPU but the sampler), 1, 4 (every layer, the
    output layer on the CPU) and 5 (all on the GPU) give the whole GPU model's greedy tokens and
    logprobs, for a batch of prompts of which two share a prefix (continuous batching, prefix
    caching)."""
    from tianxia import LLM

    shared = list(range(100, 148))
    prompts = [shared + [7, 8, 9], [5, 17, 300, 42], shared + [11], list(range(900, 960))]
    common = dict(device="cuda", dtype="float32", num_kv_blocks=64, block_size=16, max_num_seqs=8)
    ref = _generate(LLM(str(gpu_models[arch]), **common), prompts)
    for n in (0, 1, 4, 5):
        llm = LLM(str(gpu_models[arch]), n_gpu_layers=n, **common)
        runner = llm.engine.runner
        devices = [c.device.type for c in runner.kv_caches]
        assert devices == ["cpu"] * (4 - min(n, 4)) + ["cuda"] * min(n, 4)
        got = _generate(llm, prompts)
        for (tokens, lps), (ref_tokens, ref_lps) in zip(got, ref):
            assert tokens == ref_tokens, (n, tokens, ref_tokens)
            assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-3
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_usable_blocks
        del llm, runner
        torch.cuda.empty_cache()


@cuda
def test_server_with_a_split_model_answers(gpu_models, tmp_path):
    """``tianxia serve -ngl 2`` serves completions (bf16 GPU layers beside float32 CPU layers)."""
    port = 18677
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tianxia.cli", "serve", str(gpu_models["llama"]), "--port",
                             str(port), "-ngl", "2", "--max-model-len", "256"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(1)
        name = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())["data"][0]["id"]
        body = json.dumps({"model": name, "prompt": "t5 t17 t300", "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"]
        assert "2 of 4 decoder layers on the GPU" in (tmp_path / "server.log").read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
