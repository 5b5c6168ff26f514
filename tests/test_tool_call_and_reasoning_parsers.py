"""The chat output parsers on model text, without a server: each family's tool-call format,
`<think>` reasoning, the choice of parser from a chat template, and streamed pieces adding up
to the non-streamed answer (through the official openai client's own stream accumulation).
SmolLM2, the default model, writes none of these formats by itself, so they are tested here
on text; tests/test_structured_outputs.py covers calls through a served model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from tokenizer_proc import openai_format as fmt
from tokenizer_proc.chat_output import ChoiceOutput, choice_output
from tokenizer_proc.protocol import ChatMessage
from tokenizer_proc.reasoning import ReasoningParser, thinking_open_in, uses_reasoning_parser
from tokenizer_proc.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolCallFormat,
    choose_tool_format,
)
from tokenizer_proc.tools import ToolPlan, template_messages

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
AUTO = ToolPlan([WEATHER, TIME], "auto")


def _parse(fmt_: ToolCallFormat, text: str, finish: str = "stop", reasons: bool = False, prompt: str = ""):
    output = choice_output(AUTO, fmt_, reasons, prompt)
    output.feed(text, finish)
    return output


def _calls(output: ChoiceOutput) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in output.calls]


CASES = [
    # (format, model text, content, calls)
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me look.\n", [("get_weather", {"city": "Oslo"})]),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (HERMES, '  {"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    (HERMES, '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>', []),
    (HERMES, '<tool_call>{"name": "get_time" "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get_time" "arguments": {}}</tool_call>', []),
    (HERMES, '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    (HERMES, "  The weather is {mild} <tool_ today.", "  The weather is {mild} <tool_ today.", []),
    (HERMES, "", "", []),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
    (LLAMA3_JSON, "It is sunny in {Oslo}.", "It is sunny in {Oslo}.", []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
     '{"name": "get_time", "arguments": {}}]', None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (MISTRAL, 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]',
     "Sure. ", [("get_weather", {"city": "Oslo"})]),
    (MISTRAL, ' [{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
    (MISTRAL, "[1] is a citation.", "[1] is a citation.", []),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (MISTRAL, '[TOOL_CALLS]get_weather{"city": "Oslo"}', None, [("get_weather", {"city": "Oslo"})]),
    (MISTRAL, "[TOOL_CALLS]no call here", "no call here", []),
    (LLAMA3_JSON, '<|python_tag|>{"name": "get_time", "parameters": {}}<|python_tag|>{"name": "get_time", '
     '"parameters": {}}', None, [("get_time", {}), ("get_time", {})]),
]  # fmt: skip


@pytest.mark.parametrize(("fmt_", "text", "content", "calls"), CASES)
def test_each_family_format_parses_into_content_and_calls(fmt_, text, content, calls):
    output = _parse(fmt_, text)
    assert output.message()["content"] == content
    assert _calls(output) == calls
    assert output.finish_reason == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize(("fmt_", "text", "content", "calls"), CASES)
def test_streamed_pieces_add_up_to_the_whole_answer_in_the_openai_clients_accumulation(fmt_, text, content, calls):
    """Fed one character at a time (the worst split a detokenizer can make), the chunks the
    server would send accumulate, in the openai client's own stream state, to the message
    the non-streamed answer has."""
    output = choice_output(AUTO, fmt_, False, "")
    state = ChatCompletionStreamState()

    def send(delta: dict, finish: str | None = None) -> None:
        state.handle_chunk(ChatCompletionChunk.model_validate(fmt.chat_chunk("c", 0, "m", 0, delta, finish)))

    send({"role": "assistant", "content": ""})
    for i, ch in enumerate(text):
        send(output.feed(ch, "stop" if i == len(text) - 1 else None))
    if not text:
        send(output.feed("", "stop"))
    send({}, output.finish_reason)
    final = state.get_final_completion().choices[0]
    assert (final.message.content or None) == (content or None)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls or []]
    assert got == calls
    assert final.finish_reason == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize(
    ("fmt_", "text", "opened_at", "closed_at"),
    [
        (HERMES, 'Hi <tool_call>{"name": "get_time", "arguments": {"x": 1}}</tool_call>\nmore', '"arguments": {', "1}"),
        (LLAMA3_JSON, '{"name": "get_time", "parameters": {"x": 1}}; {"name": "get_weather"', '"parameters": {', "1}"),
        (MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": {"x": 1}}] and', "}}]", "}}]"),
        (MISTRAL, '[TOOL_CALLS]get_time[ARGS]{"x": 1} and', "[ARGS]{", "1}"),
    ],
)
def test_a_streamed_call_goes_out_with_its_name_then_its_arguments_as_they_are_written(
    fmt_, text, opened_at, closed_at
):
    """The call (id, name) goes out once its arguments object opens (arrays: once they end),
    then its arguments text as it comes; they are whole the moment they close."""
    output = choice_output(AUTO, fmt_, False, "")
    opened = text.index(opened_at) + len(opened_at)
    closed = text.index(closed_at) + len(closed_at)
    for i, ch in enumerate(text):
        output.feed(ch)
        assert len(output.calls) == (1 if i + 1 >= opened else 0), text[: i + 1]
        if i + 1 >= closed:
            assert json.loads(output.calls[0]["function"]["arguments"]) == {"x": 1}
        elif output.calls:
            with pytest.raises(ValueError):
                json.loads(output.calls[0]["function"]["arguments"])


def test_a_call_cut_off_by_the_length_limit_keeps_what_was_written():
    """As OpenAI's: a call whose name went out stands, its arguments cut where the limit hit;
    a call cut before that is text."""
    output = _parse(HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Os', finish="length")
    assert output.finish_reason == "length" and output.message()["content"] is None
    assert output.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Os'}
    unclosed = _parse(HERMES, '<tool_call>{"name": "get_time", "arguments": {}}</tool_', finish="length")
    assert unclosed.message()["content"] is None and _calls(unclosed) == [("get_time", {})]
    early = _parse(HERMES, '<tool_call>{"name": "get_wea', finish="length")
    assert early.calls == [] and early.message()["content"] == '<tool_call>{"name": "get_wea'


def test_a_forced_call_is_read_as_the_bare_object_its_grammar_makes():
    output = choice_output(ToolPlan([WEATHER, TIME], "named", "get_time"), None, False, "")
    output.feed('{"name": "get_time", "arguments": {}}', "stop")
    assert output.message() == {"role": "assistant", "content": None, "tool_calls": output.calls}
    assert output.finish_reason == "tool_calls" and _calls(output) == [("get_time", {})]


def test_without_a_parser_or_tools_the_text_is_the_content():
    for output in (choice_output(AUTO, None, False, ""), choice_output(ToolPlan([], "none"), HERMES, False, "")):
        text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        assert output.feed(text, "stop") == {"content": text}
        assert output.message() == {"role": "assistant", "content": text} and output.finish_reason == "stop"


def test_family_formats_write_earlier_calls_as_they_parse_them():
    pairs = [('"get_weather"', '{"city": "Oslo"}'), ('"get_time"', "{}")]
    for family in (HERMES, LLAMA3_JSON, MISTRAL):
        output = _parse(family, family.calls_text(pairs))
        assert _calls(output) == [("get_weather", {"city": "Oslo"}), ("get_time", {})], family.name
        assert family.calls_text([]) == ""


def _tokenizer(template: str, added: dict[str, int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(chat_template=template, get_added_vocab=lambda: added or {})


def test_auto_picks_the_format_from_the_chat_template_or_control_tokens():
    assert choose_tool_format("auto", _tokenizer("{{ '[TOOL_CALLS]' }}")) is MISTRAL
    assert choose_tool_format("auto", _tokenizer("<tool_call>\n{{ tool_call | tojson }}")) is HERMES
    assert choose_tool_format("auto", _tokenizer("{{ '<|python_tag|>' }} ipython")) is LLAMA3_JSON
    assert choose_tool_format("auto", _tokenizer("plain", {"[TOOL_CALLS]": 5})) is MISTRAL
    assert choose_tool_format("auto", _tokenizer("{{ messages }}")) is HERMES
    assert choose_tool_format("llama3_json", _tokenizer("<tool_call>")) is LLAMA3_JSON
    assert choose_tool_format("none", _tokenizer("<tool_call>")) is None


# ---- reasoning ---------------------------------------------------------------------------


def test_think_goes_to_reasoning_content_and_the_answer_to_content():
    output = _parse(HERMES, "<think>\nThe user asks about Oslo.\n</think>\n\nIt is sunny.", reasons=True)
    assert output.message()["reasoning_content"] == "\nThe user asks about Oslo.\n"
    assert output.message()["content"] == "It is sunny."


def test_a_prompt_that_opens_think_makes_the_output_start_in_reasoning():
    """DeepSeek-R1's template ends the prompt with `<think>`; Qwen3's enable_thinking=false
    closes an empty one, and then the output is all answer."""
    assert thinking_open_in("<|Assistant|><think>\n") and not thinking_open_in("<think>\n\n</think>\n\n")
    output = _parse(HERMES, "Short thought.</think>Answer.", reasons=True, prompt="<|Assistant|><think>\n")
    assert output.message()["reasoning_content"] == "Short thought." and output.message()["content"] == "Answer."
    plain = _parse(HERMES, "Answer without thinking.", reasons=True, prompt="<think>\n\n</think>\n\n")
    assert plain.message()["reasoning_content"] is None
    assert plain.message()["content"] == "Answer without thinking."


def test_reasoning_then_a_tool_call_streams_in_order():
    text = '<think>Need weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    output = choice_output(AUTO, HERMES, True, "")
    kinds = []
    for i, ch in enumerate(text):
        kinds += list(output.feed(ch, "stop" if i == len(text) - 1 else None))
    assert kinds[0] == "reasoning_content" and kinds[-1] == "tool_calls" and "content" not in kinds
    assert output.reasoning_text == "Need weather." and output.message()["content"] is None
    assert _calls(output) == [("get_weather", {"city": "Oslo"})] and output.finish_reason == "tool_calls"


def test_unfinished_thinking_is_all_reasoning_and_split_tags_are_held():
    parser = ReasoningParser(open_at_start=False)
    events = [e for piece in ["<th", "ink>abc</th", "ink", ">", " x"] for e in parser.feed(piece)] + parser.finish()
    assert events == [("reasoning", "abc"), ("content", "x")]
    cut = ReasoningParser(open_at_start=True)
    assert cut.feed("still thinking </thi") == [("reasoning", "still thinking ")]
    assert cut.finish() == [("reasoning", "</thi")]


def test_auto_reasoning_parser_follows_the_template():
    assert uses_reasoning_parser("auto", _tokenizer("{{ '<think>\\n' }}"))
    assert not uses_reasoning_parser("auto", _tokenizer("{{ messages }}"))
    assert uses_reasoning_parser("deepseek_r1", _tokenizer("")) and not uses_reasoning_parser("none", _tokenizer(""))


def test_a_constrained_output_is_all_answer_even_where_the_prompt_opened_think():
    """A grammar (a forced call, a response_format) shapes the output from its first token, so
    there is no reasoning to split off, even after DeepSeek-R1's `<think>` prompt."""
    forced = ToolPlan([TIME], "required")
    output = choice_output(forced, HERMES, True, "<|Assistant|><think>\n", constrained=True)
    output.feed('{"name": "get_time", "arguments": {}}', "stop")
    assert _calls(output) == [("get_time", {})] and output.message()["reasoning_content"] is None


def test_an_answer_sent_back_with_its_reasoning_is_accepted_and_reaches_templates_that_take_it():
    turn = ChatMessage(role="assistant", content="Sunny.", reasoning_content="Oslo, so...")
    [native] = template_messages([turn], ToolPlan([], "none"), True, HERMES)
    assert native == {"role": "assistant", "content": "Sunny.", "reasoning_content": "Oslo, so..."}
    [plain] = template_messages([turn], ToolPlan([], "none"), False, HERMES)
    assert plain == {"role": "assistant", "content": "Sunny."}
