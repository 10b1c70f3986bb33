"""LoRA adapters with tensor parallelism on CPU (gloo, 2 ranks of one thread each): every rank
holds its shard of every adapter. The base and three adapters mixed in one batch at TP=2 give the
greedy tokens and logprobs of ``transformers`` + ``peft`` (float32) and of TP=1, on tiny llamas
whose KV heads split evenly (2 over 2 ranks), unevenly (3: 2 and 1) and are replicated (1 on
both ranks). Adapters evicted from memory leave every rank and come back whole. Then
``tianxia serve -tp 2`` through the ``openai`` client: a start-up adapter, one loaded at run
time and unloaded, the same clear errors as with one rank, and no worker left once the server
has stopped.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import make_adapter, make_tiny_hf_model
from test_lora import ADAPTERS, NEW_TOKENS, PROMPTS, check_against_peft, generate_mixed
from test_lora_server import complete, greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from tianxia import LLM, SamplingParams
from tianxia.engine.lora_manager import LoRARequest
from tianxia.layers.lora import LoRAError
from tianxia.server.testing import ServerProcess

# head layouts of a tiny llama: KV heads split evenly, unevenly, replicated
SHAPES = {
    "even": {},
    "uneven": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
    "replicated": dict(num_key_value_heads=1),
}
LOGPROB_TOL = 1e-4


def _llm(model_dir: Path, tp: int) -> LLM:
    return LLM(str(model_dir), tensor_parallel_size=tp, threads=2, kv_cache_memory="32MiB", max_model_len=256,
               seed=0, cpu_activations="float32", enable_lora=True, max_loras=3, max_lora_rank=8)


def _adapters(model_dir: Path, root: Path):
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return base, {name: make_adapter(base, root / name, seed, **cfg)
                  for seed, (name, cfg) in enumerate(ADAPTERS.items())}


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (and been reaped) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("shape", list(SHAPES))
def test_base_and_three_adapters_in_one_batch_tp2_match_peft_and_tp1(shape, smollm2_tokenizer_dir, tmp_path):
    model_dir = make_tiny_hf_model("llama", tmp_path / "model", smollm2_tokenizer_dir, **SHAPES[shape])
    base, adapters = _adapters(model_dir, tmp_path)
    one_rank = _llm(model_dir, 1)
    _, tp1 = generate_mixed(one_rank, adapters, PROMPTS)
    del one_rank

    llm = _llm(model_dir, 2)
    state = llm.engine.lora_manager.state
    slots_per_step: list[set[int]] = []
    begin = state.begin_step
    state.begin_step = lambda rows, keep: (slots_per_step.append({s for s in rows if s >= 0}), begin(rows, keep))[1]
    tp2 = check_against_peft(llm, base, adapters, PROMPTS, f"{shape}/tp2", fused_decode=False)
    assert max(len(slots) for slots in slots_per_step) == len(adapters)  # all three in one step
    for a, b in zip(tp1, tp2, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids, (shape, a.prompt)
        for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < LOGPROB_TOL for t in la), (shape, a.prompt)

    # a row's products do not depend on its batch on any rank: one job alone, its decode steps
    # batches of one, gives the bits it got among the sixteen
    alone = llm.generate({"prompt_token_ids": tp2[-1].prompt_token_ids}, SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, logprobs=1, ignore_eos=True), use_tqdm=False,
        lora_request=LoRARequest("mlp", 3, str(adapters["mlp"])))[0].outputs[0]
    assert alone.token_ids == tp2[-1].outputs[0].token_ids
    assert alone.logprobs == tp2[-1].outputs[0].logprobs

    workers = llm.engine.runner.model.workers.procs
    del llm, state, begin
    gc.collect()  # stops rank 1 and ends the process group, so the next engine can start one
    assert not any(p.is_alive() for p in workers)


def test_evicted_adapters_come_back_and_bad_ones_are_the_one_rank_errors(smollm2_tokenizer_dir, tmp_path):
    """One adapter held at a time (--max-cpu-loras 1): each new one drops the last from every
    rank, and one read again gives the tokens and logprobs it gave the first time. A bad adapter
    is checked against the whole model, with the error one rank gives."""
    model_dir = make_tiny_hf_model("llama", tmp_path / "model", smollm2_tokenizer_dir, **SHAPES["uneven"])
    base, adapters = _adapters(model_dir, tmp_path)
    high_rank = make_adapter(base, tmp_path / "r32", 3, r=32, lora_alpha=32, target_modules=["q_proj"])
    narrow_dir = make_tiny_hf_model("llama", tmp_path / "narrow", smollm2_tokenizer_dir)
    narrow = AutoModelForCausalLM.from_pretrained(str(narrow_dir), dtype=torch.float32)
    other_base = make_adapter(narrow, tmp_path / "narrow-qv", 0, r=4, target_modules=["q_proj", "v_proj"])
    llm = LLM(str(model_dir), tensor_parallel_size=2, threads=2, kv_cache_memory="32MiB", max_model_len=256,
              cpu_activations="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=1, ignore_eos=True)
    requests = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]

    def run(lora: LoRARequest):
        out = llm.generate(PROMPTS[0], params, use_tqdm=False, lora_request=lora)[0].outputs[0]
        return out.token_ids, out.logprobs

    first = [run(r) for r in requests]
    assert len({tuple(tokens) for tokens, _ in first}) == len(requests)  # the adapters differ
    assert [run(r) for r in reversed(requests)] == first[::-1]
    assert len(llm.engine.lora_manager.state.slots) == 1

    for i, (path, words) in enumerate({high_rank: "above --max-lora-rank 8",
                                       other_base: "another base model"}.items()):
        with pytest.raises(LoRAError, match=words) as err:
            llm.generate("Hi", params, use_tqdm=False, lora_request=LoRARequest(f"bad{i}", 10 + i, str(path)))
        assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        llm.generate("Hi", params, use_tqdm=False, lora_request=LoRARequest("nope", 20))
    assert run(requests[0]) == first[0]  # and it serves on
    del llm
    gc.collect()


def test_serve_tp2_loads_adapters_at_run_time_and_leaves_no_worker(smollm2_tokenizer_dir, tmp_path):
    model_dir = make_tiny_hf_model("llama", tmp_path / "model", smollm2_tokenizer_dir, **SHAPES["uneven"])
    base, adapters = _adapters(model_dir, tmp_path)
    high_rank = make_adapter(base, tmp_path / "r32", 3, r=32, lora_alpha=32, target_modules=["q_proj"])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    srv = ServerProcess([
        str(model_dir), "--served-model-name", "tiny", "-tp", "2", "--threads", "2", "--kv-cache-memory", "32MiB",
        "--max-model-len", "256", "--cpu-activations", "float32", "--enable-lora", "--max-loras", "3",
        "--max-lora-rank", "8", "--allow-runtime-lora-updating", "--lora-modules", f"qv={adapters['qv']}",
        "--log-level", "info",
    ])
    with srv:
        http = httpx.Client(base_url=srv.url, timeout=300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(adapters["all"])})
        assert r.status_code == 200, r.text
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(high_rank)})
        assert r.status_code == 400 and "above --max-lora-rank 8" in r.json()["error"]["message"], r.text
        assert {m.id: m.parent for m in client.models.list().data} == {"tiny": None, "qv": "tiny", "all": "tiny"}

        jobs = [(name, tokenizer.encode(p)) for name in ("tiny", "qv", "all") for p in PROMPTS[:2]]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: complete(client, *job), jobs))
        for (name, ids), (text, logprobs) in zip(jobs, results):
            ref_tokens, ref_lps = greedy(base, adapters.get(name), ids)
            assert text == tokenizer.decode(ref_tokens, skip_special_tokens=True), name
            for i, (t, lp) in enumerate(zip(ref_tokens, logprobs)):
                assert abs(lp - ref_lps[i][t].item()) < LOGPROB_TOL, (name, i)

        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 200
        with pytest.raises(openai.NotFoundError) as err:
            complete(client, "all", jobs[0][1])
        assert err.value.body["code"] == "model_not_found"
        assert complete(client, "qv", jobs[2][1]) == results[2]
        worker = int(re.search(r"rank 1 ready \(pid (\d+)\)", srv.log()).group(1))
    assert srv.proc.returncode == 0, srv.log()[-3000:]
    assert _gone(worker), f"tensor-parallel rank 1 (pid {worker}) outlived the server"
