"""The web page against the real server and model, in headless Chromium, as a person
uses it: a prompt streams in token by token, Stop cancels (the viewer then says
``cancelled`` and the server's cancel count moves), a reload goes on with the same
conversation, and a JSON-schema request renders valid JSON. The page's requests are
read back through the official SDK, so every check is against what the server kept."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

import jsonschema
import pytest
from selenium.webdriver.common.by import By

from tests.conftest import Server
from tests.support.browser import (
    FINAL,
    chromium,
    js_errors,
    last_reply,
    open_page,
    screenshot,
    set_parameter,
    settled_reply,
    type_prompt,
    wait_until,
)

pytestmark = pytest.mark.model

CANCELS = re.compile(
    r'^sluice_requests_total\{route="/v1/responses/\{response_id\}/cancel",status="200"\} (\d+)$',
    re.M,
)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _cancels(server: Server) -> int:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        found = CANCELS.search(r.read().decode())
    return int(found.group(1)) if found else 0


def test_a_prompt_streams_in_token_by_token(server: Server, client: Any) -> None:
    with chromium() as driver:
        open_page(driver, server.base_url + "/")
        assert driver.find_element(By.CSS_SELECTOR, "#model-card .model-id").text == server.model
        set_parameter(driver, "temperature", "0")
        set_parameter(driver, "max-tokens", "32")
        type_prompt(driver, "Name three colours.")
        streaming: list[str] = []  # each new text shown while the reply was not done

        def finished() -> dict[str, str] | None:
            reply = last_reply(driver)
            if (
                reply["status"] in ("", "queued", "in_progress")
                and reply["text"]
                and (not streaming or streaming[-1] != reply["text"])
            ):
                streaming.append(reply["text"])
                if len(streaming) == 3:
                    screenshot(driver, "streaming")
            return reply if reply["status"] in FINAL else None

        wait_until(finished, every=0.01)
        reply = settled_reply(driver)
        screenshot(driver, "streamed")
        assert not js_errors(driver)
    stored = client.responses.retrieve(reply["id"])
    assert reply["status"] == stored.status and stored.output_text.strip()
    assert reply["raw"] == stored.output_text
    # Token by token: the text changed many times before the reply was done.
    assert len(streaming) >= 3, streaming
    assert stored.usage is not None and stored.usage.output_tokens > 1
    assert (stored.temperature, stored.max_output_tokens) == (0.0, 32)


def test_stop_cancels_and_the_viewer_says_cancelled(server: Server, client: Any) -> None:
    before = _cancels(server)
    with chromium() as driver:
        open_page(driver, server.base_url + "/")
        set_parameter(driver, "max-tokens", "1000")
        type_prompt(driver, "Write a very long story about a dragon who learns to sail.")
        wait_until(lambda: last_reply(driver)["text"])
        driver.find_element(By.ID, "stop").click()
        reply = settled_reply(driver)
        screenshot(driver, "stopped")
        assert reply["status"] == "cancelled"
        driver.find_element(By.CSS_SELECTOR, ".lifecycle-link").click()
        wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, ".lifecycle-status"))
        screenshot(driver, "viewer-cancelled")
        status = driver.find_element(By.CSS_SELECTOR, ".lifecycle-status").get_attribute(
            "data-status"
        )
        kinds = [li.get_attribute("data-type") for li in
                 driver.find_elements(By.CSS_SELECTOR, ".timeline li")]  # fmt: skip
        times = [t.text for t in driver.find_elements(By.CSS_SELECTOR, ".timeline li time")]
        assert not js_errors(driver)
    assert status == "cancelled" == client.responses.retrieve(reply["id"]).status
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.cancelled"
    assert times[0] == "+0 ms" and all(t.startswith("+") for t in times[:-1])
    assert _cancels(server) == before + 1


def test_a_reload_goes_on_with_the_same_conversation(server: Server, client: Any) -> None:
    with chromium() as driver:
        open_page(driver, server.base_url + "/")
        set_parameter(driver, "temperature", "0")
        set_parameter(driver, "max-tokens", "16")
        type_prompt(driver, "My name is Ada.")
        first = settled_reply(driver)
        driver.refresh()
        open_page(driver, driver.current_url)
        titles = [a.text for a in driver.find_elements(By.CSS_SELECTOR, "#conversations a")]
        assert titles == ["My name is Ada."]
        shown = driver.find_elements(By.CSS_SELECTOR, "#messages article")
        assert [m.get_attribute("data-role") for m in shown] == ["user", "assistant"]
        assert last_reply(driver)["text"] == first["text"]
        type_prompt(driver, "What is my name?")
        second = settled_reply(driver, after=first["id"])
        screenshot(driver, "reloaded-and-continued")
        assert len(driver.find_elements(By.CSS_SELECTOR, "#messages article")) == 4
        assert not js_errors(driver)
    assert first["status"] in ("completed", "incomplete")
    assert client.responses.retrieve(second["id"]).previous_response_id == first["id"]
    items = client.responses.input_items.list(second["id"], order="asc").data
    assert [i.content[0].text for i in items] == ["What is my name?"]  # only the new turn


def test_a_json_schema_request_renders_valid_json(server: Server, client: Any) -> None:
    with chromium() as driver:
        open_page(driver, server.base_url + "/")
        set_parameter(driver, "temperature", "0")
        set_parameter(driver, "max-tokens", "96")
        set_parameter(driver, "json-schema", json.dumps(PERSON))
        type_prompt(driver, "Invent a person.")
        reply = settled_reply(driver)
        screenshot(driver, "json-schema")
        shown_as_code = driver.find_elements(By.CSS_SELECTOR, "#messages .assistant pre code")
        assert not js_errors(driver)
    assert reply["status"] == "completed", reply
    value = json.loads(reply["text"])
    jsonschema.validate(value, PERSON)
    assert shown_as_code and reply["raw"] == reply["text"]
    assert reply["raw"] == client.responses.retrieve(reply["id"]).output_text
