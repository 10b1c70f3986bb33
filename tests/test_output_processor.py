"""Detokenization on the API side (``engine/output_processor.py``).

A request run the served way (the engine given no stop strings and no text to make, its outputs
turned into deltas of token ids, text and stop strings done by the ``OutputProcessor``, the engine
told to stop once a stop string ended the request) must give what the offline engine gives when
it detokenizes itself: the same text, tokens, finish and stop reasons and logprobs.
"""

from __future__ import annotations

import pytest

from tianxia import SamplingParams
from tianxia.engine.output_processor import OutputProcessor, RequestDelta, engine_params
from tianxia.outputs import RequestOutput

PROMPT = "The capital of France is Paris. The capital of Germany is"


def run_split(engine, rid: str, prompt: str, params: SamplingParams) -> tuple[RequestOutput, list]:
    """The request through the engine's deltas -> OutputProcessor; its final output and the
    deltas."""
    processor = OutputProcessor(engine.tokenizer)
    processor.add(rid, params)
    engine.add_request(rid, prompt, engine_params(params))
    deltas: list[RequestDelta] = []
    final = None
    while final is None:
        for delta in engine.step_deltas():
            deltas.append(delta)
            result = processor.process(delta)
            if result is None:
                continue
            for index in result.stop_choices:  # one choice met a stop string: it stops alone
                engine.stop_choice(rid, index)
            if result.output.finished:
                final = result.output
                if result.stop_request:  # ended here on a stop string: the engine is told to stop
                    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    return final, deltas


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24),
    SamplingParams(temperature=0, max_tokens=24, stop=[" Berlin", "."]),
    SamplingParams(temperature=0, max_tokens=24, stop=["Berlin"], include_stop_str_in_output=True,
                   logprobs=2),
    SamplingParams(temperature=0.9, max_tokens=16, n=3, seed=11, stop=[" the", ","]),
    SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[13], skip_special_tokens=False),
], ids=["plain", "stop", "include-stop-logprobs", "n3-seeded-stop", "stop-token"])
def test_split_detokenization_matches_the_engines(smollm2_llm, params):
    (want,) = smollm2_llm.generate(PROMPT, params)
    got, deltas = run_split(smollm2_llm.engine, "split", PROMPT, params)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert len(got.outputs) == len(want.outputs) == params.n
    for g, w in zip(got.outputs, want.outputs):
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (
            w.text, w.token_ids, w.finish_reason, w.stop_reason)
        assert g.stable_len == len(g.text)
        if params.logprobs is not None:
            assert g.cumulative_logprob == w.cumulative_logprob
            assert [{t: lp.logprob for t, lp in pos.items()} for pos in g.logprobs] == [
                {t: lp.logprob for t, lp in pos.items()} for pos in w.logprobs]
    # what crossed: token ids only, each once; the prompt with the first delta alone
    assert deltas[0].prompt_token_ids == want.prompt_token_ids
    assert all(d.prompt_token_ids is None for d in deltas[1:])
    sent: dict[int, list[int]] = {}
    for d in deltas:
        for c in d.choices:
            sent.setdefault(c.index, []).extend(c.new_token_ids)
    for g in got.outputs:
        assert sent[g.index][: len(g.token_ids)] == g.token_ids


def test_a_choice_that_meets_a_stop_string_stops_in_the_engine(smollm2_llm):
    """n > 1: once one choice has met a stop string on the API side the engine makes no more
    tokens for it (and frees its blocks), while its siblings run on to their own ends."""
    engine = smollm2_llm.engine
    free_before = engine.block_manager.num_free_blocks
    # the first seed whose choices include both kinds (which seeds do depends on the draws' noise)
    for seed in range(5, 45):
        params = SamplingParams(temperature=0.9, max_tokens=32, n=4, seed=seed, stop=[","],
                                ignore_eos=True)
        got, deltas = run_split(engine, f"per-choice-{seed}", PROMPT, params)
        stopped = [c for c in got.outputs if c.finish_reason == "stop"]
        if stopped and len(stopped) < params.n:
            break
    assert stopped and len(stopped) < params.n, "no seed gave a stopped choice beside a running one"
    made: dict[int, int] = {}
    for d in deltas:
        for c in d.choices:
            made[c.index] = made.get(c.index, 0) + len(c.new_token_ids)
    for c in got.outputs:
        if c.finish_reason == "stop":
            # the stop string ended it at a token of the step the API side saw it in
            assert made[c.index] == len(c.token_ids) < params.max_tokens
        else:
            assert made[c.index] == len(c.token_ids) == params.max_tokens
    assert engine.block_manager.num_free_blocks == free_before


def test_stop_string_is_held_back_while_streaming(smollm2_llm):
    """While a choice runs, text that could still begin a stop string is not yet stable."""
    params = SamplingParams(temperature=0, max_tokens=24, stop=["Berlin is the capital"])
    engine = smollm2_llm.engine
    processor = OutputProcessor(engine.tokenizer)
    processor.add("hold", params)
    engine.add_request("hold", PROMPT, engine_params(params))
    streamed = ""
    while engine.has_unfinished_requests():
        for delta in engine.step_deltas():
            result = processor.process(delta)
            if result is None:
                continue
            (c,) = result.output.outputs
            assert c.stable_len <= max(0, len(c.text) - len(params.stop_strings[0]) + 1) or \
                c.finish_reason is not None
            streamed += c.text[len(streamed): c.stable_len]
    (want,) = smollm2_llm.generate(PROMPT, params)
    assert streamed == want.outputs[0].text


MULTIBYTE = "Grüße aus 東京 🤖🚀, naïve café — “quoted” text.\n\n日本語のテキスト ok"


@pytest.mark.parametrize("cut", [0, 2, 6, 8, 28])
def test_streamed_text_is_the_tokenizers_decode(smollm2_llm, cut):
    """Token by token, through ``tokenizers``' DecodeStream and through the Python window alike,
    the streamed text is the tokenizer's decode of prompt and output at once minus the prompt's:
    multi-byte characters split over byte-fallback tokens come out whole, never broken. A prompt
    whose last token ends inside a character (SmolLM2's ids of this text, cut at 8) is left to the
    Python window, and both give the same text."""
    from tianxia.engine.detokenizer import IncrementalDetokenizer, rust_tokenizer

    tok = smollm2_llm.get_tokenizer()
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    prompt, generated = ids[:cut], ids[cut:]
    backend = rust_tokenizer(tok)
    assert backend is not None
    texts = []
    for b in (backend, None):
        detok = IncrementalDetokenizer(tok, prompt, [], False, True, backend=b)
        for token in generated:
            detok.append(token)
            assert "\ufffd" not in detok.text
        detok.flush()
        texts.append(detok.text)
    assert texts[0] == texts[1]
    head = tok.decode(prompt)
    clean = not head.endswith("\ufffd")
    assert (IncrementalDetokenizer(tok, prompt, [], False, True, backend=backend).stream
            is not None) == clean
    if clean:
        assert head + texts[0] == tok.decode(ids)
