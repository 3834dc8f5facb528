"""tierlm.structured.tools and .turn without a server: messages prepared for a
template that knows tools or not, the checks on tools and tool_choice, the
call grammars (compiled and driven token by token with the default model's
tokenizer) and a turn's preparation and start."""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
from tool_testing import WEATHER as TOOL_WEATHER

from tierlm.structured.grammar import GrammarConstraint, ModelGrammars, lark_grammar
from tierlm.structured.tool_formats import GENERIC, HERMES, format_named
from tierlm.structured.tools import (
    Tool,
    ToolChoice,
    TurnError,
    call_grammar,
    check_tools,
    generic_instructions,
    strip_private,
    template_messages,
    with_instructions,
)
from tierlm.structured.turn import ModelTurns, TurnSpec

WEATHER = Tool(**TOOL_WEATHER["function"])
TIME = Tool(
    "get_time",
    "The current time in a time zone.",
    {
        "type": "object",
        "properties": {"zone": {"type": "string"}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)
NOW = Tool("now")  # no parameters
TOOLS = [WEATHER, TIME, NOW]
PARIS = '{"city": "Paris", "unit": "celsius"}'

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "14:00"},
    {"role": "assistant", "content": "21 degrees, 14:00."},
    {"role": "user", "content": "Thanks."},
]


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return ModelGrammars(tokenizer)


@pytest.fixture(scope="module")
def turns(tokenizer):
    return ModelTurns(tokenizer)  # SmolLM2's template knows no tools: generic


@pytest.fixture(scope="module")
def native_turns(tokenizer):
    return ModelTurns(tokenizer, tool_format="hermes")


# ---- messages --------------------------------------------------------------


def test_generic_messages_become_text_turns_that_alternate():
    sent = copy.deepcopy(HISTORY)
    out = template_messages(sent, GENERIC)
    assert sent == HISTORY, "the request's messages are not changed"
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert out[2] == {
        "role": "assistant",
        "content": 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
    }
    results = out[3]["content"].split("\n")
    assert [
        json.loads(r.removeprefix("<tool_response>").removesuffix("</tool_response>")) for r in results
    ] == [
        {"tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"tool_call_id": "call_2", "content": "14:00", "name": "get_time"},
    ]
    assert all(set(m) <= {"role", "content", "name", "_results"} for m in out)
    assert strip_private(out)[3] == {"role": "user", "content": out[3]["content"]}


def test_generic_calls_keep_arguments_the_client_wrote_as_text():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}},
            {"id": "d", "type": "function", "function": {"name": "g"}},
        ],
    }
    [out] = template_messages([message], GENERIC)
    assert out["content"] == (
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )


def test_generic_results_next_to_a_user_message_still_alternate():
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
        {"role": "user", "content": "And in Celsius?"},
    ]
    roles = [m["role"] for m in template_messages(messages, GENERIC)]
    assert all(a != b for a, b in itertools.pairwise(roles)), roles


def test_native_messages_get_argument_objects():
    sent = copy.deepcopy(HISTORY)
    out = template_messages(sent, HERMES)
    assert sent == HISTORY
    assert [m["role"] for m in out] == [m["role"] for m in HISTORY]
    assert [c["function"]["arguments"] for c in out[2]["tool_calls"]] == [json.loads(PARIS), {"zone": "CET"}]
    assert out[2]["tool_calls"][0]["id"] == "call_1" and out[3] == HISTORY[3]
    [odd] = template_messages(
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "function": {"name": "f", "arguments": "{bad"}},
                    {"id": "d", "function": {"name": "g"}},
                ],
            }
        ],
        HERMES,
    )
    assert [c["function"]["arguments"] for c in odd["tool_calls"]] == ["{bad", {}]


def test_with_instructions_appends_to_the_system_message_or_adds_one():
    messages = [{"role": "system", "content": "Be brief.", "name": "x"}, {"role": "user", "content": "Hi"}]
    out = with_instructions(messages, "TOOLS")
    assert out == [{"role": "system", "content": "Be brief.\n\nTOOLS", "name": "x"}, messages[1]]
    assert messages[0]["content"] == "Be brief."
    assert with_instructions([{"role": "system", "content": ""}], "TOOLS") == [
        {"role": "system", "content": "TOOLS"}
    ]
    assert with_instructions([{"role": "user", "content": "Hi"}], "TOOLS") == [
        {"role": "system", "content": "TOOLS"},
        {"role": "user", "content": "Hi"},
    ]
    assert with_instructions([], "TOOLS") == [{"role": "system", "content": "TOOLS"}]


def test_generic_instructions_list_the_tools_in_the_same_words_whatever_the_choice():
    text = generic_instructions(TOOLS, GENERIC)
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(t) for t in listed] == [t.as_json() for t in TOOLS]
    assert json.loads(listed[2])["parameters"] == {"type": "object", "properties": {}}
    assert '<tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>' in text
    assert text.endswith("If no tool is needed, answer the user directly.")


# ---- checks ----------------------------------------------------------------


@pytest.mark.parametrize(
    "tools, choice, param, words",
    [
        ([Tool("bad name!")], ToolChoice(), "tools[0].function.name", "1-64"),
        ([Tool("x" * 65)], ToolChoice(), "tools[0].function.name", "1-64"),
        ([Tool("")], ToolChoice(), "tools[0].function.name", "1-64"),
        ([WEATHER, TIME, WEATHER], ToolChoice(), "tools[2].function.name", "two tools"),
        (
            [WEATHER, Tool("f", parameters=["not", "a", "schema"])],
            ToolChoice(),
            "tools[1].function.parameters",
            "schema",
        ),
        ([], ToolChoice("required"), "tool_choice", "at least one"),
        ([WEATHER], ToolChoice("required", "get_time"), "tool_choice", "get_time"),
    ],
)
def test_check_tools_names_the_field(tools, choice, param, words):
    with pytest.raises(TurnError) as e:
        check_tools(tools, choice)
    assert e.value.param == param and words in str(e.value)
    assert isinstance(e.value, ValueError)


def test_check_tools_accepts_good_tools_and_another_param_name():
    check_tools([WEATHER, TIME, Tool("a.b:c-d_9")], ToolChoice("required", "get_time"))
    check_tools([], ToolChoice("auto"))
    check_tools([], ToolChoice("none"))
    with pytest.raises(TurnError) as e:
        check_tools([Tool("ok"), Tool("no way")], ToolChoice(), param="functions")
    assert e.value.param == "functions[1].function.name"


# ---- grammars ----------------------------------------------------------------


CHOICES = {
    "required": (ToolChoice("required"), None),
    "required_one": (ToolChoice("required", parallel=False), None),
    "named": (ToolChoice("required", "get_weather", parallel=False), None),
    "auto": (ToolChoice("auto"), None),
    "auto_text_schema": (
        ToolChoice("auto"),
        {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    ),
}


@pytest.mark.parametrize("fmt", [GENERIC, HERMES], ids=lambda f: f.name)
@pytest.mark.parametrize("kind", sorted(CHOICES))
def test_call_grammars_compile(grammars, fmt, kind):
    choice, text_schema = CHOICES[kind]
    lark = call_grammar(TOOLS, fmt, choice, grammars.literal, text_schema)
    assert lark is not None and lark.startswith("%llguidance")
    grammars.check(lark_grammar(lark))
    assert isinstance(grammars.constraint(lark_grammar(lark)), GrammarConstraint)


def test_no_grammar_when_the_answer_is_free(grammars):
    assert call_grammar(TOOLS, HERMES, ToolChoice("none"), grammars.literal) is None
    assert call_grammar([], HERMES, ToolChoice("auto"), grammars.literal) is None
    pythonic = format_named("pythonic")
    assert not pythonic.json_body
    assert call_grammar(TOOLS, pythonic, ToolChoice("required"), grammars.literal) is None


def test_a_special_token_marker_is_named_not_spelled(grammars, tokenizer):
    [end] = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert grammars.literal("<|im_end|>") == f"<[{end}]>"
    assert grammars.literal("<tool_call>") == '"<tool_call>"'


def constraint_of(grammars, fmt, choice, text_schema=None):
    return grammars.constraint(lark_grammar(call_grammar(TOOLS, fmt, choice, grammars.literal, text_schema)))


def drive(grammars, constraint, text: str):
    vocab = grammars.ll_tokenizer.vocab_size
    for token in grammars.tokenizer.encode(text, add_special_tokens=False):
        mask = constraint.allowed(vocab)
        assert mask[token], f"{grammars.tokenizer.decode([token])!r} refused after {text!r}"
        constraint.consume(token)
    return constraint


def allowed_texts(grammars, constraint) -> set[str]:
    mask = constraint.allowed(grammars.ll_tokenizer.vocab_size)
    return {grammars.tokenizer.decode([int(t)]) for t in np.flatnonzero(mask)}


def hermes_call(name="get_weather", args=PARIS) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def eos_allowed(grammars, constraint) -> bool:
    mask = constraint.allowed(grammars.ll_tokenizer.vocab_size)
    return all(mask[t] for t in grammars.tokenizer.eos_token_ids)


def test_a_valid_hermes_call_is_allowed_token_by_token(grammars):
    constraint = drive(
        grammars, constraint_of(grammars, HERMES, ToolChoice("required", parallel=False)), hermes_call()
    )
    ends = {grammars.tokenizer.decode([t]) for t in grammars.tokenizer.eos_token_ids}
    assert eos_allowed(grammars, constraint)
    # the newline its models write before ending the turn, and then nothing but the end
    assert allowed_texts(grammars, constraint) <= ends | {"\n"}
    drive(grammars, constraint, "\n")
    assert allowed_texts(grammars, constraint) <= ends


def test_parallel_hermes_calls_one_per_line(grammars):
    constraint = constraint_of(grammars, HERMES, ToolChoice("required"))
    drive(
        grammars,
        constraint,
        hermes_call() + "\n" + hermes_call("get_time", '{"zone": "CET"}') + "\n" + hermes_call("now", "{}"),
    )
    assert eos_allowed(grammars, constraint)


def test_an_invalid_argument_value_is_refused(grammars, tokenizer):
    constraint = constraint_of(grammars, HERMES, ToolChoice("required", "get_weather", parallel=False))
    drive(
        grammars, constraint, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "'
    )
    texts = allowed_texts(grammars, constraint)
    assert texts and all(t[:1] in ("c", "f") for t in texts), texts
    for bad in ("kel", "k", "C"):
        [token] = tokenizer.encode(bad, add_special_tokens=False)[:1]
        assert not constraint.allowed(grammars.ll_tokenizer.vocab_size)[token]


def test_a_named_choice_refuses_the_other_tools(grammars):
    constraint = constraint_of(grammars, HERMES, ToolChoice("required", "get_weather"))
    drive(grammars, constraint, '<tool_call>\n{"name": "')
    assert all(
        "get_weather".startswith(t) or t.startswith("get_weather")
        for t in allowed_texts(grammars, constraint)
    )
    assert not any(
        t.startswith("get_t") for t in allowed_texts(grammars, drive(grammars, constraint, "get_"))
    )


def test_required_refuses_text_before_the_call(grammars, tokenizer):
    constraint = constraint_of(grammars, GENERIC, ToolChoice("required"))
    [hello] = tokenizer.encode("Hello", add_special_tokens=False)
    assert not constraint.allowed(grammars.ll_tokenizer.vocab_size)[hello]
    drive(grammars, constraint, '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    assert eos_allowed(grammars, constraint)


def test_auto_leaves_text_free_until_a_call_opens(grammars):
    constraint = constraint_of(grammars, HERMES, ToolChoice("auto"))
    drive(grammars, constraint, "Let me check that for you, <tool>s and all.\n")
    assert eos_allowed(grammars, constraint)
    drive(grammars, constraint, hermes_call())
    drive(grammars, constraint, "\nDone.")
    assert eos_allowed(grammars, constraint)


def test_auto_enforces_a_call_once_it_opens(grammars):
    constraint = constraint_of(grammars, HERMES, ToolChoice("auto"))
    drive(grammars, constraint, 'Sure.<tool_call>\n{"name": "')
    assert all(
        any(n.startswith(t) or t.startswith(n) for n in ("get_weather", "get_time", "now"))
        for t in allowed_texts(grammars, constraint)
    )
    drive(grammars, constraint, 'get_weather", "arguments": {"city": "Paris", "unit": "')
    assert all(t[:1] in ("c", "f") for t in allowed_texts(grammars, constraint))


def test_auto_with_a_text_schema_is_a_call_or_that_json(grammars):
    schema = CHOICES["auto_text_schema"][1]
    drive(grammars, constraint_of(grammars, HERMES, ToolChoice("auto"), schema), '{"answer": "hi"}')
    constraint = drive(grammars, constraint_of(grammars, HERMES, ToolChoice("auto"), schema), hermes_call())
    assert eos_allowed(grammars, constraint)
    constraint = constraint_of(grammars, HERMES, ToolChoice("auto"), schema)
    assert not any(t.strip().startswith("H") for t in allowed_texts(grammars, constraint))


def test_auto_enforces_a_hermes_call_written_without_its_newline(grammars, tokenizer):
    constraint = constraint_of(grammars, HERMES, ToolChoice("auto"))
    drive(grammars, constraint, 'Sure.<tool_call>{"name": "')
    [bogus] = tokenizer.encode("bogus", add_special_tokens=False)[:1]
    assert not constraint.allowed(grammars.ll_tokenizer.vocab_size)[bogus]


def test_auto_with_a_text_schema_allows_one_call_per_line(grammars):
    schema = CHOICES["auto_text_schema"][1]
    drive(
        grammars,
        constraint_of(grammars, HERMES, ToolChoice("auto"), schema),
        hermes_call() + "\n" + hermes_call(),
    )


@pytest.mark.parametrize("schema", [None, CHOICES["auto_text_schema"][1]], ids=["free", "text_schema"])
def test_auto_without_parallel_calls_allows_one_call(grammars, tokenizer, schema):
    constraint = constraint_of(grammars, HERMES, ToolChoice("auto", parallel=False), schema)
    drive(grammars, constraint, hermes_call())
    [lt] = tokenizer.encode("<", add_special_tokens=False)
    assert not constraint.allowed(grammars.ll_tokenizer.vocab_size)[lt]


# ---- a turn, prepared and started ----------------------------------------------


@pytest.mark.parametrize("choice", [ToolChoice("none"), ToolChoice("required"), ToolChoice("required", "get_time")],
                         ids=["none", "required", "named"])
def test_every_tool_choice_gives_the_prompt_of_auto(turns, native_turns, choice):
    """A turn that changes tool_choice keeps the conversation's prefix (and its
    cached KV): the tools are listed in the same words whatever it says."""
    for t in (turns, native_turns):
        assert t.prepare(TurnSpec(tools=TOOLS, tool_choice=choice), HISTORY) == \
            t.prepare(TurnSpec(tools=TOOLS, tool_choice=ToolChoice("auto")), HISTORY)


def test_tool_choice_none_keeps_the_call_marker_out_of_the_text(turns, native_turns):
    spec = TurnSpec(tools=TOOLS, tool_choice=ToolChoice("none"))
    for t in (turns, native_turns):
        run = t.start(spec, [1, 2, 3])
        assert isinstance(run.constraint, GrammarConstraint) and run.parser.calls is None
        drive(t.grammars, run.constraint, "It is sunny in Paris, < 30 degrees; tool_call <tool")
        assert eos_allowed(t.grammars, run.constraint)
        with pytest.raises(AssertionError, match="refused"):
            drive(t.grammars, t.start(spec, [1, 2, 3]).constraint, "Sure: " + hermes_call())
    parser = turns.start(spec, [1, 2, 3]).parser
    events = parser.feed("a <tool_call> as text") + parser.finish()  # were one written: text, not a call
    assert "".join(e.text for e in events) == "a <tool_call> as text" and not parser.called


def test_generic_tools_are_instructions_in_the_system_prompt(turns, tokenizer):
    assert turns.format is GENERIC
    spec = TurnSpec(tools=TOOLS, tool_choice=ToolChoice("auto"))
    prepared, variables = turns.prepare(spec, HISTORY)
    assert variables == {}
    assert prepared[0]["role"] == "system" and prepared[0]["content"].startswith(
        "Be brief.\n\nYou can call tools."
    )
    assert prepared[0]["content"].endswith(generic_instructions(TOOLS, GENERIC))
    assert [m["role"] for m in prepared] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert not any(k.startswith("_") for m in prepared for k in m)
    tokenizer.apply_chat_template(prepared, add_generation_prompt=True)  # SmolLM2's template takes them
    run = turns.start(spec, list(tokenizer.encode("hello")))
    assert isinstance(run.constraint, GrammarConstraint) and run.parser.calls is not None
    events = run.parser.feed('<tool_call>{"name": "now", "arguments": {}}</tool_call>') + run.parser.finish()
    assert run.parser.called and [type(e).__name__ for e in events] == ["ToolCallStart", "ToolCallArgs"]


def test_native_tools_are_a_template_variable(native_turns, tokenizer):
    spec = TurnSpec(tools=TOOLS, tool_choice=ToolChoice("required"))
    prepared, variables = native_turns.prepare(spec, HISTORY)
    assert variables == {"tools": [{"type": "function", "function": t.as_json()} for t in TOOLS]}
    assert prepared[0] == HISTORY[0] and len(prepared) == len(HISTORY)
    assert prepared[2]["tool_calls"][0]["function"]["arguments"] == json.loads(PARIS)
    run = native_turns.start(spec, list(tokenizer.encode("hello")))
    drive(native_turns.grammars, run.constraint, hermes_call())


@pytest.mark.parametrize("parallel_calls", [True, False])
def test_a_model_held_to_one_call_gets_one_whatever_the_request_allows(tokenizer, parallel_calls):
    """The parallel_tool_calls setting: false holds the model to one call an answer."""
    turns = ModelTurns(tokenizer, tool_format="hermes", parallel_calls=parallel_calls)
    run = turns.start(TurnSpec(tools=TOOLS, tool_choice=ToolChoice("required")), list(tokenizer.encode("hello")))
    drive(turns.grammars, run.constraint, hermes_call() + "\n")
    [lt] = tokenizer.encode("<", add_special_tokens=False)
    assert run.constraint.allowed(turns.grammars.ll_tokenizer.vocab_size)[lt] == parallel_calls


def test_a_grammar_with_tools_is_refused_unless_tool_choice_is_none(turns):
    grammar = '%llguidance {}\nstart: "yes" | "no"\n'
    with pytest.raises(TurnError) as e:
        turns.start(TurnSpec(tools=TOOLS, grammar=grammar), [1, 2])
    assert e.value.param == "grammar"
    run = turns.start(TurnSpec(tools=TOOLS, tool_choice=ToolChoice("none"), grammar=grammar), [1, 2])
    assert isinstance(run.constraint, GrammarConstraint)


def test_a_grammar_with_a_response_format_is_refused(turns):
    spec = TurnSpec(json_schema={"type": "object"}, grammar='%llguidance {}\nstart: "x"\n')
    with pytest.raises(TurnError) as e:
        turns.prepare(spec, [{"role": "user", "content": "Hi"}])
    assert e.value.param == "response_format"


def test_bad_tools_are_turn_errors_naming_the_field(turns):
    with pytest.raises(TurnError) as e:
        turns.prepare(TurnSpec(tools=[WEATHER, WEATHER]), [{"role": "user", "content": "Hi"}])
    assert e.value.param == "tools[1].function.name"
    bad = Tool("f", parameters={"type": "string", "pattern": "(?<=x)"})
    with pytest.raises(TurnError) as e:
        turns.start(TurnSpec(tools=[WEATHER, bad], tool_choice=ToolChoice("required")), [1, 2])
    assert e.value.param == "tools[1].function.parameters" and "'f'" in str(e.value)
    with pytest.raises(TurnError) as e:
        turns.start(TurnSpec(grammar="start: nonsense ("), [1, 2])
    assert e.value.param == "grammar"
