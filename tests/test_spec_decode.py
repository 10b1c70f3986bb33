"""Speculative decoding (n-gram prompt lookup and a draft model): greedy output is the
non-speculative output token for token (and logprob for logprob) through mixed batches,
preemption, chunked prefill and prefix-cache hits; sampled output follows the target's exact
distribution (a chi-square test against the softmax of the target's own logits); constrained
requests keep their grammar; bad configurations are clear errors."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tianxia import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
         "disable_by_batch_size": None}

CODE = ("def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n"
        "Rewrite both functions with type hints:\n")
PROMPTS = [
    CODE,
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "The cat sat on the mat. The dog sat on the log. The cat",
    "Hi",
    CODE + "def area(",  # shares CODE's blocks: a prefix-cache hit
    "Once upon a time there was a king. Once upon a time there was a queen. Once upon a",
]


def mixed_params() -> list[SamplingParams]:
    """Greedy requests with every feature that changes a row's distribution by its history."""
    return [
        SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop=[" 14,"]),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.2,
                       presence_penalty=0.1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=10, logprobs=1, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, bad_words=["return"], ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={11: 2.0}),
    ]


def test_ngram_proposes_after_the_longest_latest_match():
    from tianxia.engine.spec_decode.ngram import NgramProposer

    ngram = NgramProposer(1, 3)
    #        the 3-gram [1, 2, 3] occurs twice before the end: the latest one is followed by 7, 8
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 6, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert ngram.propose(tokens, 2) == [7, 8]
    assert ngram.propose(tokens, 9) == [7, 8, 0, 1, 2, 3]  # up to the end of the context
    assert ngram.propose([5, 6, 7], 4) == []  # no earlier occurrence of any suffix
    assert NgramProposer(2, 3).propose([4, 1, 9, 1], 4) == []  # a 1-token match is below the minimum
    assert ngram.propose([4, 1, 9, 1], 4) == [9, 1]


def test_ngram_index_kept_as_a_sequence_grows_equals_a_full_scan():
    from tianxia.engine.spec_decode.ngram import NgramProposer

    def scan(tokens, k, lo, hi):  # the definition: latest earlier window equal to the suffix
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            for start in range(len(tokens) - 1 - n, -1, -1):
                if tokens[start : start + n] == tokens[len(tokens) - n :]:
                    return tokens[start + n : start + n + k]
        return []

    rng = random.Random(0)
    ngram = NgramProposer(2, 5)
    index = ngram.new_index()
    tokens = []
    for _ in range(400):  # a 4-token alphabet: matches of every length, changing as it grows
        tokens.append(rng.randrange(4))
        assert ngram.propose(tokens, 3, index) == scan(tokens, 3, 2, 5), len(tokens)


def answers(llm: LLM, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] + [o.prompt_logprobs]
            for o in outs]


def spec_counts(llm: LLM) -> tuple[int, int]:
    s = llm.engine.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def tight(model, spec, **kw) -> LLM:
    """Chunks of at most 24 tokens and a cache too small for every request at once."""
    return LLM(str(model), max_num_batched_tokens=24, num_kv_blocks=14, max_model_len=192,
               speculative_config=spec, **kw)


def check_greedy_identical(llm: LLM, reference: list) -> None:
    for rounds in range(2):  # the second round finds the first's blocks in the prefix cache
        assert answers(llm, PROMPTS, mixed_params()) == reference
    drafted, accepted = spec_counts(llm)
    assert accepted > 0 and drafted > accepted  # proposals were both taken and refused
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_hits > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_usable_blocks


@pytest.fixture(scope="module")
def smollm2_reference_answers(smollm2_llm):
    return answers(smollm2_llm, PROMPTS, mixed_params())


def test_ngram_greedy_output_is_the_plain_output(smollm2_path, smollm2_reference_answers):
    llm = tight(smollm2_path, NGRAM, cpu_activations="float32")
    check_greedy_identical(llm, smollm2_reference_answers)
    s = llm.engine.stats()
    assert s["spec_decode_num_drafts"] > 0
    assert sum(s["spec_decode_num_accepted_tokens_per_pos"]) == s["spec_decode_num_accepted_tokens"]


def test_seeded_samples_do_not_depend_on_the_batch_and_aborts_free_everything(smollm2_path):
    llm = LLM(str(smollm2_path), num_kv_blocks=64, max_model_len=256, speculative_config=NGRAM)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, n=2, max_tokens=24, logprobs=1)
    alone = answers(llm, [PROMPTS[2]], [seeded])
    mixed = answers(llm, PROMPTS, [seeded if i == 2 else p for i, p in enumerate(mixed_params())])
    assert mixed[2] == alone[0] and alone[0][0] != alone[0][1]
    assert spec_counts(llm)[1] > 0
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(6):
        engine.step()
    for i in range(len(PROMPTS)):
        engine.abort_request(f"a{i}")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_draft_model_greedy_output_is_the_plain_output(smollm2_path, tiny_models, smollm2_reference_answers):
    # a tiny random draft of the same vocabulary: mostly refused, never wrong
    llm = tight(smollm2_path, {"model": str(tiny_models["llama"]), "num_speculative_tokens": 3,
                               "disable_by_batch_size": None, "min_acceptance_rate": 0.0},
                cpu_activations="float32")
    for _ in range(2):
        assert answers(llm, PROMPTS, mixed_params()) == smollm2_reference_answers
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits > 0
    assert spec_counts(llm)[0] > 0


def test_model_as_its_own_draft_accepts_everything(smollm2_path, smollm2_reference_answers):
    llm = LLM(str(smollm2_path), num_kv_blocks=96, max_model_len=256, cpu_activations="float32",
              speculative_config={"model": str(smollm2_path), "num_speculative_tokens": 3,
                                  "disable_by_batch_size": None})
    assert answers(llm, PROMPTS, mixed_params()) == smollm2_reference_answers
    drafted, accepted = spec_counts(llm)
    # the draft's greedy tokens are the target's, except where a ban or penalty of the target's
    # sampling parameters (which the draft does not apply) changes them
    assert accepted > 0.8 * drafted


def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    obs = torch.tensor(observed, dtype=torch.float64)
    exp = torch.tensor(expected, dtype=torch.float64)
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


ALLOWED = [300, 301, 302]
PLAIN_T1 = dict(temperature=1.0)
# penalties make each row's distribution depend on the proposals before it
SHAPED = dict(temperature=0.7, top_p=0.9, min_p=0.05, presence_penalty=0.3, frequency_penalty=0.2,
              repetition_penalty=1.1)


@pytest.mark.parametrize("method, sampling", [("ngram", PLAIN_T1), ("draft_model", PLAIN_T1), ("ngram", SHAPED)])
def test_sampled_outputs_follow_the_target_distribution(tiny_models, method, sampling):
    """Three allowed tokens, three output tokens: the first comes from the prompt's row, the next
    two from a speculative step (one proposal, then the bonus or corrected token). The 27
    outcomes' counts are compared with the exact joint distribution of non-speculative sampling:
    the target's scored logits through the sampler's own processing, multiplied out."""
    from tianxia.engine.sequence import Sequence
    from tianxia.layers.sampler import Sampler, SamplingBatch

    spec = dict(NGRAM, num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2, min_acceptance_rate=0.0)
    if method == "draft_model":
        spec = {"model": str(tiny_models["qwen2"]), "num_speculative_tokens": 2, "disable_by_batch_size": None,
                "min_acceptance_rate": 0.0}
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=4096, max_model_len=64, max_num_seqs=256, seed=1,
              speculative_config=spec)
    allowed = ALLOWED
    prompt = [1, 300, 301, 302, 300, 302, 301, 300, 300, 301]
    draws, per_request = 3000, 250
    params = SamplingParams(max_tokens=3, allowed_token_ids=allowed, n=per_request, ignore_eos=True, **sampling)
    outs = llm.generate([{"prompt_token_ids": prompt}] * (draws // per_request), params, use_tqdm=False)
    counts = {}
    for o in outs:
        for c in o.outputs:
            counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    drafted, accepted = spec_counts(llm)
    assert drafted > 0.9 * draws and 0 < accepted < drafted  # (a step's token budget can cut a few)

    def dist(context: list[int]) -> torch.Tensor:
        logits = llm.engine.score(prompt + context)[-1:].float().clone()
        seq = Sequence("ref", None, prompt, params)
        seq.token_ids += context
        batch = SamplingBatch.from_sequences([seq], llm.engine.eos_ids)
        sampler = Sampler()
        return sampler.probs(sampler.process(logits, batch), batch)[0, allowed].double()

    expected, observed = [], []
    first = dist([])
    for i, a in enumerate(allowed):
        second = dist([a])
        for j, b in enumerate(allowed):
            third = dist([a, b])
            for k, c in enumerate(allowed):
                expected.append(float(first[i] * second[j] * third[k]) * draws)
                observed.append(counts.get((a, b, c), 0))
    assert sum(observed) == draws
    expected, observed = zip(*[(e, o) for e, o in zip(expected, observed) if e > 0 or o > 0])
    assert all(e > 0 for e in expected), "a sample the target cannot produce"
    assert _chi_square_p(observed, expected) > 1e-3, (observed, [round(e) for e in expected])


def test_constrained_request_keeps_its_schema_under_speculation(smollm2_path, smollm2_llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = 'Give {"name": "Ann", "age": 31} again as JSON: '
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": json.dumps(schema)})
    plain = smollm2_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(smollm2_path), num_kv_blocks=64, max_model_len=256, cpu_activations="float32",
              speculative_config=dict(NGRAM, prompt_lookup_min=1))
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.token_ids
    value = json.loads(out.text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert spec_counts(llm)[1] > 0


def test_draft_with_another_tokenizer_is_refused(smollm2_path, tiny_models, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models["llama"]))
    tok.add_tokens(["<not-in-the-target>"])
    other = tmp_path / "other"
    import shutil

    shutil.copytree(tiny_models["llama"], other)
    tok.save_pretrained(str(other))
    with pytest.raises(ValueError, match="different tokenizer from the target"):
        LLM(str(smollm2_path), num_kv_blocks=32, speculative_config={"model": str(other)})


@pytest.mark.parametrize("config, message", [
    ("{nope", "not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', r"num_speculative_tokens must be an integer in \[1, 32\]"),
    ('{"method": "ngram", "num_speculative_tokens": 40}', r"in \[1, 32\]"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "1 <= min <= max"),
    ('{"method": "eagle"}', "method must be one of"),
    ('{"num_speculative_tokens": 3}', 'give "method"'),
    ('{"method": "ngram", "lookahead": 3}', "unknown key"),
])
def test_bad_speculative_config_is_a_clear_error(config, message, capsys):
    from tianxia.cli import main

    assert main(["run", "-m", "smollm2-135m", "-p", "x", "--speculative-config", config]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert __import__("re").search(message, err[0])


def test_server_speculates_and_exports_vllms_counters(smollm2_path):
    import httpx

    from tianxia.server.testing import ServerProcess, metric

    # never switched off: the counters must see verifications of this short request
    config = json.dumps({**NGRAM, "min_acceptance_rate": 0.0})
    with ServerProcess([str(smollm2_path), "--served-model-name", "m", "--kv-cache-memory", "64MiB",
                        "--max-model-len", "256", "--speculative-config", config]) as srv:
        body = {"model": "m", "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and " 9, 10," in r.json()["choices"][0]["text"]
        text = httpx.get(srv.url + "/metrics", timeout=30).text
    drafted = metric(text, "vllm:spec_decode_num_draft_tokens_total", model_name="m")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total", model_name="m")
    first = metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="m", position="0")
    assert metric(text, "vllm:spec_decode_num_drafts_total", model_name="m") > 0
    assert drafted >= accepted > 0 and 0 < first <= accepted


def test_serve_with_a_bad_speculative_config_exits_with_one_line(smollm2_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tianxia.cli", "serve", str(smollm2_path), "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 99}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: speculative config: num_speculative_tokens")


@pytest.mark.parametrize("flags", [
    ["--speculative-config", json.dumps(NGRAM)],
    ["-md", "TINY", "--draft-max", "3", "--draft-min", "1"],
])
def test_run_prints_the_acceptance_rate(smollm2_path, smollm2_llm, tiny_models, flags, capsys):
    from tianxia.cli import main

    flags = [str(tiny_models["llama"]) if f == "TINY" else f for f in flags]
    assert main(["run", "-m", str(smollm2_path), "-p", PROMPTS[1], "-n", "12", "--temp", "0",
                 "--cpu-activations", "float32", *flags]) == 0
    out, err = capsys.readouterr()
    plain = smollm2_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert out == PROMPTS[1] + plain[0].outputs[0].text
    assert "acceptance rate" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("method", "max_num_seqs"), [("draft_model", 16), ("ngram", 16), ("draft_model", 8)])
def test_gpu_verification_runs_through_the_decode_graphs(tmp_path, method, max_num_seqs):
    """On a GPU a verification step (k + 1 rows a sequence) replays the decode graphs as one-token
    rows over their sequence's blocks: greedy output is the plain engine's, and no decode or
    verification step runs eagerly (float32, a tiny random model that is its own draft). With more
    rows than the graphs take (3 sequences x 4 rows > 8) the module forward verifies, as before."""
    from helpers import make_tiny_hf_model, make_word_level_tokenizer

    model = str(make_tiny_hf_model("qwen2", tmp_path / "m", make_word_level_tokenizer(tmp_path / "tok"),
                                   num_hidden_layers=2))
    spec = ({"model": model, "num_speculative_tokens": 3} if method == "draft_model" else
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    common = dict(device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=max_num_seqs, max_model_len=256)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": list(range(40, 90))},
               {"prompt_token_ids": [300, 301] * 10}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model, **common).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, speculative_config={**spec, "disable_by_batch_size": None, "min_acceptance_rate": 0.0},
              **common)
    runner = llm.engine.runner
    runner.route_counts.clear()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    assert spec_counts(llm)[1] > 0
    if max_num_seqs == 16:
        assert runner.route_counts["eager"] == 1, runner.route_counts  # the prompts' step only
