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
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from tokenizer_proc import openai_format as fmt
from tokenizer_proc.chat_output import ChoiceOutput, choice_output
from tokenizer_proc.chat_protocol import ChatMessage
from tokenizer_proc.pythonic_calls import PYTHONIC
from tokenizer_proc.reasoning import ReasoningParser, thinking_open_in, thinking_skipped_in, uses_reasoning_parser
from tokenizer_proc.structured import after_reasoning, schema_spec
from tokenizer_proc.tool_formats import choose_tool_format
from tokenizer_proc.tool_parsers import HERMES, LLAMA3_JSON, MISTRAL, ToolCallFormat
from tokenizer_proc.tools import ToolPlan, forced_call_spec, template_messages
from tokenizer_proc.xml_calls import QWEN3_CODER

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
    (PYTHONIC, '[get_weather(city="Oslo"), get_time()]', None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (PYTHONIC, "<|python_start|>[get_weather(city='Oslo, Norway', days=[1, 2], hourly=True)]<|python_end|>", None,
     [("get_weather", {"city": "Oslo, Norway", "days": [1, 2], "hourly": True})]),
    (PYTHONIC, ' [get_time(tz=None)]\n', None, [("get_time", {"tz": None})]),
    (PYTHONIC, "[1] is a citation.", "[1] is a citation.", []),
    (PYTHONIC, "[launch_rocket()]", "[launch_rocket()]", []),
    (PYTHONIC, "Hello [get_time()]", "Hello [get_time()]", []),
    (PYTHONIC, "[get_weather(city=open('x'))] then", "city=open('x'))] then", [("get_weather", {})]),
    (QWEN3_CODER, "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
     "</function>\n</tool_call>", "Let me look.\n", [("get_weather", {"city": "Oslo"})]),
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\n0451\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>\nDone.",
     "Done.", [("get_weather", {"city": "0451"}), ("get_time", {})]),
    (QWEN3_CODER, "<tool_call>\n<function=launch_rocket>\n</function>\n</tool_call>",
     "<tool_call>\n<function=launch_rocket>\n</function>\n</tool_call>", []),
    (QWEN3_CODER, "<tool_call>\n<function=get_time>\n</function>", None, [("get_time", {})]),
    (QWEN3_CODER, "a < b, and <tool_ is not a call", "a < b, and <tool_ is not a call", []),
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
        (PYTHONIC, "[get_time(x=1)] and", "get_time(", "x=1)"),
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
    for family in (HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC):
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
    assert choose_tool_format("auto", _tokenizer("[func_name1(params_name1=params_value1)]")) is PYTHONIC
    assert choose_tool_format("auto", _tokenizer("plain", {"<|python_start|>": 7})) is PYTHONIC
    assert choose_tool_format("auto", _tokenizer('{"name": function name, "parameters": ...}')) is LLAMA3_JSON
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


def _grammar_accepts(spec, text: str) -> bool:
    assert spec.kind in ("ebnf", "json_schema")
    if spec.kind == "json_schema":
        return _is_grammar_accept_string(str(Grammar.from_json_schema(spec.text, any_whitespace=False)), text)
    return _is_grammar_accept_string(spec.text, text)


FORCED_CALLS = {
    HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    LLAMA3_JSON: '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
    MISTRAL: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "get_time", "arguments": {}}]',
    PYTHONIC: '[get_weather(city="Oslo"), get_time()]',
    QWEN3_CODER: "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
    "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("family", FORCED_CALLS, ids=lambda f: f.name)
def test_a_forced_tool_choice_is_constrained_to_the_familys_own_format_and_read_back_by_its_parser(family):
    """`required` with parallel_tool_calls allows several calls in the family's wrapper;
    without it, or for a named function, exactly one; what the grammar allows, the parser reads."""
    text = FORCED_CALLS[family]
    required = forced_call_spec(ToolPlan([WEATHER, TIME], "required"), family, True)
    assert _grammar_accepts(required, text)
    assert not _grammar_accepts(required, "It is sunny.")
    output = choice_output(ToolPlan([WEATHER, TIME], "required"), family, False, "")
    output.feed(text, "stop")
    assert _calls(output) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert output.finish_reason == "tool_calls" and output.message()["content"] is None
    named = forced_call_spec(ToolPlan([WEATHER, TIME], "named", "get_weather"), family, None)
    one_call = family.calls_text([('"get_weather"', '{"city": "Oslo"}')])
    if family is HERMES:
        one_call = one_call.replace("<tool_call>", "<tool_call>\n").replace("</tool_call>", "\n</tool_call>")
    if family is MISTRAL:
        one_call = one_call.replace("[TOOL_CALLS] ", "[TOOL_CALLS]")
    assert _grammar_accepts(named, one_call) and not _grammar_accepts(named, text)
    for parallel in (False, None):
        single = forced_call_spec(ToolPlan([WEATHER, TIME], "required"), family, parallel)
        assert _grammar_accepts(single, one_call) and not _grammar_accepts(single, text)


def test_a_pythonic_forced_call_takes_only_values_of_each_parameters_type():
    tool = {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "unit": {"enum": ["C", "F"]}, "tags": {"type": "array", "items": {"type": "string"}},
    }}}  # fmt: skip
    spec = forced_call_spec(ToolPlan([tool], "required"), PYTHONIC, None)
    assert _grammar_accepts(spec, '[f(n=3, unit="C", tags=["a", "b"])]')
    for wrong in ('[f(n="3")]', '[f(unit="K")]', "[f(tags=[1])]", "[f(m=1)]", "[g()]"):
        assert not _grammar_accepts(spec, wrong), wrong


def test_structured_outputs_apply_only_after_the_reasoning_ends():
    """The thinking is free text up to `</think>`; the constraint starts after it. Where the
    prompt opened `<think>` (DeepSeek-R1) the output starts inside it; elsewhere the model
    may open one or answer at once."""
    schema = schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "x")
    opened = after_reasoning(schema, thinking_open=True)
    assert _grammar_accepts(opened, 'Maybe {"a": "x"}? No.</think>\n\n{"a": 1}')
    assert not _grammar_accepts(opened, '{"a": 1}')
    assert not _grammar_accepts(opened, "Hmm.</think>\n\nThe answer is 1.")
    assert not _grammar_accepts(opened, 'Hmm.</think>{"a": 1}</think>{"a": 1}')
    optional = after_reasoning(schema, thinking_open=False)
    assert _grammar_accepts(optional, '<think>Easy.</think>\n{"a": 1}') and _grammar_accepts(optional, '{"a": 1}')
    assert not _grammar_accepts(optional, 'Sure: {"a": 1}')
    # Qwen3 with enable_thinking false closes an empty block: no thinking, the constraint from the start
    assert thinking_skipped_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not thinking_skipped_in("<|im_start|>assistant\n") and not thinking_skipped_in("<think>\n")
    output = choice_output(ToolPlan([TIME], "required"), HERMES, True, "<|Assistant|><think>\n")
    output.feed('Call it.</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "stop")
    assert output.message()["reasoning_content"] == "Call it." and _calls(output) == [("get_time", {})]


def test_an_answer_sent_back_with_its_reasoning_is_accepted_and_reaches_templates_that_take_it():
    turn = ChatMessage(role="assistant", content="Sunny.", reasoning_content="Oslo, so...")
    [native] = template_messages([turn], ToolPlan([], "none"), True, HERMES)
    assert native == {"role": "assistant", "content": "Sunny.", "reasoning_content": "Oslo, so..."}
    [plain] = template_messages([turn], ToolPlan([], "none"), False, HERMES)
    assert plain == {"role": "assistant", "content": "Sunny."}


def test_qwen3_coder_values_are_read_by_their_parameters_types():
    tool = {"name": "f", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "n": {"type": "integer"}, "on": {"type": "boolean"},
        "tags": {"type": "array"}, "where": {"type": "object"}, "unit": {"enum": ["C", "F"]},
    }}}  # fmt: skip
    text = QWEN3_CODER.calls_text([('"f"', '{"zip": "01234", "n": 3, "on": true, "tags": ["a"], "where": {"x": 1}}')])
    output = choice_output(ToolPlan([tool], "auto"), QWEN3_CODER, False, "")
    output.feed(text.replace("true", "True") + "\n<tool_call>\n<function=f>\n<parameter=n>\nmany\n</parameter>\n"
                "</function>\n</tool_call>", "stop")  # fmt: skip
    assert _calls(output) == [("f", {"zip": "01234", "n": 3, "on": True, "tags": ["a"], "where": {"x": 1}}),
                              ("f", {"n": "many"})]  # fmt: skip
    spec = forced_call_spec(ToolPlan([tool], "required"), QWEN3_CODER, None)
    assert _grammar_accepts(spec, text.replace("<parameter=where>", "<parameter=unit>\nC\n</parameter>\n"
                                               "<parameter=where>"))  # fmt: skip
    for key, value in (("n", "many"), ("zip", "a</b"), ("unit", "K"), ("size", "3")):
        bad = f"<tool_call>\n<function=f>\n<parameter={key}>\n{value}\n</parameter>\n</function>\n</tool_call>"
        assert not _grammar_accepts(spec, bad), bad


def test_auto_picks_qwen3_coder_from_its_template_before_hermes():
    template = "{% for t in tools %}<tool_call>\n<function={{ t.name }}>\n<parameter=x>{% endfor %}"
    assert choose_tool_format("auto", _tokenizer(template)) is QWEN3_CODER
