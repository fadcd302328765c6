"""``POST /v1/chat/completions`` end to end: the official ``openai`` SDK against the one
shared test server (the real default model, SmolLM2-135M-Instruct, whose ChatML template
adds its own system prompt when the conversation does not start with one).

Greedy outputs are deterministic, so the expected texts are exact: the fp32 greedy texts
of ``tests/support/greedy_pins.py``, each checked there to be far from a tie on any CPU.
Prompt token counts are computed with ``transformers`` (``apply_chat_template`` on the
converted model folder's tokenizer), so a template or
tokenization difference between Sluice and transformers fails here. Every JSON body is
validated against ``CreateChatCompletionResponse``, every SSE chunk against
``CreateChatCompletionStreamResponse`` and every error against ``Error``, all from
OpenAI's published spec, with no substitutions: nothing Sluice sends for chat needs one.
``max_completion_tokens`` stays small everywhere: the suite shares two CPU cores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.e2e_chat import (
    Body,
    bad_request,
    chat,
    chat_stream,
    choice_parts,
    error_message,
    user,
)
from tests.support.greedy_pins import (
    FRANCE,
    FRANCE_ANSWER,
    FRANCE_QUESTION,
    HAIKU,
    HAIKU_24,
    ITALY_FOLLOW_UP,
    PIRATE,
    PIRATE_ANSWER,
    TWO,
    TWO_ANSWER,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


pytestmark = pytest.mark.model


EOS = "<|im_end|>"  # ChatML end of turn; the tokenizer's EOS
EOS_ID = 2
CONTEXT = 8192


FRANCE_TOKENS = ["The", " capital", " of", " France", " is", " Paris", ".", EOS]


# ------------------------------------------------------------------------ helpers


def streamed_content(chunks: Sequence[Body], index: int = 0) -> str:
    return "".join(part["delta"].get("content") or "" for part in choice_parts(chunks, index))


def streamed_logprob_tokens(chunks: Sequence[Body], index: int = 0) -> list[str]:
    return [
        entry["token"]
        for part in choice_parts(chunks, index)
        if part["logprobs"] is not None
        for entry in part["logprobs"]["content"]
    ]


def check_choice_framing(chunks: Sequence[Body], index: int) -> Body:
    """Per choice: the first part (only) carries ``role``, every delta carries
    ``reasoning_content: null``, and the last part (only) has a ``finish_reason``.
    Returns that finishing part."""
    parts = choice_parts(chunks, index)
    assert len(parts) >= 2, parts
    assert [("role" in p["delta"]) for p in parts] == [True] + [False] * (len(parts) - 1)
    assert parts[0]["delta"]["role"] == "assistant"
    assert all("reasoning_content" in p["delta"] for p in parts)
    assert all(p["delta"]["reasoning_content"] is None for p in parts)
    finished = [p["finish_reason"] is not None for p in parts]
    assert finished == [False] * (len(parts) - 1) + [True]
    return parts[-1]


def template_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, object]], **kwargs: Any
) -> list[int]:
    """``apply_chat_template`` tokenized, as a plain list of ids."""
    conversation: Any = [dict(m) for m in messages]
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)
    assert isinstance(ids, list)
    flat = [i for i in ids if isinstance(i, int)]
    assert len(flat) == len(ids), ids  # one conversation: a flat list of ids
    return flat


def template_text(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, object]], **kwargs: Any
) -> str:
    """``apply_chat_template`` rendered to text."""
    conversation: Any = [dict(m) for m in messages]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def count_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, object]]
) -> int:
    """The prompt length transformers gives plain messages with the generation prompt."""
    return len(template_ids(tokenizer, messages, add_generation_prompt=True))


# ----------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def france(client: openai.OpenAI, model: str) -> Body:
    """The reference greedy chat: finishes by itself well inside the 24-token cap."""
    return chat(client, model=model, messages=FRANCE, max_completion_tokens=24, temperature=0)


# ------------------------------------------------------------------ greedy unary


def test_greedy_capital_of_france(
    france: Body, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert france["model"] == model
    [choice] = france["choices"]
    assert choice["index"] == 0
    assert choice["message"]["content"] == FRANCE_ANSWER
    assert "tool_calls" not in choice["message"]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", EOS_ID)
    assert choice["logprobs"] is None  # not asked for; the key is still there
    usage = france["usage"]
    assert usage["prompt_tokens"] == count_prompt(tokenizer, FRANCE)
    assert usage["prompt_tokens"] == 37  # the default system prompt is in there
    assert usage["completion_tokens"] == len(FRANCE_TOKENS)  # the EOS is counted


def test_greedy_arithmetic_via_sdk_objects(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    completion = client.chat.completions.create(
        model=model, messages=TWO, max_completion_tokens=24, temperature=0
    )
    assert completion.object == "chat.completion"
    [choice] = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == TWO_ANSWER
    assert choice.message.refusal is None
    assert choice.finish_reason == "stop"
    assert choice.message.model_extra == {"reasoning_content": None}
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == count_prompt(tokenizer, TWO)
    assert completion.usage.completion_tokens == 12


def test_greedy_cut_by_the_token_cap(client: openai.OpenAI, model: str) -> None:
    body = chat(client, model=model, messages=HAIKU, max_completion_tokens=24, temperature=0)
    [choice] = body["choices"]
    assert choice["message"]["content"] == HAIKU_24
    assert (choice["finish_reason"], choice["matched_stop"]) == ("length", None)
    assert body["usage"]["completion_tokens"] == 24


def test_multi_turn_with_a_system_message(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    body = chat(client, model=model, messages=PIRATE, max_completion_tokens=24, temperature=0)
    [choice] = body["choices"]
    assert choice["message"]["content"] == PIRATE_ANSWER
    assert choice["finish_reason"] == "stop"
    # The given system message replaces the template's default one.
    rendered = template_text(tokenizer, PIRATE, add_generation_prompt=True)
    assert "SmolLM" not in rendered and "You are a pirate." in rendered
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert prompt_tokens == count_prompt(tokenizer, PIRATE)
    assert prompt_tokens == 50
    assert body["usage"]["completion_tokens"] == 11


def test_developer_role_reads_as_system(client: openai.OpenAI, model: str) -> None:
    as_developer = [{**PIRATE[0], "role": "developer"}, *PIRATE[1:]]
    body = chat(client, model=model, messages=as_developer, max_completion_tokens=24, temperature=0)
    assert body["choices"][0]["message"]["content"] == PIRATE_ANSWER
    assert body["usage"]["prompt_tokens"] == 50


def test_text_parts_are_joined_with_a_space(client: openai.OpenAI, model: str) -> None:
    # ChatML is a string-content template: SGLang joins the text parts with one space.
    parts = [
        {"type": "text", "text": "What is the capital"},
        {"type": "text", "text": "of France?"},
    ]
    body = chat(
        client,
        model=model,
        messages=[{"role": "user", "content": parts}],
        max_completion_tokens=24,
        temperature=0,
    )
    assert body["choices"][0]["message"]["content"] == FRANCE_ANSWER
    assert body["usage"]["prompt_tokens"] == 37


def test_sdk_message_objects_are_accepted_in_history(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    """SDK users append the response message as they got it: extra keys must be ignored."""
    first = client.chat.completions.create(
        model=model, messages=FRANCE, max_completion_tokens=24, temperature=0
    )
    answer = first.choices[0].message
    as_dict = {**answer.model_dump(), "annotations": []}
    # Every key a dumped response message has, most of them null.
    assert as_dict["refusal"] is None and as_dict["tool_calls"] is None
    assert as_dict["reasoning_content"] is None and as_dict["audio"] is None
    follow_up = user("And of Italy?")
    history: list[Any] = [*FRANCE, as_dict, *follow_up]
    body = chat(client, model=model, messages=history, max_completion_tokens=24, temperature=0)
    assert body["choices"][0]["message"]["content"] == ITALY_FOLLOW_UP
    plain = [*FRANCE, {"role": "assistant", "content": FRANCE_ANSWER}, *follow_up]
    expected = count_prompt(tokenizer, plain)
    assert body["usage"]["prompt_tokens"] == expected

    # The SDK's pydantic message object itself, as the SDK serializes it.
    again = chat(
        client,
        model=model,
        messages=[*FRANCE, answer, *follow_up],
        max_completion_tokens=24,
        temperature=0,
    )
    assert again["choices"][0]["message"]["content"] == ITALY_FOLLOW_UP
    assert again["usage"]["prompt_tokens"] == expected


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI, model: str) -> None:
    params: dict[str, Any] = {"model": model, "messages": FRANCE, "temperature": 0}
    fewer = chat(client, max_completion_tokens=3, max_tokens=10, **params)
    assert fewer["choices"][0]["message"]["content"] == "The capital of"
    assert fewer["choices"][0]["finish_reason"] == "length"
    assert fewer["usage"]["completion_tokens"] == 3
    more = chat(client, max_completion_tokens=5, max_tokens=2, **params)
    assert more["choices"][0]["message"]["content"] == "The capital of France is"
    assert more["usage"]["completion_tokens"] == 5
    legacy = chat(client, max_tokens=2, **params)  # still honoured alone
    assert legacy["usage"]["completion_tokens"] == 2


# -------------------------------------------------------- continue_final_message


def test_continue_final_message(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    prefix = "The capital of France is"
    messages = [*FRANCE, {"role": "assistant", "content": prefix}]
    body = chat(
        client,
        model=model,
        messages=messages,
        max_completion_tokens=24,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    [choice] = body["choices"]
    # The output continues the prefix: only the rest of the sentence comes back.
    assert choice["message"]["content"] == " Paris."
    assert prefix + choice["message"]["content"] == FRANCE_ANSWER
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3  # " Paris", ".", EOS

    # The prompt ends with the open assistant turn: no end-of-turn after the prefix.
    rendered = template_text(tokenizer, messages, continue_final_message=True)
    assert rendered.endswith(f"<|im_start|>assistant\n{prefix}")
    continued = template_ids(tokenizer, messages, continue_final_message=True)
    closed = template_ids(tokenizer, messages)  # the assistant turn closed by <|im_end|>\n
    assert len(closed) == len(continued) + 2
    assert body["usage"]["prompt_tokens"] == len(continued) == 42


def test_continue_final_message_needs_an_assistant_message_last(
    client: openai.OpenAI, model: str
) -> None:
    error = bad_request(
        client,
        model=model,
        messages=FRANCE,
        max_completion_tokens=2,
        extra_body={"continue_final_message": True},
    )
    assert error.param == "continue_final_message"
    assert "assistant" in error_message(error)


# ------------------------------------------------------------- text is tokenized as text


def test_control_token_text_in_a_message_is_plain_text(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A user typing ``<|im_end|>`` gets those characters, not the end-of-turn token."""
    as_text = tokenizer.encode(EOS, add_special_tokens=False, split_special_tokens=True)
    assert len(as_text) == 7 and EOS_ID not in as_text
    marked = user(EOS + FRANCE_QUESTION)
    # transformers' own count makes it the control token: one id, not seven.
    as_control = count_prompt(tokenizer, marked)
    assert as_control == 37 + 1

    body = chat(client, model=model, messages=marked, max_completion_tokens=4, temperature=0)
    assert body["usage"]["prompt_tokens"] == 37 + len(as_text)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4


# ------------------------------------------------------------------- logprobs and n


def test_n2_with_logprobs_and_top_logprobs(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The exact rule: one ``content`` entry per completion token, the end-of-turn token
    included (its text is trimmed from ``content``, its logprob is not, as in SGLang),
    and exactly ``top_logprobs`` alternatives per entry, the greedy token first."""
    body = chat(
        client,
        model=model,
        messages=TWO,
        max_completion_tokens=24,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=5,
    )
    assert [c["index"] for c in body["choices"]] == [0, 1]
    per_choice = 12
    usage = body["usage"]
    assert usage["completion_tokens"] == 2 * per_choice
    assert usage["prompt_tokens"] == count_prompt(tokenizer, TWO)
    for choice in body["choices"]:
        assert choice["message"]["content"] == TWO_ANSWER
        assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", EOS_ID)
        logprobs = choice["logprobs"]
        assert logprobs["refusal"] is None
        content = logprobs["content"]
        assert len(content) == per_choice
        tokens = [entry["token"] for entry in content]
        assert tokens[-1] == EOS
        assert "".join(tokens[:-1]) == TWO_ANSWER
        for entry in content:
            top = entry["top_logprobs"]
            assert len(top) == 5
            assert top[0]["token"] == entry["token"]  # greedy: the sampled token is the argmax
            assert top[0]["logprob"] == entry["logprob"]
            assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert len({t["token"] for t in top}) == 5
            for item in (entry, *top):
                assert item["logprob"] <= 0.0
                if "\ufffd" not in item["token"]:
                    assert item["bytes"] == list(item["token"].encode("utf-8")), item
        assert content[0]["top_logprobs"][1]["token"] == "2"
        assert content[9]["token"] == "4"
        assert content[9]["logprob"] == pytest.approx(-0.082, abs=0.01)
    first, second = (c["logprobs"]["content"] for c in body["choices"])
    assert [e["token"] for e in first] == [e["token"] for e in second]  # greedy twice


def test_logprobs_cut_by_the_cap_have_no_eos(client: openai.OpenAI, model: str) -> None:
    body = chat(
        client,
        model=model,
        messages=FRANCE,
        max_completion_tokens=4,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=5,
    )
    assert body["usage"]["completion_tokens"] == 8
    for choice in body["choices"]:
        assert choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert [e["token"] for e in content] == FRANCE_TOKENS[:4]
        assert all(len(e["top_logprobs"]) == 5 for e in content)


def test_logprobs_without_alternatives(client: openai.OpenAI, model: str) -> None:
    body = chat(
        client, model=model, messages=FRANCE, max_completion_tokens=24, temperature=0, logprobs=True
    )
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == FRANCE_TOKENS
    assert all(e["top_logprobs"] == [] for e in content)


# ----------------------------------------------------------------------- streaming


def test_stream_helper_adds_up_to_the_unary_call(
    client: openai.OpenAI, model: str, france: Body
) -> None:
    with client.chat.completions.stream(
        model=model,
        messages=FRANCE,
        max_completion_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    ) as events:
        deltas = [e.delta for e in events if e.type == "content.delta"]
        final = events.get_final_completion()
    unary = france["choices"][0]["message"]["content"]
    assert "".join(deltas) == unary == FRANCE_ANSWER
    assert len(deltas) > 1  # really streamed
    [choice] = final.choices
    assert choice.message.role == "assistant"  # not "assistantassistant": role sent once
    assert choice.message.content == unary
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [e.token for e in choice.logprobs.content] == FRANCE_TOKENS
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)


def test_raw_stream_n2_framing_and_usage(
    client: openai.OpenAI, model: str, france: Body, tokenizer: PreTrainedTokenizerBase
) -> None:
    chunks = chat_stream(
        client,
        model=model,
        messages=FRANCE,
        max_completion_tokens=24,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=2,
        stream_options={"include_usage": True},
    )
    *body, last = chunks
    # include_usage: one final chunk with no choices and the totals; none before it.
    assert last["choices"] == []
    prompt_tokens = count_prompt(tokenizer, FRANCE)
    assert last["usage"]["prompt_tokens"] == prompt_tokens
    assert last["usage"]["completion_tokens"] == 2 * len(FRANCE_TOKENS)
    assert last["usage"]["total_tokens"] == prompt_tokens + 2 * len(FRANCE_TOKENS)
    assert all(c["choices"] and c.get("usage") is None for c in body)
    assert all(len(c["choices"]) == 1 for c in body)
    # Choice indices first appear in increasing order (the Python accumulator needs it).
    first_seen = list(dict.fromkeys(c["choices"][0]["index"] for c in body))
    assert first_seen == [0, 1]
    for index in (0, 1):
        end = check_choice_framing(body, index)
        assert (end["finish_reason"], end["matched_stop"]) == ("stop", EOS_ID)
        assert streamed_content(body, index) == france["choices"][0]["message"]["content"]
        assert streamed_logprob_tokens(body, index) == FRANCE_TOKENS


def test_raw_stream_without_include_usage(client: openai.OpenAI, model: str) -> None:
    chunks = chat_stream(
        client, model=model, messages=FRANCE, max_completion_tokens=3, temperature=0
    )
    assert all(c["choices"] and c.get("usage") is None for c in chunks)
    end = check_choice_framing(chunks, 0)
    assert (end["finish_reason"], end["matched_stop"]) == ("length", None)
    assert streamed_content(chunks) == "The capital of"
    assert all(p["logprobs"] is None for p in choice_parts(chunks))


def test_stop_string_split_across_tokens_never_leaks(client: openai.OpenAI, model: str) -> None:
    # "ance is P" spans " France", " is", " Paris": "ance" and " is" must be held back.
    stop = "ance is P"
    params: dict[str, Any] = {
        "model": model,
        "messages": FRANCE,
        "max_completion_tokens": 24,
        "temperature": 0,
        "stop": [stop, "never"],
    }
    chunks = chat_stream(client, **params)
    assert streamed_content(chunks) == "The capital of Fr"
    for part in choice_parts(chunks):
        text = part["delta"].get("content") or ""
        assert "ance" not in text and " is" not in text, part
    end = check_choice_framing(chunks, 0)
    assert (end["finish_reason"], end["matched_stop"]) == ("stop", stop)

    unary = chat(client, **params)
    [choice] = unary["choices"]
    assert choice["message"]["content"] == "The capital of Fr"
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", stop)
    assert unary["usage"]["completion_tokens"] == 6


# ------------------------------------------------------------------------- errors


def test_functions_are_refused_with_a_migration_message(client: openai.OpenAI, model: str) -> None:
    error = bad_request(
        client,
        model=model,
        messages=FRANCE,
        functions=[{"name": "lookup", "parameters": {"type": "object", "properties": {}}}],
    )
    assert error.param == "functions"
    assert "tools" in error_message(error) and "deprecated" in error_message(error)
    error = bad_request(client, model=model, messages=FRANCE, function_call="auto")
    assert error.param == "function_call"
    assert "tool_choice" in error_message(error)


def test_store_true_is_refused(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, messages=FRANCE, store=True)
    assert error.param == "store"
    assert "not stored" in error_message(error)
    # store: false is the default and fine.
    body = chat(client, model=model, messages=FRANCE, store=False, max_completion_tokens=1)
    assert body["usage"]["completion_tokens"] == 1


def test_response_format_text_is_accepted(client: openai.OpenAI, model: str) -> None:
    body = chat(
        client,
        model=model,
        messages=FRANCE,
        response_format={"type": "text"},
        max_completion_tokens=3,
        temperature=0,
    )
    assert body["choices"][0]["message"]["content"] == "The capital of"


def test_top_logprobs_needs_logprobs(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, messages=FRANCE, top_logprobs=3)
    assert error.param == "top_logprobs"
    assert "logprobs" in error_message(error)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
    ids=["image_url", "input_audio"],
)
def test_non_text_content_parts_are_refused(
    client: openai.OpenAI, model: str, part: dict[str, Any]
) -> None:
    content = [{"type": "text", "text": "What is this?"}, part]
    error = bad_request(client, model=model, messages=[{"role": "user", "content": content}])
    assert error.param == "messages[0].content[1].type"
    assert "text only" in error_message(error)
    assert part["type"] in error_message(error)


def test_unknown_model(client: openai.OpenAI) -> None:
    error = bad_request(client, model="no-such-model", messages=FRANCE)
    assert error.code == "model_not_found"
    assert error.param == "model"
    assert "The model `no-such-model` does not exist" in error_message(error)


def test_empty_messages(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, messages=[])
    assert error.param == "messages"
    assert "empty" in error_message(error)


def test_max_completion_tokens_beyond_the_context(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompt_tokens = count_prompt(tokenizer, FRANCE)
    error = bad_request(client, model=model, messages=FRANCE, max_completion_tokens=CONTEXT)
    assert error.code == "context_length_exceeded"
    message = error_message(error)
    for count in (CONTEXT, CONTEXT + prompt_tokens, prompt_tokens):
        assert str(count) in message, (count, message)


def test_errors_before_a_stream_are_plain_http_errors(client: openai.OpenAI, model: str) -> None:
    # The SDK raises from create() itself: the server answered with a JSON error, not SSE.
    error = bad_request(client, model="no-such-model", messages=FRANCE, stream=True)
    assert error.code == "model_not_found"
    error = bad_request(client, model=model, messages=FRANCE, store=True, stream=True)
    assert error.param == "store"
