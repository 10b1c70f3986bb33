"""tianxia.lang with the real SmolLM2: programs in-process (Runtime), against a real ``tianxia
serve`` (RuntimeEndpoint), and through the OpenAI-compatible backend; select checked against
scores computed here from prompt logprobs; prefix reuse checked on the engine's cache counters."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest

import tianxia.lang as sgl
from tianxia.sampling_params import SamplingParams

HAS_STRUCTURED = "structured_outputs" in {f.name for f in dataclasses.fields(SamplingParams)}
needs_structured = pytest.mark.skipif(
    not HAS_STRUCTURED, reason="the engine has no SamplingParams.structured_outputs yet"
)

FEWSHOT = (
    "Answer each question with the name of a city.\n"
    "Q: Which city is the capital of Japan?\nA: Tokyo\n"
    "Q: Which city is the capital of Spain?\nA: Madrid\n"
    "Q: Which city is the capital of Germany?\nA: Berlin\n"
)
CHOICES = [" Paris", " London", " Rome", " the largest city of Australia"]


@pytest.fixture(scope="module")
def runtime(smollm2_path):
    # exact products: the prefix-cache test below compares logprobs computed by different paths
    # at 2e-4, closer than the default 8-bit activations keep them (see docs/ARCHITECTURE.md)
    rt = sgl.Runtime(str(smollm2_path), kv_cache_memory="256MiB", max_model_len=2048, seed=0,
                     cpu_activations="float32")
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def server(smollm2_path):
    from tianxia.server.testing import ServerProcess

    with ServerProcess(
        [str(smollm2_path), "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
         "--served-model-name", "smollm2-135m", "--cpu-activations", "float32"]  # as `runtime`
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def endpoint(server):
    backend = sgl.RuntimeEndpoint(server.url)
    yield backend
    backend.shutdown()


def scores_from_prompt_logprobs(runtime, prefix_ids, choices):
    """Mean logprob of each choice's tokens after ``prefix_ids``, from full prompt logprobs."""
    tok = runtime.get_tokenizer()
    choice_ids = [tok.encode(c, add_special_tokens=False) for c in choices]
    outs = runtime.generate_requests(
        [prefix_ids + c for c in choice_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    )
    n = len(prefix_ids)
    scores = []
    for c, out in zip(choice_ids, outs):
        assert out.num_cached_tokens == 0  # every position computed: an independent reference
        lps = [out.prompt_logprobs[n + j][t].logprob for j, t in enumerate(c)]
        scores.append(sum(lps) / len(lps))
    return scores


@sgl.function
def capital(s, question):
    s += FEWSHOT + "Q: " + question + "\nA:"
    s += sgl.select("city", CHOICES)


def test_select_picks_the_best_mean_logprob_and_reuses_the_prefix(runtime):
    question = "Which city is the capital of France?"
    state = capital.run(question=question, backend=runtime)
    assert state.error() is None
    tok = runtime.get_tokenizer()
    prefix_ids = tok.encode(FEWSHOT + "Q: " + question + "\nA:")
    expected = scores_from_prompt_logprobs(runtime, prefix_ids, CHOICES)
    meta = state.get_meta_info("city")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(expected, abs=2e-4)
    assert state["city"] == CHOICES[max(range(len(CHOICES)), key=expected.__getitem__)]
    assert state.text() == FEWSHOT + "Q: " + question + "\nA:" + state["city"]
    # each choice's request took the prefix's full blocks from the cache (one batched pass)
    full = len(prefix_ids) // 16 * 16
    assert full >= 48 and all(c >= full for c in meta["cached_tokens"]), meta["cached_tokens"]


def test_greedy_token_selection_method(runtime):
    @sgl.function
    def prog(s):
        s += FEWSHOT + "Q: Which city is the capital of Italy?\nA:"
        s += sgl.select("city", CHOICES, choices_method=sgl.greedy_token_selection)

    state = prog.run(backend=runtime)
    matrix = state.get_meta_info("city")["greedy_logprob_matrix"]
    firsts = [row[0] for row in matrix]
    assert state["city"] == CHOICES[firsts.index(max(firsts))]


def test_engine_prompt_logprobs_start_lets_the_prefix_hit_the_cache(runtime):
    """The engine hook select relies on: prompt logprobs from position k only, the blocks before
    k - 1 taken from the prefix cache, the values equal to a full computation."""
    tok = runtime.get_tokenizer()
    ids = tok.encode(FEWSHOT + "Q: Which city is the capital of Chile?\nA: Santiago")
    k = len(ids) - 3
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    full, = runtime.generate_requests([ids], params)  # computes every position, caches the blocks
    part, = runtime.generate_requests([{"prompt_token_ids": ids, "prompt_logprobs_start": k}], params)
    assert full.num_cached_tokens == 0 and part.num_cached_tokens == (k - 1) // 16 * 16 > 0
    assert all(p is None for p in part.prompt_logprobs[:k])
    for i in range(k, len(ids)):
        assert part.prompt_logprobs[i][ids[i]].logprob == pytest.approx(
            full.prompt_logprobs[i][ids[i]].logprob, abs=2e-4)


@sgl.function
def react(s, question):
    s += FEWSHOT + "Q: " + question + "\n"
    for step in range(3):
        s += f"Thought {step + 1}:" + sgl.gen(f"thought{step}", max_tokens=6, stop="\n", temperature=0)
        s += f"\nObservation {step + 1}: nothing found.\n"


def test_each_gen_prefills_only_the_new_text(runtime):
    state = react.run(question="Which city is the capital of Peru?", backend=runtime)
    assert state.error() is None
    metas = [state.get_meta_info(f"thought{i}") for i in range(3)]
    for prev, cur in itertools.pairwise(metas):
        # the previous prompt (and the output kept) are in the cache: only the new text is prefilled
        assert cur["cached_tokens"] >= prev["prompt_tokens"] // 16 * 16, metas
        assert cur["prompt_tokens"] - cur["cached_tokens"] < 16 + 20, metas
    # the ids the engine saw decode to exactly the state's text
    cache = state.stream_executor.backend_state["tokens"]
    assert runtime.get_tokenizer().decode(list(cache.ids)) == cache.text
    assert state.text().startswith(cache.text)
    for i in range(3):
        assert "\n" not in state[f"thought{i}"]


def test_forks_share_the_prefix(runtime):
    @sgl.function
    def tips(s):
        s += FEWSHOT + "Now three more questions, each about a different country.\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Q{i}: Which city is the capital of " + ["Chile", "Kenya", "Canada"][i] + "?\nA:"
            f += sgl.gen("answer", max_tokens=3, stop="\n", temperature=0)
        forks.join()

    before = runtime.stats()["prefix_cache_hits"]
    state = tips.run(backend=runtime)
    assert state.error() is None
    assert isinstance(state["answer"], list) and len(state["answer"]) == 3
    prefix_len = len(runtime.get_tokenizer().encode(
        FEWSHOT + "Now three more questions, each about a different country.\n"))
    full = prefix_len // 16 * 16
    hits = runtime.stats()["prefix_cache_hits"] - before
    assert hits >= 3 * full, (hits, full)


def test_roles_use_the_model_chat_template(runtime):
    @sgl.function
    def chat(s):
        s += sgl.system("You answer in one word.")
        s += sgl.user("What color is the sky?")
        s += sgl.assistant(sgl.gen("a1", max_tokens=4, temperature=0))
        s += sgl.user_begin() + "And grass?" + sgl.user_end()
        s += sgl.assistant_begin()
        s += sgl.gen("a2", max_tokens=4, temperature=0)
        s += sgl.assistant_end()

    state = chat.run(backend=runtime)
    assert state.error() is None
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["a1"].lstrip() and messages[4]["content"] == state["a2"].lstrip()
    tok = runtime.get_tokenizer()
    rendered = tok.apply_chat_template(messages, chat_template=runtime.engine.chat_template, tokenize=False)
    assert state.text() == rendered


def test_run_batch_batches_programs_and_stream(runtime):
    questions = ["Which city is the capital of Egypt?", "Which city is the capital of Norway?",
                 "Which city is the capital of Greece?", "Which city is the capital of Cuba?"]

    @sgl.function
    def qa(s, question):
        s += FEWSHOT + "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=3, stop="\n")

    before = runtime.stats()
    states = qa.run_batch([{"question": q} for q in questions], num_threads=4, progress_bar=True,
                          backend=runtime, temperature=0)
    after = runtime.stats()
    assert [s.error() for s in states] == [None] * 4
    assert all(s.text().startswith(FEWSHOT + "Q: " + q) for s, q in zip(states, questions))
    # the shared few-shot text was prefilled once (precache), then hit by all four programs
    full = len(runtime.get_tokenizer().encode(FEWSHOT)) // 16 * 16
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 4 * full
    assert runtime.async_engine.max_step_seqs >= 2  # concurrent programs shared engine steps

    state = qa.run(question=questions[0], backend=runtime, stream=True, temperature=0)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text() == states[0].text()


@needs_structured
def test_regex_and_json_schema_gens(runtime):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }

    @sgl.function
    def prog(s):
        s += "The area code of the city is "
        s += sgl.gen("code", max_tokens=6, regex=r"[0-9]{3}", temperature=0)
        s += ". The city as JSON: "
        s += sgl.gen("info", max_tokens=32, json_schema=json.dumps(schema), temperature=0)
        s += "\nNumber of districts: " + sgl.gen_int("districts", max_tokens=4, temperature=0)

    state = prog.run(backend=runtime)
    assert state.error() is None
    assert re.fullmatch(r"[0-9]{3}", state["code"])
    info = json.loads(state["info"])
    assert set(info) >= {"city", "population"} and isinstance(info["population"], int)
    assert re.fullmatch(r"[-+]?[0-9]+", state["districts"].strip())


def test_runtime_endpoint_program(endpoint, runtime):
    question = "Which city is the capital of France?"
    state = capital.run(question=question, backend=endpoint)
    assert state.error() is None
    local = capital.run(question=question, backend=runtime)
    assert state["city"] == local["city"]
    assert state.get_meta_info("city")["normalized_prompt_logprobs"] == pytest.approx(
        local.get_meta_info("city")["normalized_prompt_logprobs"], abs=2e-4)

    state = react.run(question="Which city is the capital of Peru?", backend=endpoint)
    assert state.error() is None
    metas = [state.get_meta_info(f"thought{i}") for i in range(3)]
    for prev, cur in itertools.pairwise(metas):
        assert cur["cached_tokens"] >= prev["prompt_tokens"] // 16 * 16, metas

    @sgl.function
    def chat(s):
        s += sgl.system("You answer in one word.")
        s += sgl.user("What color is the sky?")
        s += sgl.assistant(sgl.gen("a", max_tokens=4, temperature=0))
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += sgl.user(["And grass?", "And snow?"][i])
            f += sgl.assistant(sgl.gen("b", max_tokens=3, temperature=0))
        forks.join()

    state = chat.run(backend=endpoint)
    assert state.error() is None
    assert len(state["b"]) == 2
    tok = runtime.get_tokenizer()
    rendered = tok.apply_chat_template(state.messages(), chat_template=runtime.engine.chat_template, tokenize=False)
    assert state.text() == rendered


@needs_structured
def test_runtime_endpoint_regex(endpoint):
    @sgl.function
    def prog(s):
        s += "The area code of the city is " + sgl.gen("code", max_tokens=6, regex=r"[0-9]{3}", temperature=0)

    state = prog.run(backend=endpoint)
    assert state.error() is None and re.fullmatch(r"[0-9]{3}", state["code"])


def test_openai_backend_against_a_real_server(server, runtime):
    backend = sgl.OpenAI("smollm2-135m", base_url=server.url + "/v1")
    question = "Which city is the capital of France?"
    state = capital.run(question=question, backend=backend)
    assert state.error() is None
    assert state["city"] == capital.run(question=question, backend=runtime)["city"]

    @sgl.function
    def completion(s):
        s += FEWSHOT + "Q: Which city is the capital of Peru?\nA:"
        s += sgl.gen("a", max_tokens=3, stop="\n", temperature=0)

    assert completion.run(backend=backend)["a"] == completion.run(backend=runtime)["a"]

    chat_backend = sgl.OpenAI("smollm2-135m", is_chat_model=True, base_url=server.url + "/v1")

    @sgl.function
    def chat(s):
        s += sgl.user("What color is the sky?")
        s += sgl.assistant(sgl.gen("a", max_tokens=4, temperature=0))

    state = chat.run(backend=chat_backend)
    assert state.error() is None and state["a"] == chat.run(backend=runtime)["a"]
    backend.shutdown()
    chat_backend.shutdown()


def test_text_async_iter_and_token_usage(runtime, endpoint):
    import asyncio

    @sgl.function
    def qa(s):
        s += FEWSHOT + "Q: Which city is the capital of Italy?\nA:"
        s += sgl.gen("answer", max_tokens=4, stop="\n", temperature=0)

    for backend in (runtime, endpoint):
        backend.token_usage.reset()
        state = qa.run(backend=backend, stream=True)

        async def collect(state=state):
            return [chunk async for chunk in state.text_async_iter("answer", return_meta_data=True)]

        chunks = asyncio.run(collect())
        assert "".join(text for text, _ in chunks) == state["answer"]
        assert all(isinstance(meta, dict) for _, meta in chunks)
        # one gen: the usage of that call, read from the stream's last chunk
        meta = state.get_meta_info("answer")
        assert backend.token_usage.prompt_tokens == meta["prompt_tokens"] > 0
        assert backend.token_usage.completion_tokens == meta["completion_tokens"] > 0
