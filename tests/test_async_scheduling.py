"""Async scheduling (engine/overlap.py): a step of decodes launches its successor before its own
tokens are read. Greedy tokens match transformers, every request gets what it gets without it,
and aborts and early stops while a step is in flight lose nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_greedy_match

from tianxia import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def ahead_llm(smollm2_path):
    llm = LLM(str(smollm2_path), kv_cache_memory="256MiB", max_model_len=1024, seed=0, cpu_activations="float32",
              async_scheduling=True)
    assert llm.engine.async_scheduling
    return llm


def _free_blocks(llm: LLM) -> int:
    return llm.engine.block_manager.num_free_blocks


def test_greedy_tokens_launched_ahead_match_transformers(ahead_llm, smollm2_reference):
    tok = ahead_llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    before = ahead_llm.engine.num_steps_ahead
    outs = ahead_llm.generate([{"prompt_token_ids": i} for i in ids],
                              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    # every step after the prompts' but the last was launched before its predecessor's tokens were read
    assert ahead_llm.engine.num_steps_ahead - before >= 20
    for prompt, prompt_ids, out in zip(PROMPTS, ids, outs):
        with torch.no_grad():
            ref = smollm2_reference.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                             output_logits=True, return_dict_in_generate=True,
                                             eos_token_id=None, pad_token_id=0)
        logits = [step[0] for step in ref.logits]
        print(assert_greedy_match(ref.sequences[0, len(prompt_ids):].tolist(), out.outputs[0].token_ids,
                                  lambda i: logits[i], repr(prompt)))


def _mixed_params() -> list[SamplingParams]:
    # rows that can be sampled ahead (greedy, seeded sampling, min_tokens, logprobs, stop strings
    # that end a request while its next step runs) beside rows that cannot (penalties, n > 1
    # forks), ending at different steps
    return [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=20),
        SamplingParams(temperature=0, min_tokens=16, max_tokens=16, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, stop=[","]),
        SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=9, n=2),
        SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.3),
    ]


def _summary(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [{t: round(lp.logprob, 5) for t, lp in d.items()} for d in c.logprobs])
             for c in o.outputs] for o in outs]


def _with_and_without(llm: LLM, prompts, params) -> tuple[list, list, int]:
    engine = llm.engine
    engine.async_scheduling = False
    try:
        plain = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.async_scheduling = True
    before = engine.num_steps_ahead
    ahead = llm.generate(prompts, params, use_tqdm=False)
    return plain, ahead, engine.num_steps_ahead - before


def test_every_request_gets_what_it_gets_without_async_scheduling(ahead_llm):
    free = _free_blocks(ahead_llm)
    plain, ahead, num_ahead = _with_and_without(ahead_llm, [PROMPTS[i % len(PROMPTS)] for i in range(6)],
                                                _mixed_params())
    assert num_ahead > 0
    assert _summary(ahead) == _summary(plain)
    # rows that all sample ahead: a stop string ends one while its next step runs
    plain, ahead, num_ahead = _with_and_without(
        ahead_llm, [PROMPTS[2], PROMPTS[0]],
        [SamplingParams(temperature=0, max_tokens=40, stop=["."]),
         SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True)])  # all 30 steps
    assert _summary(ahead) == _summary(plain)
    assert ahead[0].outputs[0].finish_reason == "stop" and len(ahead[0].outputs[0].token_ids) < 20
    assert num_ahead >= 28
    # the stopped request's extra row and every ended request's slots went back
    assert _free_blocks(ahead_llm) == free


def test_an_abort_while_a_step_runs_ahead_loses_nothing(ahead_llm):
    engine = ahead_llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in ahead_llm.generate(PROMPTS, params, use_tqdm=False)]
    free = _free_blocks(ahead_llm)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, params)
    outputs = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        steps += 1
        if steps == 5:
            assert engine._launched is not None  # step 6 is already launched
            engine.abort_request("abort-1")
    assert "abort-1" not in engine.requests
    for i in (0, 2):
        out = outputs[f"abort-{i}"]
        assert out.finished and out.outputs[0].token_ids == reference[i], i
    assert _free_blocks(ahead_llm) == free


def _run_arrivals(engine, arrivals: dict[int, list], params: SamplingParams) -> dict[str, list[int]]:
    """Each request added before the step its entry names; tokens by request id."""
    outputs, step = {}, 0
    while engine.has_unfinished_requests() or step <= max(arrivals):
        for i, prompt in enumerate(arrivals.get(step, [])):
            engine.add_request(f"s{step}-{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        step += 1
    return outputs


def test_arrivals_and_prompt_chunks_join_steps_launched_ahead(smollm2_path):
    # a 32-token budget: long prompts arrive while others decode and are computed in chunks, in
    # steps scheduled before the previous step's tokens were read (decode rows reading step N's
    # ids beside prompt rows with their own)
    llm = LLM(str(smollm2_path), kv_cache_memory="128MiB", max_model_len=512, seed=0, cpu_activations="float32",
              max_num_batched_tokens=32, async_scheduling=True)
    engine = llm.engine
    long = "The history of the printing press begins in the fifteenth century, " * 6
    arrivals = {0: [PROMPTS[0]], 3: [long, PROMPTS[1]], 7: [PROMPTS[2] + long], 12: [PROMPTS[1]]}
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=21, max_tokens=16, ignore_eos=True)
    free = _free_blocks(llm)
    engine.async_scheduling = False
    plain = _run_arrivals(engine, arrivals, params)
    engine.async_scheduling = True
    mixed = []
    execute = engine.runner.execute

    def watch(step):
        if step.prev_rows is not None and min(step.prev_rows) < 0:
            mixed.append(len(step.input_ids))
        return execute(step)

    engine.runner.execute = watch
    try:
        ahead = _run_arrivals(engine, arrivals, params)
    finally:
        del engine.runner.execute
    assert ahead == plain
    assert mixed and max(mixed) > 8, mixed  # prompt chunks rode in steps launched ahead
    assert _free_blocks(llm) == free


def test_slots_that_a_step_ends_fill_in_the_step_launched_ahead(smollm2_path):
    # two slots, four requests of different lengths: a request that step N ends by max_tokens
    # gives its slot to a waiting one in step N+1, launched before step N's tokens are read, as
    # the scheduler after step N would (a batch left one short there each time a request ended
    # ran a served burst about a tenth below offline on a GPU)
    llm = LLM(str(smollm2_path), kv_cache_memory="128MiB", max_model_len=512, seed=0, cpu_activations="float32",
              max_num_seqs=2, async_scheduling=True)
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 11, 5, 9)]

    def run() -> tuple[list[int], dict[str, list[int]]]:
        for i, p in enumerate(params):
            engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], p)
        sizes, tokens = [], {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
            if engine.last_applied is not None:
                sizes.append(len(engine.last_applied.scheduled))
        return sizes, tokens

    engine.async_scheduling = False
    plain_sizes, plain = run()
    engine.async_scheduling = True
    ahead_before = engine.num_steps_ahead
    sizes, ahead = run()
    assert engine.num_steps_ahead - ahead_before > 10
    assert ahead == plain
    assert sizes == plain_sizes, (sizes, plain_sizes)
    assert sizes[:11] == [2] * 11  # both slots busy while a request waits


def test_async_scheduling_refuses_speculative_decoding():
    from tianxia.config import EngineConfig, SpeculativeConfig

    with pytest.raises(ValueError, match="async-scheduling cannot be combined with speculative"):
        EngineConfig(model="x", async_scheduling=True,
                     speculative=SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_steps_launched_ahead_give_what_plain_steps_give(tmp_path):
    """On a GPU async scheduling is on by default: its steps read their input tokens from the
    previous step's ids on the device and the host reads those ids after launching the next
    step. Greedy, seeded sampling and a stop token give the plain engine's tokens, and every
    block goes back (float32, a tiny random model)."""
    from helpers import make_tiny_hf_model, make_word_level_tokenizer

    model = str(make_tiny_hf_model("qwen2", tmp_path / "m", make_word_level_tokenizer(tmp_path / "tok"),
                                   num_hidden_layers=2))
    common = dict(device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=16, max_model_len=256)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": list(range(40, 90))},
               {"prompt_token_ids": [300, 301] * 10}]
    plain_llm = LLM(model, async_scheduling=False, **common)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    # a stop token from a probe of the same batch, the first after six that none of those six is:
    # the run then follows the probe up to it (min_tokens would mask it earlier and turn the run)
    probe = plain_llm.generate(prompts, params, use_tqdm=False)[2].outputs[0].token_ids
    stop = next((t for t in probe[6:] if t not in probe[:6]), probe[6])
    params[2] = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True)
    plain = _summary(plain_llm.generate(prompts, params, use_tqdm=False))
    del plain_llm
    llm = LLM(model, **common)
    engine = llm.engine
    assert engine.async_scheduling and engine.runner.graph_runner is not None
    free = _free_blocks(llm)
    got = _summary(llm.generate(prompts, params, use_tqdm=False))
    assert got == plain
    assert plain[2][0][2] == "stop"
    assert engine.num_steps_ahead > 15 and engine.runner._prev_tokens.is_cuda
    assert _free_blocks(llm) == free


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sampler_queues_constrained_rows_without_a_host_sync():
    """A step launched ahead samples on the device while its predecessor still runs, so the
    sampler must not wait for the stream: min_tokens bans, allowed_token_ids, logit biases,
    penalties and the seeded draw all go in without a synchronizing copy (CUDA's sync debug
    mode turns one into an error), and the result is the host path's."""
    from dataclasses import dataclass, field

    from tianxia.layers.sampler import Sampler, SamplingBatch, sampling_terms

    @dataclass
    class Row:  # what the sampler reads of a sequence
        params: SamplingParams
        output_token_ids: list[int]
        prompt_token_ids: list[int] = field(default_factory=lambda: [3, 4, 5])
        bad_words_ids: list[list[int]] = field(default_factory=list)
        generator: torch.Generator | None = None
        sample_seed: int | None = None
        grammar: None = None

        @property
        def num_output_tokens(self) -> int:
            return len(self.output_token_ids)

        @property
        def sampling_terms(self) -> tuple:
            return sampling_terms(self.params)

    rows = [Row(SamplingParams(temperature=0, min_tokens=8, stop_token_ids=[7]), [1, 2]),
            Row(SamplingParams(temperature=0, allowed_token_ids=[10, 11, 12]), [1]),
            Row(SamplingParams(temperature=0, logit_bias={20: 50.0, 21: -100.0}), []),
            Row(SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                               repetition_penalty=1.3), [30, 30, 31]),
            Row(SamplingParams(temperature=0.8, top_p=0.9, seed=5, min_tokens=4), [1], sample_seed=5)]
    batch = SamplingBatch.from_sequences(rows, eos_ids=(0,))
    logits = torch.randn(len(rows), 512, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(seed=0)
    expected = sampler.process(logits.clone(), batch)
    gpu_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        processed = sampler.process(gpu_logits.clone(), batch)
        tokens, dead = sampler.sample_on_device(gpu_logits.clone(), batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(processed.cpu(), expected)
    assert tokens.is_cuda and not bool(dead.any())
    assert int(tokens[1]) in (10, 11, 12) and int(tokens[2]) == 20 and int(tokens[0]) not in (0, 7)
