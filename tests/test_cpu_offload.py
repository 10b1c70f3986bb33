"""``--cpu-offload-gb``: which layers stay in host memory, that a streamed layer computes what it
computes in place, and the clear refusal on a CPU device.

A GPU streams the offloaded layers' weights to itself each forward (measured in
``benchmarks/gpu_offload.py``); here the device is the host itself, which runs the same code: the
parameters materialized apart, the forward through ``functional_call`` on per-call copies.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tianxia.config import CacheConfig
from tianxia.engine.model_runner import ModelRunner
from tianxia.engine.step_io import TokenRun, prepare_batch
from tianxia.layers.attention import get_backend
from tianxia.loader import load_model
from tianxia.loader import offload

CPU = torch.device("cpu")


def _logits(loaded, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt through the model's module forward."""
    bs = 16
    runner = ModelRunner(loaded.model, loaded.config, CacheConfig(block_size=bs, num_blocks=4), CPU, torch.float32)
    run = TokenRun(tokens, 0, [0, 1])
    ids, pos, meta = runner.tensors(prepare_batch([(run, len(tokens))], bs)[1])
    with torch.inference_mode():
        hidden = loaded.model(ids, pos, runner.kv_caches, meta)
        return loaded.model.compute_logits(hidden)


def test_streamed_layers_give_the_same_logits(tiny_models):
    path = str(tiny_models["llama"])
    base = load_model(path, dtype=torch.float32, device=CPU, backend=get_backend(CPU), quantization="none")
    layers = offload.decoder_layers(base.model, base.config.num_hidden_layers)
    per_layer = offload.offloaded_bytes([layers[0]])
    # room for two layers and a half: the first two, whole
    moved = load_model(path, dtype=torch.float32, device=CPU, backend=get_backend(CPU), quantization="none",
                       cpu_offload_bytes=int(per_layer * 2.5))
    moved_layers = offload.decoder_layers(moved.model, moved.config.num_hidden_layers)
    streamed = ["forward" in vars(layer) for layer in moved_layers]
    assert streamed == [True, True] + [False] * (len(moved_layers) - 2)
    tokens = list(range(100, 120))
    want, got = _logits(base, tokens), _logits(moved, tokens)
    assert torch.equal(got, want)
    # the copies are per call: the layer's own parameters are still the host ones afterwards
    assert all(p.device.type == "cpu" for p in moved_layers[0].parameters())


def test_layers_to_offload_counts_whole_layers(tiny_models):
    loaded = load_model(str(tiny_models["qwen2"]), dtype=torch.float32, device=CPU, backend=get_backend(CPU),
                        quantization="none")
    layers = offload.decoder_layers(loaded.model, loaded.config.num_hidden_layers)
    one = offload.offloaded_bytes([layers[0]])
    assert offload.layers_to_offload(layers, one - 1, torch.float32) == []
    assert len(offload.layers_to_offload(layers, one, torch.float32)) == 1
    # bf16 weights take half the bytes: twice the layers in the same budget
    assert len(offload.layers_to_offload(layers, one, torch.bfloat16)) == 2
    assert len(offload.layers_to_offload(layers, 10**12, torch.float32)) == len(layers)


def test_cpu_offload_on_a_cpu_device_is_a_clear_error(tiny_models):
    from tianxia import LLM

    with pytest.raises(ValueError, match="--cpu-offload-gb .* on CPU they are there already"):
        LLM(str(tiny_models["llama"]), device="cpu", cpu_offload_gb=1)
    with pytest.raises(ValueError, match="--cpu-offload-gb must be at least 0"):
        LLM(str(tiny_models["llama"]), device="cpu", cpu_offload_gb=-1)
    r = subprocess.run([sys.executable, "-m", "tianxia.cli", "run", "-m", str(tiny_models["llama"]), "--device", "cpu",
                        "--cpu-offload-gb", "1", "-p", "hi", "-n", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "--cpu-offload-gb" in r.stderr and "Traceback" not in r.stderr
