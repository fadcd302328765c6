"""``/v1/models`` end to end: the official SDK against the shared test server, every body
checked against OpenAI's published schemas."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.openapi import validate

if TYPE_CHECKING:
    from tests.conftest import Server

pytestmark = pytest.mark.model


def get(url: str) -> tuple[int, str, Any]:
    """A plain GET: status, content type and the decoded JSON body (no SDK in between)."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.headers["Content-Type"], json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], json.load(error)


def test_list_models(server: Server, client: openai.OpenAI) -> None:
    raw = client.models.with_raw_response.list()
    body = json.loads(raw.text)
    validate("ListModelsResponse", body)
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == [server.model]
    card = body["data"][0]
    assert card["object"] == "model"
    assert isinstance(card["created"], int) and card["created"] > 1_600_000_000
    # SGLang's extras on the card: the context length the server enforces, and the
    # served name as ``root`` (never a filesystem path).
    assert card["max_model_len"] == 8192
    assert card["root"] == server.model
    # What the model says of itself, read from its config, generation config and tokenizer.
    assert card["architecture"] == "LlamaForCausalLM"
    assert card["eos_token_ids"] == [2]
    assert card["bos_token_id"] == 1 and card["adds_bos_token"] is False
    assert card["attention"] == {
        "layer_types": {"full_attention": 30},
        "sliding_window": None,
        "implementation": "sdpa",
    }
    assert card["chat_template"] == "model"
    assert card["tool_call_parser"] == "json" and card["reasoning_parser"] is None
    assert "/" not in json.dumps({k: v for k, v in card.items() if k != "id"})

    page = client.models.list()
    assert [model.id for model in page.data] == [server.model]
    assert page.object == "list"


def test_retrieve_model(server: Server, client: openai.OpenAI) -> None:
    raw = client.models.with_raw_response.retrieve(server.model)
    body = json.loads(raw.text)
    validate("Model", body)
    assert body["id"] == server.model
    assert body["object"] == "model"

    model = client.models.retrieve(server.model)
    assert model.id == server.model
    assert model.owned_by == body["owned_by"]
    # The listed card and the retrieved one are the same object.
    assert client.models.list().data[0].created == model.created


def test_retrieve_model_raw_path(server: Server) -> None:
    status, content_type, body = get(f"{server.v1}/models/{server.model}")
    assert status == 200
    assert content_type.startswith("application/json")
    validate("Model", body)
    assert body["id"] == server.model


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("no-such-org%2Fno-such-model", id="percent-encoded-slash"),
        pytest.param("no-such-org/no-such-model", id="raw-slash"),
    ],
)
def test_unknown_model_is_404_model_not_found(server: Server, path: str) -> None:
    status, content_type, body = get(f"{server.v1}/models/{path}")
    assert status == 404
    assert content_type.startswith("application/json")
    validate("ErrorResponse", body)
    error = body["error"]
    assert error["code"] == "model_not_found"
    assert error["type"] == "invalid_request_error"
    # Both spellings reach the handler as the same, decoded id.
    assert "no-such-org/no-such-model" in error["message"]
    assert "does not exist" in error["message"]


def test_unknown_model_with_slash_via_sdk(client: openai.OpenAI) -> None:
    # The SDK percent-encodes "/" in path parameters (``path_template``).
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-org/no-such-model")
    assert raised.value.status_code == 404
    assert raised.value.code == "model_not_found"
    assert isinstance(raised.value.body, dict)
    assert "no-such-org/no-such-model" in raised.value.body["message"]
