"""The web chat page at ``/`` of a real ``tianxia serve`` (SmolLM2 with an API key and two served
names), in Debian's Chromium run headless and driven by Playwright.

Each test gets a fresh browser context (its own IndexedDB and localStorage); all but the key
prompt's start with the key and short, greedy settings stored as the page stores them. What the
page shows is checked against what the server really sent: the request bodies and the
server-sent events Chromium received, ``/tokenize`` and ``/metrics``. Screenshots are kept under
``artifacts/webui/`` (``$TIANXIA_ARTIFACTS`` to move it).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright

from tianxia.server.testing import ServerProcess, metric

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
KEY = "webui-test-key"
MODEL = "smollm2-135m"
ALIAS = "tiny-llama"
SETTINGS = {"temperature": "0", "max_tokens": "12", "seed": "1"}
ARTIFACTS = Path(os.environ.get("TIANXIA_ARTIFACTS", Path(__file__).parents[1] / "artifacts"))
DESKTOP = {"width": 1200, "height": 800}
PHONE = {"width": 390, "height": 780}

pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason="needs Debian's chromium (scripts/setup.sh test installs it)"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = ServerProcess([
        MODEL, "--served-model-name", MODEL, ALIAS, "--api-key", KEY,
        "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--seed", "0",
    ])
    srv.start()
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


def new_page(browser, server, *, key: bool = True, settings: dict | None = None,
             viewport: dict = DESKTOP, on_request=None):
    """A page in a fresh context, its storage seeded once (a reload keeps what the page saved)."""
    context = browser.new_context(viewport=viewport, base_url=server.url)
    seed = {"tianxia.settings": json.dumps({**SETTINGS, **(settings or {})})}
    if key:
        seed["tianxia.apiKey"] = KEY
    context.add_init_script(
        "if (!sessionStorage.getItem('seeded')) {"
        f"  for (const [k, v] of Object.entries({json.dumps(seed)})) localStorage.setItem(k, v);"
        "  sessionStorage.setItem('seeded', '1');"
        "}"
    )
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    if on_request is not None:
        page.on("request", on_request)
    page.goto("/")
    page.wait_for_selector("body[data-ready=true]")
    return page


@pytest.fixture
def page(browser, server):
    page = new_page(browser, server)
    yield page
    assert page.errors == [], page.errors
    page.context.close()


def sse_text(body: bytes, field: str = "content") -> str:
    """The text a stream carried: its deltas' ``content`` (chat) or its choices' ``text``."""
    out = []
    for line in body.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            part = choice["delta"].get("content") if field == "content" else choice.get("text")
            out.append(part or "")
    return "".join(out)


def last_usage(body: bytes) -> dict:
    """The usage of a stream's final chunk (``stream_options.include_usage``)."""
    events = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: {")]
    return events[-1]["usage"]


def wait_replies(page, n: int, timeout: float = 120_000) -> None:
    """Until the page shows ``n`` assistant messages and none is still streaming."""
    page.wait_for_function(
        "n => document.querySelectorAll('article.msg.assistant').length === n"
        " && !document.querySelector('article[aria-busy=true]')"
        " && document.getElementById('stop').hidden",
        arg=n, timeout=timeout,
    )


def stored_conversations(page) -> list[dict]:
    return page.evaluate(
        "() => new Promise((ok, fail) => { const r = indexedDB.open('tianxia-webui');"
        " r.onsuccess = () => { const q = r.result.transaction('conversations')"
        ".objectStore('conversations').getAll(); q.onsuccess = () => ok(q.result);"
        " q.onerror = fail; }; r.onerror = fail; })"
    )


def finished_request(page, action, path: str = "/v1/chat/completions"):
    """Run ``action``; return the JSON body of the request to ``path`` it made and the whole
    (streamed) response that request got."""
    with page.expect_event("requestfinished", lambda r: r.url.endswith(path),
                           timeout=120_000) as done:
        action()
    request = done.value
    return json.loads(request.post_data), request.response().body()


def send(page, text: str) -> tuple[dict, bytes]:
    page.fill("#prompt", text)
    return finished_request(page, lambda: page.press("#prompt", "Enter"))


def running(server) -> tuple[float, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return metric(text, "vllm:num_requests_running"), metric(text, "vllm:kv_cache_usage_perc")


def test_the_page_is_served_without_the_key_and_asks_for_it(browser, server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(server.url + "/v1/models").status_code == 401  # the API still needs it
    js = httpx.get(server.url + "/webui/app.js")
    assert js.status_code == 200 and js.headers["content-encoding"] == "gzip"
    again = httpx.get(server.url + "/webui/app.js", headers={"If-None-Match": js.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    # only the page's own files are open: any other path needs the key, as before
    assert httpx.get(server.url + "/webui/nothing.js").status_code == 401
    missing = httpx.get(server.url + "/webui/nothing.js", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    api_calls = []
    page = new_page(browser, server, key=False,
                    on_request=lambda req: "/v1/" in req.url and api_calls.append(req))
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    page.fill("#key-input", "not-the-key")
    page.click("#key-save")
    page.wait_for_function("() => document.getElementById('key-error').textContent !== ''")
    assert "Incorrect API key" in page.text_content("#key-error")
    assert dialog.is_visible()
    page.fill("#key-input", KEY)
    page.click("#key-save")
    dialog.wait_for(state="hidden")
    options = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
    assert options == [MODEL, ALIAS]
    page.reload()  # the key is kept in the browser
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 2")
    assert not dialog.is_visible()
    auth = [req.headers.get("authorization") for req in api_calls]
    assert auth[0] is None and auth[1] == "Bearer not-the-key"
    assert auth[2:] and all(a == f"Bearer {KEY}" for a in auth[2:]), auth
    assert page.errors == []
    page.context.close()


def test_streamed_reply_with_settings_stats_and_reload(page, server):
    # the settings dialog: what it saves is what the next request sends
    page.click("#open-settings")
    page.fill("[name=system]", "You are a helpful assistant.")
    page.fill("[name=max_tokens]", "32")
    page.fill("[name=top_k]", "40")
    page.click("#settings-save")
    page.locator("#settings-dialog").wait_for(state="hidden")
    # every distinct text of the reply while it streams
    page.evaluate(
        "() => { window.states = []; new MutationObserver(() => {"
        " const b = [...document.querySelectorAll('article.assistant .msg-body')].pop();"
        " if (b && window.states.at(-1) !== b.textContent) window.states.push(b.textContent);"
        "}).observe(document.getElementById('messages'), {childList: true, subtree: true}); }"
    )
    body, stream = send(page, "What is the capital of France?")
    wait_replies(page, 1)
    assert body["model"] == MODEL and body["stream"] is True
    assert body["stream_options"]["include_usage"] is True
    assert body["messages"] == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert (body["temperature"], body["max_tokens"], body["top_k"], body["seed"]) == (0, 32, 40, 1)
    assert "top_p" not in body and "min_p" not in body  # left empty: the server's defaults

    streamed = sse_text(stream)
    assert streamed.strip()
    deltas = [ln for ln in stream.decode().splitlines() if '"content": "' in ln or '"content":"' in ln]
    # streamed in pieces; a server behind its engine sends the newest text of several steps in
    # one delta (outputs are cumulative), so a loaded machine may send fewer than one a token
    assert len(deltas) >= 2, deltas
    conv = stored_conversations(page)[0]
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][1]["content"] == streamed
    states = [s for s in page.evaluate("() => window.states") if s.strip()]
    final = page.locator("article.assistant .msg-body").text_content()
    assert final.strip() and states[-1] == final
    # the reply grew in place, not in one piece; a busy browser may paint several deltas at once
    assert len(states) >= 2, states
    assert all(b.startswith(a.rstrip()) for a, b in zip(states, states[1:])), states
    assert len(states[0]) < len(final)

    # the counts shown are the server's: the prompt as /tokenize counts it, the tokens streamed
    stats = page.locator("article.assistant .stats")
    n_prompt = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": MODEL, "messages": body["messages"]}).json()["count"]
    assert int(stats.get_attribute("data-prompt-tokens")) == n_prompt
    n_out = int(stats.get_attribute("data-completion-tokens"))
    assert n_out == last_usage(stream)["completion_tokens"] and 1 <= n_out <= 32
    assert "tokens/s" in stats.text_content() or n_out == 1

    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    item = page.locator("#conversation-list .conv-open")
    assert item.count() == 1 and item.text_content() == "What is the capital of France?"
    assert page.locator("article.assistant .msg-body").text_content() == final
    assert page.input_value("#prompt") == ""


def wait_for_reply_text(page, n_chars: int = 12) -> None:
    page.wait_for_function(
        "n => ([...document.querySelectorAll('article.assistant .msg-body')].pop()?.textContent"
        " || '').length > n", arg=n_chars, timeout=120_000,
    )


def wait_all_freed(server) -> None:
    deadline = time.monotonic() + 20
    while running(server) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(server) == (0, 0)  # no request left running, every KV block free


def test_stop_aborts_the_request_and_frees_its_kv(browser, server):
    page = new_page(browser, server, settings={"max_tokens": "900"})
    page.fill("#prompt", "Count from 1 to 1000, separated by commas.")
    page.press("#prompt", "Enter")
    wait_for_reply_text(page)
    assert running(server)[0] == 1
    page.click("#stop")
    wait_replies(page, 1)
    wait_all_freed(server)
    stats = page.locator("article.assistant .stats")
    assert "stopped" in stats.text_content()
    assert int(stats.get_attribute("data-completion-tokens") or 0) < 900
    kept = stored_conversations(page)[0]["messages"][1]
    assert kept["finish"] == "stopped" and kept["content"]

    # the server serves on; Escape stops a reply too
    page.click("article.assistant [data-action=regenerate]")
    wait_for_reply_text(page)
    assert running(server)[0] == 1
    page.keyboard.press("Escape")
    wait_replies(page, 1)
    wait_all_freed(server)
    assert "stopped" in page.locator("article.assistant .stats").text_content()
    assert page.errors == []
    page.context.close()


def test_model_picker_switches_model_and_is_remembered(page):
    page.select_option("#model", ALIAS)
    body, _ = send(page, "Hi!")
    wait_replies(page, 1)
    assert body["model"] == ALIAS
    assert page.locator("article.assistant .model-name").text_content() == ALIAS
    page.reload()
    page.wait_for_function(f"() => document.getElementById('model').value === {json.dumps(ALIAS)}")
    page.select_option("#model", MODEL)
    body, _ = send(page, "Hello again!")
    wait_replies(page, 2)
    assert body["model"] == MODEL
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]


def test_model_status_from_a_several_models_server_is_shown(page, server):
    """A server with several models reports each one's `status` in /v1/models (as llama.cpp's
    router does); this server has one model, so its real answer gets the field added."""

    def with_status(route):
        data = route.fetch().json()
        data["data"][0]["status"] = "loaded"
        data["data"][1]["status"] = {"value": "failed", "reason": "unknown architecture"}
        route.fulfill(json=data)

    page.route("**/v1/models", with_status)
    page.reload()
    page.wait_for_function("() => document.querySelector('#model option[data-status]')")
    labels = page.eval_on_selector_all(
        "#model option", "os => os.map(o => [o.textContent, o.dataset.status, o.title])"
    )
    assert labels == [[f"{MODEL} (loaded)", "loaded", ""],
                      [f"{ALIAS} (failed)", "failed", "unknown architecture"]]


def test_the_picker_of_a_real_server_with_several_models(browser, smollm2_path, tmp_path):
    """A server with several models: the picker lists each with its status; a chat with an
    unloaded model loads it and replies; a corrupt one shows `failed` with the reason."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(smollm2_path.read_bytes()[:200_000])
    args = ["--model", f"smol={smollm2_path}", "--model", str(broken),
            "--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
    with ServerProcess(args) as srv:
        page = new_page(browser, srv, key=False)

        def options() -> list:
            return page.eval_on_selector_all(
                "#model option", "os => os.map(o => [o.textContent, o.dataset.status, o.title])")

        # the picker fills from /v1/models after the page is ready
        page.wait_for_function("() => document.querySelectorAll('#model option[data-status]').length == 2")
        assert options() == [["smol (unloaded)", "unloaded", ""],
                             ["broken (unloaded)", "unloaded", ""]]
        body, stream = send(page, "Hello!")  # waits for smol to load, then streams
        wait_replies(page, 1)
        assert body["model"] == "smol" and sse_text(stream)
        page.select_option("#model", "broken")
        body, _ = send(page, "Hello?")
        assert body["model"] == "broken"
        page.wait_for_function(
            "() => document.getElementById('status').textContent.includes('failed to load')")
        page.focus("#model")  # the picker asks /v1/models again
        page.wait_for_function("() => document.querySelector('#model option[data-status=failed]')")
        (smol, broken_option) = options()
        assert smol == ["smol (loaded)", "loaded", ""]
        assert broken_option[:2] == ["broken (failed)", "failed"]
        assert "not a valid GGUF file" in broken_option[2]
        assert page.errors == [], page.errors
        page.context.close()


def test_regenerate_edit_rename_export_delete_import(page, tmp_path):
    send(page, "Name a color.")
    wait_replies(page, 1)
    body, stream = finished_request(page, lambda: page.click("[data-action=regenerate]"))
    wait_replies(page, 1)
    assert [m["content"] for m in body["messages"]] == ["Name a color."]  # the old reply is gone
    assert stored_conversations(page)[0]["messages"][1]["content"] == sse_text(stream)

    page.click("article.user [data-action=edit]")
    page.fill("article.user textarea", "Name a fruit.")
    body, stream = finished_request(page, lambda: page.click("article.user button[type=submit]"))
    wait_replies(page, 1)
    assert body["messages"] == [{"role": "user", "content": "Name a fruit."}]
    assert page.locator("article.user .msg-body").text_content() == "Name a fruit."

    page.click(".conv-rename")
    page.fill(".rename-input", "Fruit talk")
    page.press(".rename-input", "Enter")
    page.wait_for_selector(".conv-open:text-is('Fruit talk')")

    with page.expect_download() as download:
        page.click("#export")
    exported = tmp_path / "export.json"
    download.value.save_as(exported)
    data = json.loads(exported.read_text())
    assert data["format"] == "tianxia-webui-conversations"
    [conv] = data["conversations"]
    assert conv["title"] == "Fruit talk"
    assert conv["messages"][0] == {"role": "user", "content": "Name a fruit."}
    assert conv["messages"][1]["content"] == sse_text(stream)

    page.once("dialog", lambda d: d.accept())
    page.click(".conv-delete")
    page.wait_for_selector("#no-conversations", state="visible")
    assert stored_conversations(page) == []
    assert page.locator("article.msg").count() == 0

    page.set_input_files("#import-file", str(exported))
    page.wait_for_selector(".conv-open:text-is('Fruit talk')")
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("article.user .msg-body").text_content() == "Name a fruit."
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "an export"}')
    page.set_input_files("#import-file", str(bad))
    page.wait_for_function(
        "() => document.getElementById('status').textContent.includes('Import failed')")


def test_raw_completion_mode(page):
    page.click("#mode-completion")
    page.fill("#raw-prompt", "The capital of France is")
    body, stream = finished_request(page, lambda: page.click("#raw-generate"), "/v1/completions")
    assert body["prompt"] == "The capital of France is" and "messages" not in body
    text = sse_text(stream, field="text")
    page.wait_for_selector("#raw-generate", state="visible")
    assert text and page.input_value("#raw-prompt") == "The capital of France is" + text
    usage = last_usage(stream)
    stats = page.locator("#raw-stats")
    assert stats.get_attribute("data-prompt-tokens") == str(usage["prompt_tokens"])
    assert stats.get_attribute("data-completion-tokens") == str(usage["completion_tokens"])
    page.reload()  # the mode and the text are kept
    page.wait_for_selector("#completion-view", state="visible")
    assert page.input_value("#raw-prompt") == "The capital of France is" + text


def test_tool_calls_and_json_schema_replies_are_shown_as_json(browser, server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"]}}}]
    page = new_page(browser, server, settings={
        "tools": json.dumps(tools), "tool_choice": "required", "max_tokens": "48"})
    body, _ = send(page, "What is the weather in Paris?")
    wait_replies(page, 1)
    assert body["tools"] == tools and body["tool_choice"] == "required"
    head = page.locator("article.assistant .tool-call .code-head span").text_content()
    assert head == "tool call · get_weather"
    args = page.locator("article.assistant .tool-call code").text_content()
    assert json.loads(args)["city"] in ("Paris", "Rome") and "\n" in args  # pretty-printed

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    page.click("#open-settings")
    page.fill("[name=tools]", "")
    page.select_option("[name=response_format]", "json_schema")
    page.fill("[name=json_schema]", "{not json")
    page.click("#settings-save")
    assert "Not saved" in page.text_content("#settings-error")  # a bad schema is refused
    page.fill("[name=json_schema]", json.dumps(schema))
    page.click("#settings-save")
    body, stream = send(page, "What is 2 + 2?")
    wait_replies(page, 2)
    assert body["response_format"]["json_schema"]["schema"] == schema and "tools" not in body
    block = page.locator("article.assistant").nth(1)
    assert block.locator(".code-head span").text_content() == "JSON"
    shown = json.loads(block.locator("code").text_content())
    assert shown == json.loads(sse_text(stream)) and isinstance(shown["answer"], int)
    assert page.errors == []
    page.context.close()


RICH = {
    "format": "tianxia-webui-conversations", "version": 1, "conversations": [{
        "id": "demo", "title": "Fibonacci in Python", "created": 1, "updated": 2, "messages": [
            {"role": "user", "content": "Write a Python function for Fibonacci numbers."},
            {"role": "assistant", "model": MODEL, "finish": "stop", "content": (
                "Here is an **iterative** version:\n\n```python\ndef fib(n: int) -> int:\n"
                "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
                "    return a\n```\n\nIt runs in $O(n)$ time, since\n\n"
                "$$F_n = F_{n-1} + F_{n-2}$$\n\n<script>alert(1)</script>"),
             "stats": {"prompt_tokens": 38, "completion_tokens": 71, "tps": 41.7, "ttft": 0.12}},
        ]}],
}


def test_markdown_code_math_accessibility_and_screenshots(browser, server, tmp_path):
    out = ARTIFACTS / "webui"
    out.mkdir(parents=True, exist_ok=True)
    export = tmp_path / "rich.json"
    export.write_text(json.dumps(RICH))
    page = new_page(browser, server)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page.set_input_files("#import-file", str(export))
    page.click(".conv-open:text-is('Fibonacci in Python')")
    reply = page.locator("article.assistant .msg-body")
    assert reply.locator("strong").text_content() == "iterative"
    assert reply.locator("code.language-python .token.keyword").count() >= 3  # highlighted
    page.wait_for_selector("article.assistant .math.rendered math")  # TeX became MathML
    assert reply.locator(".math[data-display='1'] math[display=block]").count() == 1
    assert "<script>alert(1)</script>" in reply.text_content()  # raw HTML is shown as text
    assert reply.locator("script").count() == 0
    page.click("article.assistant .copy-code")
    copied = page.evaluate("() => navigator.clipboard.readText()")
    assert copied.startswith("def fib(n: int) -> int:") and copied.endswith("    return a")
    stats = page.locator("article.assistant .stats").text_content()
    assert stats.startswith("38 prompt · 71 generated · 41.7 tokens/s")

    # every control has an accessible name; the keyboard reaches the message box first
    unnamed = page.evaluate(
        "() => [...document.querySelectorAll('button, input:not([type=file]), select, textarea')]"
        ".filter(e => !(e.labels?.length || e.getAttribute('aria-label') || e.textContent.trim()))"
        ".map(e => e.outerHTML)"
    )
    assert unnamed == []
    page.focus("a.skip")  # the first stop of the Tab order, shown when focused
    assert page.locator("a.skip").bounding_box()["x"] >= 0
    page.keyboard.press("Enter")
    assert page.evaluate("() => document.activeElement.id") == "prompt"
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.id") == "send"
    page.screenshot(path=str(out / "desktop.png"))

    phone = new_page(browser, server, viewport=PHONE)
    phone.set_input_files("#import-file", str(export))
    phone.wait_for_selector("#conversation-list li", state="attached")
    assert not phone.locator("#sidebar").is_visible()  # off-canvas on a narrow window
    phone.click("#open-sidebar")
    phone.click(".conv-open:text-is('Fibonacci in Python')")
    phone.wait_for_selector("article.assistant .math.rendered")
    phone.locator("#sidebar").wait_for(state="hidden")
    width = phone.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"]  # nothing sticks out sideways
    phone.screenshot(path=str(out / "phone.png"))
    phone.click("#open-sidebar")
    phone.wait_for_function(  # slid in
        "() => document.getElementById('sidebar').getBoundingClientRect().x === 0")
    phone.screenshot(path=str(out / "phone-conversations.png"))
    assert page.errors == [] and phone.errors == []
    for p in (page, phone):
        p.context.close()
    assert all((out / n).stat().st_size > 10_000 for n in ("desktop.png", "phone.png"))


def test_the_page_is_small():
    """Every file the page can load, libraries and licences included, in a few hundred KB."""
    root = Path(__file__).parents[1] / "src" / "tianxia" / "server" / "webui"
    files = [f for f in root.rglob("*") if f.is_file()]
    assert {"index.html", "app.js", "style.css", "marked.umd.js", "purify.min.js",
            "prism.min.js", "temml.min.js"} <= {f.name for f in files}
    assert all((root / "vendor" / f"{lib}.LICENSE").is_file()
               for lib in ("marked", "dompurify", "prism", "temml"))
    assert sum(f.stat().st_size for f in files) < 400_000


def test_no_webui_flag(smollm2_path):
    with ServerProcess([MODEL, "--no-webui", "--kv-cache-memory", "16MiB",
                        "--max-model-len", "128"]) as srv:
        assert httpx.get(srv.url + "/").status_code == 404
        assert httpx.get(srv.url + "/webui/app.js").status_code == 404
        assert httpx.get(srv.url + "/v1/models").status_code == 200
