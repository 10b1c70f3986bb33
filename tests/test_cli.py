"""The ``tianxia`` command line, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

TIANXIA = [sys.executable, "-m", "tianxia.cli"]


def _run(args: list[str], stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(TIANXIA + args, input=stdin, capture_output=True, text=True, timeout=timeout)


def test_run_streams_text_and_prints_timings(smollm2_path):
    r = _run(["run", "-m", "smollm2-135m", "-p", "The capital of France is", "-n", "12", "--temp", "0"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is") and "Paris" in r.stdout
    assert "prompt eval:" in r.stderr and "tokens/s" in r.stderr


def test_run_streams_the_offline_engines_text_and_ends_at_a_stop_string(smollm2_llm):
    """What ``tianxia run`` streams (the server's path: text and stop strings on the API side,
    each write up to the output's stable_len) is ``LLM.generate``'s text, with a stop string too."""
    from tianxia import SamplingParams

    prompt = "The capital of France is"
    args = ["run", "-m", "smollm2-135m", "-p", prompt, "-n", "24", "--temp", "0",
            "--cpu-activations", "float32"]
    full = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24),
                                use_tqdm=False)[0].outputs[0].text
    r = _run(args)
    assert r.returncode == 0, r.stderr
    assert r.stdout == prompt + full
    # a stop string of several characters, in the middle of the reply: held back while it could
    # still be one, then cut off
    stop = next(w for w in full.split()[1:] if len(w) >= 4)
    want = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                                use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and want.text == full[: full.index(stop)]
    r = _run([*args, "--stop", stop])
    assert r.returncode == 0, r.stderr
    assert r.stdout == prompt + want.text
    assert f"generation:  {len(want.token_ids)} tokens" in r.stderr


def test_run_unknown_model_is_one_line_error():
    r = _run(["run", "-m", "nope-model", "-p", "hi"])
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown model 'nope-model'")
    assert "smollm2-135m" in lines[0]


def test_run_prompt_too_long_is_one_line_error(smollm2_path):
    r = _run(["run", "-m", str(smollm2_path), "-c", "64", "-p", "word " * 200])
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: the prompt has")


def test_chat_reads_turns_from_stdin(smollm2_path):
    # exact products: SmolLM2 at Q4_1 answers this question with 8-bit activations (the default,
    # llama.cpp's numerics) as llama.cpp does, with a string of French words
    r = _run(["chat", "-m", "smollm2-135m", "--temp", "0", "-n", "24", "--cpu-activations", "float32"],
             stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_models_lists_pulled(smollm2_path):
    r = _run(["models"])
    assert r.returncode == 0 and "smollm2-135m" in r.stdout
