"""Same request, same answer, through ``tianxia serve`` with its default settings (8-bit
activations on CPU) and the official ``openai`` client: a greedy chat request with logprobs and a
seeded completion with ``n=2`` give the same text and logprobs every time, sent again and again
alone, among 15 concurrent other requests (some sharing its prompt's prefix, so its prefix can
come from the cache), and on another server process (a restart) with 2 sequence slots instead of
16. Each token's numbers do not depend on what else its step computed (see
``tests/test_batch_invariance.py`` for the engine itself)."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from reliability_helpers import API_KEY, GUARDED_ARGS, MODEL, SMALL_ARGS, serve


@pytest.fixture(scope="module")
def served16(smollm2_path):
    yield from serve([MODEL, *GUARDED_ARGS])


@pytest.fixture(scope="module")
def served2(smollm2_path):
    yield from serve([MODEL, *SMALL_ARGS])


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


CHAT = {"messages": [{"role": "user", "content": "Name three colours and describe one of them."}],
        "temperature": 0, "max_tokens": 20, "logprobs": True, "top_logprobs": 2}
SEEDED = {"prompt": "The best way to cook rice is", "seed": 7, "temperature": 1.0, "top_p": 0.9,
          "max_tokens": 20, "n": 2, "logprobs": 2}


def chat(c: openai.OpenAI) -> tuple:
    r = c.chat.completions.create(model=MODEL, **CHAT)
    choice = r.choices[0]
    return choice.message.content, [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                                    for t in choice.logprobs.content]


def seeded(c: openai.OpenAI) -> list:
    r = c.completions.create(model=MODEL, extra_body={"ignore_eos": True}, **SEEDED)
    return [(x.text, x.logprobs.token_logprobs, x.logprobs.top_logprobs)
            for x in sorted(r.choices, key=lambda x: x.index)]


def noise(c: openai.OpenAI, i: int) -> str:
    """Other traffic: prompts of 5-150 tokens, greedy and sampled, some sharing the chat's prefix."""
    j = i % 15
    if j % 3 == 0:
        messages = [{"role": "user", "content": "Name three colours and " + "then some more " * j}]
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8 + j, temperature=0.7)
        return r.choices[0].message.content
    r = c.completions.create(model=MODEL, prompt=f"Noise {i}: " * (1 + 2 * j), max_tokens=8 + j,
                             temperature=1.0 if j % 2 else 0, extra_body={"ignore_eos": True})
    return r.choices[0].text


def repeated(url: str, ask, rounds: int = 5) -> list:
    """``ask`` alone ``rounds`` times, then ``rounds`` times among 15 concurrent other requests."""
    c = client(url)
    answers = [ask(c) for _ in range(rounds)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for r in range(rounds):
            others = [pool.submit(noise, c, 15 * r + i) for i in range(15)]
            answers.append(pool.submit(ask, c).result())
            assert all(isinstance(f.result(), str) for f in others)
    return answers


def test_greedy_chat_answers_the_same_every_time(served16, served2):
    answers = repeated(served16.url, chat)
    text, logprobs = answers[0]
    assert text and len(logprobs) > 5
    assert all(a == answers[0] for a in answers)
    assert chat(client(served2.url)) == answers[0]  # another process, 2 sequence slots


def test_seeded_samples_are_the_same_every_time(served16, served2):
    answers = repeated(served16.url, seeded)
    first = answers[0]
    assert len(first) == 2 and first[0][0] != first[1][0]  # the n choices draw different seeds
    assert all(a == first for a in answers)
    assert seeded(client(served2.url)) == first
