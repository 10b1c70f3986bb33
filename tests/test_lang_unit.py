"""tianxia.lang without a model: the interpreter, forks, chat templates, choices methods, the
OpenAI backend's select against canned server replies."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

import tianxia.lang as sgl
from tianxia.lang.backend.base import BaseBackend
from tianxia.lang.chat_template import JinjaChatTemplate, jinja_renderer
from tianxia.lang.choices import ChoicesDecision
from tianxia.lang.interpreter import trace_prefix

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


class FakeBackend(BaseBackend):
    """gen returns "<name:len(text)>"; select the longest choice; records calls."""

    def __init__(self, template=None, delay: float = 0.0) -> None:
        self.template = template or sgl.get_chat_template("default")
        self.delay = delay
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0

    def get_chat_template(self):
        return self.template

    def _enter(self) -> None:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(self.delay)
        with self.lock:
            self.active -= 1

    def generate(self, s, sampling_params):
        self._enter()
        with self.lock:
            self.calls.append(("gen", s.text_))
        return f"<{sampling_params.max_new_tokens}:{len(s.text_)}>", {"max": sampling_params.max_new_tokens}

    def select(self, s, choices, temperature, choices_method):
        with self.lock:
            self.calls.append(("select", s.text_))
        return ChoicesDecision(max(choices, key=len), {"n": len(choices)})

    def commit_lazy_operations(self, s):
        with self.lock:
            self.calls.append(("commit", s.text_))

    def cache_prefix(self, prefix_str):
        with self.lock:
            self.calls.append(("cache", prefix_str))


def test_program_text_variables_and_defaults():
    backend = FakeBackend()

    @sgl.function
    def prog(s, x):
        s += "A " + x + ":" + sgl.gen("g", max_tokens=7)
        s += sgl.select("c", ["no", "maybe"])
        with s.var_scope("scope"):
            s += " tail"

    state = prog.run(x="q", backend=backend, max_new_tokens=3)
    assert state.text() == "A q:<7:4>maybe tail"
    assert state["g"] == "<7:4>" and state["c"] == "maybe" and state["scope"] == " tail"
    assert state.get_meta_info("g") == {"max": 7}
    assert "g" in state and "zzz" not in state
    # the program's default applies where gen sets nothing
    prog2 = sgl.function(_gen_default)
    assert prog2.run(backend=backend, max_new_tokens=3)["g"] == "<3:1>"


def _gen_default(s):
    s += "x" + sgl.gen("g")


def test_roles_fixed_template_and_messages():
    backend = FakeBackend()

    @sgl.function
    def chat(s):
        s += sgl.system("be brief")
        s += sgl.user("hi")
        s += sgl.assistant(sgl.gen("a"))
        s += sgl.user_begin() + "more" + sgl.user_end()

    state = chat.run(backend=backend)
    assert state.text() == "SYSTEM:be brief\nUSER:hi\nASSISTANT:<128:34>\nUSER:more\n"
    assert state.messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<128:34>"},
        {"role": "user", "content": "more"},
    ]


def test_jinja_template_prefixes_reproduce_the_template():
    tmpl = JinjaChatTemplate(jinja_renderer(SMOL_TEMPLATE))
    backend = FakeBackend(template=tmpl)

    @sgl.function
    def chat(s):
        s += sgl.user("hi")
        s += sgl.assistant("hello")
        s += sgl.user("bye")

    state = chat.run(backend=backend)
    rendered = jinja_renderer(SMOL_TEMPLATE)(state.messages())
    assert state.text() == rendered
    assert state.text().startswith("<|im_start|>system\nYou are a helpful AI assistant")
    prefix, suffix = tmpl.get_prefix_and_suffix("assistant", [{"role": "user", "content": "x"}])
    assert (prefix, suffix) == ("<|im_start|>assistant\n", "<|im_end|>\n")


def test_fork_join_and_commit_before_fork():
    backend = FakeBackend(delay=0.2)

    @sgl.function
    def prog(s):
        s += "shared prefix. "
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"branch {i}: " + sgl.gen("out", max_tokens=i + 1)
        outs = [f["out"] for f in forks]
        s += " | ".join(outs)
        forks.join()

    t0 = time.monotonic()
    state = prog.run(backend=backend)
    elapsed = time.monotonic() - t0
    assert state.text() == "shared prefix. <1:25> | <2:25> | <3:25>"
    assert state["out"] == ["<1:25>", "<2:25>", "<3:25>"]  # gathered into a list
    assert ("commit", "shared prefix. ") in backend.calls
    assert backend.max_active == 3 and elapsed < 0.55  # the forks ran in parallel


def test_fork_group_iadd_and_concate_and_append():
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += "p:"
        forks = s.fork(2)
        forks += lambda i: f"[{i}]"
        forks += "x"
        forks.join("concate_and_append")

    assert prog.run(backend=backend).text() == "p:[0]x[1]x"


def test_run_batch_order_threads_progress_and_precache(capsys):
    backend = FakeBackend(delay=0.05)
    shared = "You answer questions about geography, briefly and correctly, in one word. " * 2

    @sgl.function
    def qa(s, question):
        s += shared + "Q: " + question + "\nA:" + sgl.gen("a", max_tokens=4)

    states = qa.run_batch(
        [{"question": q} for q in ("one", "two", "three", "four")], num_threads=4, progress_bar=True,
        backend=backend,
    )
    assert [s["a"] for s in states] == [f"<4:{len(shared) + 6 + len(q)}>" for q in ("one", "two", "three", "four")]
    cached = [c for c in backend.calls if c[0] == "cache"]
    assert cached == [("cache", shared + "Q: ")]
    assert backend.max_active > 1
    # positional tuples work too
    assert qa.run_batch([("x",)], backend=backend)[0]["a"].startswith("<4:")


def test_trace_prefix_stops_at_first_model_call_and_variable_read():
    backend = FakeBackend()

    @sgl.function
    def prog(s, q):
        s += "constant header line\n"
        s += "Q: " + q + "\n"
        s += sgl.gen("a")
        s += "after " + s["a"]

    prefix = trace_prefix(prog, backend, [{"q": "alpha"}, {"q": "beta"}], sgl.SglSamplingParams())
    assert prefix == "constant header line\nQ: "
    assert backend.calls == []


def test_errors_surface_on_variable_read():
    class Failing(FakeBackend):
        def generate(self, s, sampling_params):
            raise RuntimeError("boom")

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("g")

    state = prog.run(backend=Failing())
    with pytest.raises(RuntimeError, match="boom"):
        state["g"]
    assert isinstance(state.error(), RuntimeError)


def test_streaming_text_iter_with_fake_backend():
    class Streaming(FakeBackend):
        def generate_stream(self, s, sampling_params):
            for piece in ("ab", "cd", "ef"):
                time.sleep(0.01)
                yield piece, {}

    @sgl.function
    def prog(s):
        s += "start:" + sgl.gen("g") + ":end"

    state = prog.run(backend=Streaming(), stream=True)
    pieces = list(state.text_iter())
    assert "".join(pieces) == "start:abcdef:end"
    state = prog.run(backend=Streaming(), stream=True)
    assert "".join(state.text_iter("g")) == "abcdef"


def test_choices_methods():
    rows = [
        [(-0.1, 1, "organ")],
        [(-0.1, 1, "organ"), (-0.3, 2, "ism")],
        [(-0.4, 3, "ant"), (-0.25, 4, "id"), (-0.1, 5, "is")],
    ]
    choices = ["organ", "organism", "antidis"]
    norm = [sum(x[0] for x in r) / len(r) for r in rows]
    d = sgl.token_length_normalized(
        choices=choices, normalized_prompt_logprobs=norm, input_token_logprobs=rows,
        output_token_logprobs=[[]] * 3,
    )
    assert d.decision == "organ"
    d = sgl.greedy_token_selection(
        choices=choices, normalized_prompt_logprobs=norm, input_token_logprobs=rows,
        output_token_logprobs=[[]] * 3,
    )
    assert d.decision == "organ"  # ties on the first token; organ's mean (-0.1) beats -0.3
    alone = [[(None, 1, "")], [(None, 1, ""), (-1.0, 2, "")], [(None, 3, ""), (-2.0, 4, ""), (-3.0, 5, "")]]
    d = sgl.unconditional_likelihood_normalized(
        choices=choices, normalized_prompt_logprobs=norm, input_token_logprobs=rows,
        output_token_logprobs=[[]] * 3, unconditional_token_logprobs=alone,
    )
    assert d.decision == "antidis"


def _mock_server(handler):
    return httpx.Client(base_url="http://mock/v1", transport=httpx.MockTransport(handler))


def test_openai_backend_select_from_echoed_logprobs():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.update(body)
        choices = []
        for i, prompt in enumerate(body["prompt"]):
            # one token per character after "Q?", each with logprob -1 (choice 0) or -0.5
            tokens = ["Q?"] + list(prompt[2:]) + ["!"]
            offsets = [0] + [2 + j for j in range(len(prompt) - 2)] + [len(prompt)]
            values = [None] + [-1.0 if i == 0 else -0.5] * (len(prompt) - 2) + [-0.1]
            choices.append({"index": i, "text": prompt + "!", "logprobs": {
                "tokens": tokens, "token_logprobs": values, "text_offset": offsets,
                "top_logprobs": None}})
        return httpx.Response(200, json={"id": "x", "choices": choices, "usage": {}})

    backend = sgl.OpenAI("m", base_url="http://mock/v1", http_client=_mock_server(handler))

    @sgl.function
    def prog(s):
        s += "Q?" + sgl.select("c", [" a", " bb"])

    state = prog.run(backend=backend)
    assert state["c"] == " bb" and state.text() == "Q? bb"
    assert seen["echo"] is True and seen["max_tokens"] == 1 and seen["prompt"] == ["Q? a", "Q? bb"]
    assert state.get_meta_info("c")["normalized_prompt_logprobs"] == [-1.0, -0.5]


def test_openai_backend_select_clear_error_without_prompt_logprobs():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        # llama.cpp-like: no echo, logprobs only of the generated token
        return httpx.Response(200, json={"choices": [
            {"index": i, "text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [-0.2],
                                                   "text_offset": [0]}}
            for i in range(len(body["prompt"]))]})

    backend = sgl.OpenAI("m", base_url="http://mock/v1", http_client=_mock_server(handler))

    @sgl.function
    def prog(s):
        s += "Q?" + sgl.select("c", [" a", " b"])

    state = prog.run(backend=backend)
    with pytest.raises(RuntimeError, match="log-probabilities of prompt tokens"):
        state["c"]
    assert isinstance(state.error(), sgl.SelectUnsupportedError)
    chat = sgl.OpenAI("m", is_chat_model=True, base_url="http://mock/v1", http_client=_mock_server(handler))
    state = prog.run(backend=chat)
    assert isinstance(state.error(), sgl.SelectUnsupportedError)


def test_openai_backend_chat_mode_sends_messages():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"] = request.url.path
        seen.update(json.loads(request.content))
        return httpx.Response(200, json={"choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2}})

    backend = sgl.OpenAI("m", is_chat_model=True, base_url="http://mock/v1", http_client=_mock_server(handler))

    @sgl.function
    def prog(s):
        s += sgl.user("Capital of France?")
        s += sgl.assistant(sgl.gen("a", max_tokens=5, regex="[A-Z][a-z]+\\."))

    state = prog.run(backend=backend)
    assert state["a"] == "Paris."
    assert seen["path"] == "/v1/chat/completions"
    assert seen["messages"] == [{"role": "user", "content": "Capital of France?"}]
    assert seen["max_tokens"] == 5 and seen["guided_regex"] == "[A-Z][a-z]+\\."


def test_gen_dtype_and_regex_validation():
    with pytest.raises(re.error):
        sgl.gen("x", regex="(unclosed")
    p = sgl.SglSamplingParams(dtype=int)
    p.resolve_dtype()
    assert p.regex == r"[-+]?[0-9]+[ \n]*" and p.stop_list == [" ", "\n"]
    assert isinstance(sgl.gen("x", choices=["a", "b"]), sgl.SglExpr)
    with pytest.raises(TypeError):
        sgl.function(lambda x: None)
