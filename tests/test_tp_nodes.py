"""Tensor parallelism over two "nodes" on one machine (127.0.0.1, gloo): node 1 is a real
``tianxia serve --node-rank 1`` process holding rank 1, node 0 the engine (offline ``LLM``, or
``tianxia serve`` with the ``openai`` client). TP=2 over 2 nodes gives TP=1's greedy tokens and
logprobs within 1e-4; node 1 exits 0 once node 0 ends; a killed node 1 ends node 0 naming the
rank; bad flags are one-line errors.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from tianxia import LLM, SamplingParams
from tianxia.server.testing import ServerProcess, free_port
from test_model_families import family_dirs, tiny_tokenizer_dir  # noqa: F401, F811 (fixtures)
from test_tensor_parallel import LOGPROB_TOL, _assert_same, _generate


def _node1(model: str, port: int, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tianxia.cli", "serve", model, "-tp", "2", "--nnodes", "2", "--node-rank", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(port), "--log-level", "info"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def test_two_nodes_equal_tp1_then_node1_exits_cleanly(family_dirs):  # noqa: F811
    model = str(family_dirs("llama"))
    one = _generate(model, 1)
    port = free_port()
    node1 = _node1(model, port)
    try:
        two = _generate(model, 2, nnodes=2, master_port=port)  # ends node 0's engine
        code = node1.wait(timeout=30)
        out = node1.stdout.read()
        assert code == 0, out
        _assert_same(one, two)
    finally:
        if node1.poll() is None:
            node1.kill()


def test_node1_without_rank0_is_a_one_line_error(family_dirs):  # noqa: F811
    node1 = _node1(str(family_dirs("llama")), free_port(), env={"TIANXIA_TP_TIMEOUT": "3"})
    out, _ = node1.communicate(timeout=60)
    assert node1.returncode != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors and "tensor-parallel rank 1" in errors[0] and "rendezvous" in errors[0], out


def test_bad_flags_are_clear_errors(family_dirs, capsys):  # noqa: F811
    model = str(family_dirs("llama"))
    with pytest.raises(ValueError, match="does not divide evenly over --nnodes 2"):
        LLM(model, tensor_parallel_size=3, nnodes=2, master_port=free_port())
    with pytest.raises(ValueError, match="--nnodes > 1 needs --master-port"):
        LLM(model, tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="--node-rank must be in 0..1"):
        LLM(model, tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1234)
    from tianxia.cli import main

    assert main(["serve", model, "-tp", "2", "--nnodes", "2", "--node-rank", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --nnodes > 1 needs --master-port"), err


def test_serve_two_nodes_matches_tp1_then_a_killed_node_ends_it(family_dirs):  # noqa: F811
    model = str(family_dirs("llama"))
    prompt = "The quick brown fox"
    ref = LLM(model, kv_cache_memory="16MiB", max_model_len=256, cpu_activations="float32")
    expected = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    del ref
    gc.collect()
    port = free_port()
    env = {"TIANXIA_TP_HEARTBEAT_TIMEOUT": "3"}
    node1 = _node1(model, port, env)
    srv = ServerProcess([model, "-tp", "2", "--nnodes", "2", "--master-port", str(port), "--kv-cache-memory",
                         "16MiB", "--max-model-len", "256", "--cpu-activations", "float32", "--log-level", "info"],
                        env=env)
    try:
        with srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
            out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                                            extra_body={"ignore_eos": True})
            choice = out.choices[0]
            assert choice.text == expected.text
            for got, tok, want in zip(choice.logprobs.token_logprobs, expected.token_ids, expected.logprobs,
                                      strict=True):
                assert abs(got - want[tok].logprob) < LOGPROB_TOL
            os.killpg(node1.pid, signal.SIGKILL)  # the whole node: its process and its rank
            t0 = time.monotonic()
            code = srv.wait(timeout=30)
            assert code != 0
            assert time.monotonic() - t0 < 15
            assert "tensor-parallel rank 1" in srv.log() and "heartbeat" in srv.log(), srv.log()
    finally:
        if node1.poll() is None:
            node1.kill()
