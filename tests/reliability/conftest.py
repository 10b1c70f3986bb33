"""Servers for the reliability suite: real ``tianxia serve`` processes on 127.0.0.1.

``guarded``: SmolLM2 with an API key, a request timeout, a waiting limit and faults armed by
``TIANXIA_FAULT_INJECT`` (each fault fires only for prompts that carry its trigger). ``small``:
SmolLM2 with 2 sequence slots, 4 waiting places and a 10 s request timeout. ``tiny``: a
random-weight Llama with SmolLM2's tokenizer, so that fuzzing thousands of requests costs little
compute. Each server must exit 0 on SIGTERM at the end of the session.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from reliability_helpers import API_KEY, GUARDED_ARGS, MODEL, SMALL_ARGS, fault_env
from reliability_helpers import serve as _serve


@pytest.fixture(scope="session")
def guarded(smollm2_path):
    yield from _serve([MODEL, *GUARDED_ARGS], env=fault_env())


@pytest.fixture(scope="session")
def small(smollm2_path):
    yield from _serve([MODEL, *SMALL_ARGS])


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny(tiny_llama):
    yield from _serve([str(tiny_llama), "--api-key", API_KEY, "--kv-cache-memory", "32MiB",
                       "--max-model-len", "64", "--max-num-seqs", "32", "--seed", "0"])
