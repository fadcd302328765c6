"""The web page over the fake engine (no model): how it is served (public, strict CSP,
ETags, ``--no-webui``), the event log with its times that the viewer reads, and, in
headless Chromium, the two checks a fixed reply makes exact: text a model wrote is
never markup, and a keyed server refuses the page until the key is given."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest

from sluice.http.app import create_app
from sluice.http.webui import CONTENT_SECURITY_POLICY, load_assets
from tests.support.app_thread import serve
from tests.support.browser import (
    chromium,
    js_errors,
    open_page,
    screenshot,
    settled_reply,
    type_prompt,
    wait_until,
)
from tests.support.fake_engine import FakeEngine, fake_state

HOSTILE = 'Hi <script>window.__xss = 1</script><img src=x onerror="window.__xss = 2"> **bold**'


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@contextmanager
def page_server(
    tokenizer: Any,
    reply: str = "la",
    once: bool = False,
    reasoning_parser: str | None = None,
    **options: Any,
) -> Iterator[str]:
    """The app over a fake engine that writes ``reply`` over and over (``once``: then
    stops, as at an end token)."""
    from sluice.pipeline.chat import ChatSetup

    engine = FakeEngine(tokens=tokenizer.encode(reply), step_s=0.02, stop_after_cycle=once)
    state = fake_state(tokenizer, engine)
    if reasoning_parser is not None:
        state.chat = ChatSetup.for_tokenizer(None, tokenizer, reasoning_parser=reasoning_parser)
    with serve(create_app(state, **options)) as url:
        yield url


def test_the_page_and_its_modules_are_served_with_a_strict_policy(tokenizer: Any) -> None:
    with page_server(tokenizer) as url:
        status, headers, body = _get(url + "/")
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        assert body == load_assets()["index.html"].body
        assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        assert "script-src 'self'" in CONTENT_SECURITY_POLICY
        assert "unsafe-inline" not in CONTENT_SECURITY_POLICY
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Cache-Control"] == "no-cache"
        again = _get(url + "/", {"If-None-Match": headers["ETag"]})
        assert (again[0], again[2]) == (304, b"")
        for name in ("app.js", "api.js", "markdown.js", "viewer.js", "strip.js",
                     "conversations.js", "style.css"):  # fmt: skip
            status, headers, body = _get(f"{url}/webui/{name}")
            assert status == 200 and body, name
            kind = "text/css" if name.endswith(".css") else "text/javascript"
            assert headers["Content-Type"] == f"{kind}; charset=utf-8"
        status, _, body = _get(url + "/webui/missing.js")
        assert status == 404 and orjson.loads(body)["error"]["message"] == (
            "Not found: /webui/missing.js"
        )


def test_every_module_the_page_imports_is_served() -> None:
    """A module named in an import but missing from the package would fail only in a
    browser: read every import of every served module."""
    import re

    assets = load_assets()
    for name, asset in assets.items():
        if name.endswith(".js"):
            for imported in re.findall(rb'from "\./([\w.]+)"', asset.body):
                assert imported.decode() in assets, (name, imported)


def test_with_api_keys_the_page_is_public_and_the_api_is_not(tokenizer: Any) -> None:
    with page_server(tokenizer, api_keys=frozenset({"sk-page"})) as url:
        assert _get(url + "/")[0] == 200
        assert _get(url + "/webui/app.js")[0] == 200
        assert _get(url + "/v1/models")[0] == 401
        assert _get(url + "/v1/models", {"Authorization": "Bearer sk-page"})[0] == 200


def test_no_webui_serves_no_page(tokenizer: Any) -> None:
    with page_server(tokenizer, webui=False, api_keys=frozenset({"sk-page"})) as url:
        assert _get(url + "/")[0] == 401  # not public without the page: the key comes first
        assert _get(url + "/", {"Authorization": "Bearer sk-page"})[0] == 404
        assert _get(url + "/webui/app.js", {"Authorization": "Bearer sk-page"})[0] == 404


def test_the_event_log_has_each_events_time_and_the_streams_bytes(tokenizer: Any) -> None:
    """``GET …/events``: the events the stream replay gives, in order, each with the
    time it was logged (never decreasing, within the request's span)."""
    import openai

    with page_server(tokenizer) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        before = time.time()
        response = sdk.responses.create(model="fake-model", input="Sing", max_output_tokens=16)
        after = time.time()
        status, _, body = _get(f"{url}/v1/responses/{response.id}/events")
        assert status == 200
        log = orjson.loads(body)
        replayed = [e.model_dump(exclude_unset=True) for e in
                    sdk.responses.retrieve(response.id, stream=True)]  # fmt: skip
        assert [e["event"] for e in log["data"]] == replayed
        times = [e["at"] for e in log["data"]]
        assert times == sorted(times) and before <= times[0] and times[-1] <= after
        types = [e["event"]["type"] for e in log["data"]]
        assert types[0] == "response.created" and types[-1] == "response.incomplete"
        assert types.count("response.output_text.delta") == 16
        missing = _get(f"{url}/v1/responses/resp_{'0' * 32}/events")
        assert missing[0] == 404


@pytest.mark.parametrize("width", [1200, 390])
def test_a_reply_with_markup_renders_as_text(tokenizer: Any, width: int) -> None:
    """The model's ``<script>`` and ``onerror`` arrive as text nodes; markdown still
    renders (``**bold**``). At a phone's width too."""
    with page_server(tokenizer, reply=HOSTILE) as url, chromium(width=width) as driver:
        open_page(driver, url + "/")
        type_prompt(driver, "Say something")
        reply = settled_reply(driver, "incomplete")
        screenshot(driver, f"markup-as-text-{width}")
        assert "<script>window.__xss = 1</script>" in reply["text"]
        assert driver.execute_script("return window.__xss === undefined")
        assert (
            driver.execute_script(
                "return document.querySelectorAll('#messages script, #messages img').length"
            )
            == 0
        )
        assert (
            driver.execute_script(
                "return document.querySelector('#messages article[data-role=assistant] strong')"
                ".textContent"
            )
            == "bold"
        )
        # Nothing wider than the window, at a phone's width too.
        assert driver.execute_script(
            "return document.documentElement.scrollWidth <= window.innerWidth"
        )
        assert not js_errors(driver)


def test_a_keyed_server_refuses_the_page_until_the_key_is_given(tokenizer: Any) -> None:
    from selenium.webdriver.common.by import By

    def dialog_open() -> bool:
        return bool(driver.execute_script("return document.getElementById('key-dialog').open"))

    with page_server(tokenizer, api_keys=frozenset({"sk-page"})) as url, chromium() as driver:
        driver.get(url + "/")
        wait_until(dialog_open)
        reason = driver.find_element(By.ID, "key-reason").text
        assert reason.startswith("Missing API key")
        assert driver.find_element(By.ID, "model-card").text == "Loading the model card…"
        screenshot(driver, "api-key-asked")
        driver.find_element(By.ID, "api-key").send_keys("sk-wrong\n")
        wait_until(lambda: "Incorrect API key" in driver.find_element(By.ID, "key-reason").text)
        assert dialog_open()
        key = driver.find_element(By.ID, "api-key")
        key.clear()
        key.send_keys("sk-page\n")
        wait_until(lambda: driver.execute_script("return document.body.dataset.ready"))
        assert driver.find_element(By.CSS_SELECTOR, "#model-card .model-id").text == "fake-model"
        type_prompt(driver, "Hello")
        settled_reply(driver, "incomplete")
        # Asked once: the key is kept, and a reload does not ask again.
        driver.refresh()
        wait_until(lambda: driver.execute_script("return document.body.dataset.ready"))
        assert not dialog_open()
        screenshot(driver, "api-key-given")
        assert not [e for e in js_errors(driver) if "401" not in e]


MARKDOWN_CASES = [
    ("**bold** and *em* and `a<b>`",
     "<p><strong>bold</strong> and <em>em</em> and <code>a&lt;b&gt;</code></p>"),
    ("snake_case_name and window.__x = 1; f.__y",
     "<p>snake_case_name and window.__x = 1; f.__y</p>"),
    ("```python\nif a < b:\n    print('<b>')\n```",
     '<pre><code data-language="python">if a &lt; b:\n    print(\'&lt;b&gt;\')</code></pre>'),
    ("```\nstill streaming <i>", "<pre><code>still streaming &lt;i&gt;</code></pre>"),
    ("# Title\n- one\n- two\n\n1. first",
     "<h3>Title</h3><ul><li>one</li><li>two</li></ul><ol><li>first</li></ol>"),
    ("> quoted\n> <u>", "<blockquote>quoted<br>&lt;u&gt;</blockquote>"),
    ("[ok](https://example.org) [bad](javascript:alert(1))",
     '<p><a href="https://example.org" rel="noopener noreferrer nofollow" target="_blank">ok</a>'
     " [bad](javascript:alert(1))</p>"),
    ("line one\nline two", "<p>line one<br>line two</p>"),
    ("1. one\n\nsaid\n\n2. two", '<ol><li>one</li></ol><p>said</p><ol start="2"><li>two</li></ol>'),
]  # fmt: skip


def test_markdown_renders_structure_and_keeps_every_character_as_text(tokenizer: Any) -> None:
    """The page's own renderer, run in the browser: structure becomes elements, every
    character of the text stays text (escaped in the serialised HTML), and only http(s)
    and mailto links become links."""
    script = """
        const [cases, done] = arguments;
        import('/webui/markdown.js').then(({renderMarkdown}) => done(cases.map((text) => {
            const box = document.createElement('div');
            box.append(renderMarkdown(text));
            return box.innerHTML;
        })));
    """
    with page_server(tokenizer) as url, chromium() as driver:
        open_page(driver, url + "/")
        rendered = driver.execute_async_script(script, [text for text, _ in MARKDOWN_CASES])
    assert rendered == [html for _, html in MARKDOWN_CASES]


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}  # fmt: skip


def test_a_tool_call_is_an_item_and_its_output_goes_back(tokenizer: Any) -> None:
    """A call the model makes shows as a function-call item with a box for its output;
    the output sent goes back as a ``function_call_output`` item continuing the reply."""
    import json

    from selenium.webdriver.common.by import By

    from tests.support.browser import set_parameter

    call = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    with page_server(tokenizer, reply=call, once=True) as url, chromium() as driver:
        open_page(driver, url + "/")
        set_parameter(driver, "tools", json.dumps([WEATHER]))
        type_prompt(driver, "Weather in Paris?")
        first = settled_reply(driver, "completed")
        shown = driver.find_element(By.CSS_SELECTOR, ".function-call .call").text
        assert shown == 'Function call: get_weather({"city": "Paris"})'
        box = driver.find_element(By.CSS_SELECTOR, ".call-output input")
        box.send_keys("18 C, sunny\n")
        second = settled_reply(driver, "completed", after=first["id"])
        screenshot(driver, "tool-call")
        roles = [a.get_attribute("data-role") for a in
                 driver.find_elements(By.CSS_SELECTOR, "#messages article")]  # fmt: skip
        assert roles == ["user", "assistant", "tool", "assistant"]
        assert not js_errors(driver)
        status, _, body = _get(f"{url}/v1/responses/{second['id']}/input_items")
        stored, _, response = _get(f"{url}/v1/responses/{second['id']}")
    assert status == stored == 200
    (item,) = orjson.loads(body)["data"]
    assert (item["type"], item["output"]) == ("function_call_output", "18 C, sunny")
    assert orjson.loads(response)["previous_response_id"] == first["id"]


def test_reasoning_is_shown_collapsed(tokenizer: Any) -> None:
    from selenium.webdriver.common.by import By

    reply = "<think>Two and two.</think>Four."
    with (
        page_server(tokenizer, reply=reply, once=True, reasoning_parser="qwen3") as url,
        chromium() as driver,
    ):
        open_page(driver, url + "/")
        type_prompt(driver, "2+2?")
        done = settled_reply(driver, "completed")
        details = driver.find_element(By.CSS_SELECTOR, "#messages details.reasoning")
        assert details.get_attribute("open") is None
        assert details.find_element(By.TAG_NAME, "summary").text == "Reasoning"
        assert done["text"] == "Four."
        details.find_element(By.TAG_NAME, "summary").click()
        assert details.find_element(By.TAG_NAME, "div").text == "Two and two."
        screenshot(driver, "reasoning")
        assert not js_errors(driver)


def test_the_keyboard_alone_chats_and_opens_the_viewer(tokenizer: Any) -> None:
    """Tab to the skip link, Enter, type, Enter; Tab to the reply's lifecycle link,
    Enter; Shift+Tab back to the conversation link, Enter."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    def focused() -> dict[str, str]:
        return dict(driver.execute_script(
            "const a = document.activeElement;"
            "return {id: a.id, cls: a.className, text: a.textContent.trim().slice(0, 40)};"
        ))  # fmt: skip

    def press(*keys: str) -> None:
        ActionChains(driver).send_keys(*keys).perform()

    with page_server(tokenizer, reply="Hello there.", once=True) as url, chromium() as driver:
        open_page(driver, url + "/")
        press(Keys.TAB)
        assert focused()["text"] == "Skip to the message box"
        press(Keys.ENTER)
        assert focused()["id"] == "prompt"
        press("Hi", Keys.ENTER)
        settled_reply(driver, "completed")
        for _ in range(40):
            if focused()["cls"] == "lifecycle-link":
                break
            press(Keys.TAB)
        assert focused()["cls"] == "lifecycle-link"
        press(Keys.ENTER)
        wait_until(lambda: focused()["text"] == "Response lifecycle")
        ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.TAB).key_up(Keys.SHIFT).perform()
        assert focused()["text"] == "← back to the conversation"
        press(Keys.ENTER)
        wait_until(lambda: driver.execute_script(
            "return !document.getElementById('chat-view').hidden"))  # fmt: skip
        assert not js_errors(driver)
