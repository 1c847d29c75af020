"""Tool calls in the catalog models' own formats (shared/tool_calls.py: pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared import tool_calls as tc

TOOLS = [tc.Tool("read_file", "read a file", {"type": "object", "properties": {"path": {"type": "string"},
                                                                              "limit": {"type": "integer"}},
                                               "required": ["path"]}),
         tc.Tool("run_tests", "run the tests", {"type": "object", "properties": {"verbose": {"type": "boolean"},
                                                                                "only": {"type": "array"}}})]


def test_hermes_as_qwen3_writes_it() -> None:
    # Qwen3's chat template: a JSON object per call between <tool_call> tags, after any text
    text = ('I will look at the file first.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py", '
            '"limit": 40}}\n</tool_call>\n<tool_call>\n{"name": "run_tests", "arguments": {"verbose": true}}\n</tool_call>')
    content, calls = tc.parse(text, "hermes", TOOLS, "c1")
    assert content == "I will look at the file first."
    assert [(c.name, c.arguments) for c in calls] == [("read_file", {"path": "src/a.py", "limit": 40}),
                                                     ("run_tests", {"verbose": True})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert tc.parse(text, "hermes", TOOLS, "c1")[1] == calls  # ids are stable for a call (a retry's reply is the same)


def test_glm45_as_glm_writes_it() -> None:
    # GLM-4.5's format: the name on the first line, then <arg_key>/<arg_value> pairs; a
    # value is the string itself, or JSON where the schema says it is not a string
    text = ("<think>the path is known</think>Reading it.\n<tool_call>read_file\n<arg_key>path</arg_key>\n"
            "<arg_value>src/a.py</arg_value>\n<arg_key>limit</arg_key>\n<arg_value>40</arg_value>\n</tool_call>"
            "<tool_call>run_tests\n<arg_key>only</arg_key>\n<arg_value>[\"test_a\"]</arg_value>\n</tool_call>")
    content, calls = tc.parse(text, "glm45", TOOLS, "c2")
    assert content == "<think>the path is known</think>Reading it."
    assert [(c.name, c.arguments) for c in calls] == [("read_file", {"path": "src/a.py", "limit": 40}),
                                                     ("run_tests", {"only": ["test_a"]})]
    # a string parameter stays a string even when it looks like a number
    _, calls = tc.parse("<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>42</arg_value>\n</tool_call>",
                        "glm45", TOOLS, "c3")
    assert calls[0].arguments == {"path": "42"}
    # a call with no arguments
    _, calls = tc.parse("<tool_call>run_tests\n</tool_call>", "glm45", TOOLS, "c4")
    assert [(c.name, c.arguments) for c in calls] == [("run_tests", {})]


def test_pythonic_as_llama4_writes_it() -> None:
    # Llama 4 (vLLM's llama4_pythonic parser): the whole reply a list of calls, keyword
    # arguments of literal values, sometimes between its python tags
    text = "[read_file(path='src/a.py', limit=40), run_tests(verbose=True, only=['test_a', \"test_b\"])]"
    content, calls = tc.parse(text, "pythonic", TOOLS, "c5")
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("read_file", {"path": "src/a.py", "limit": 40}),
                                                     ("run_tests", {"verbose": True, "only": ["test_a", "test_b"]})]
    assert tc.parse(f"<|python_start|>{text}<|python_end|>", "pythonic", TOOLS, "c5")[1] == calls
    # JSON's spellings, negative numbers, nested values, no arguments
    _, calls = tc.parse('[run_tests(verbose=true, only=null), read_file(path="x", limit=-3), run_tests()]',
                        "pythonic", TOOLS, "c6")
    assert [c.arguments for c in calls] == [{"verbose": True, "only": None}, {"path": "x", "limit": -3}, {}]
    for text in ["I will read it: [read_file(path='a.py')]",      # text beside the calls: all text, as vLLM
                 "[read_file('a.py')]",                            # a positional argument
                 "[read_file(path=open('a.py'))]",                 # not a literal
                 "[os.remove(path='a.py')]",                       # not a tool's name
                 "[read_file(path='a.py'), 3]", "[]", "[" * 5000]:  # not calls; deeply nested
        content, calls = tc.parse(text, "pythonic", TOOLS, "x")
        assert calls == [] and content == text.strip(), text[:40]


def test_a_pythonic_call_of_a_tool_named_as_no_python_name_is_a_call() -> None:
    """Both APIs allow `-` in a tool's name (MCP tools often have one); Python reads
    `copy-file(...)` as a subtraction. A string holding the name stays as it was."""
    tools = [tc.Tool("copy-file", "", {"type": "object", "properties": {"src": {"type": "string"}}}),
             tc.Tool("file", "", {"type": "object", "properties": {}}),
             tc.Tool("import", "", {"type": "object", "properties": {}})]
    calls = [("copy-file", {"src": "copy-file(a) and file( import("}), ("file", {}), ("import", {})]
    text = tc.render(calls, "pythonic")
    assert text.startswith("[copy-file(")
    assert [(c.name, c.arguments) for c in tc.parse(text, "pythonic", tools, "r")[1]] == calls, text
    assert [c.name for c in tc.parse("[copy-file (src='x')]", "pythonic", tools, "r")[1]] == ["copy-file"]
    assert tc.parse("[copy-files(src='x')]", "pythonic", tools, "r")[1] == []  # (not a tool's name)


def test_a_pythonic_call_whose_argument_names_are_not_python_names_still_round_trips() -> None:
    tools = [tc.Tool("fetch", "", {"type": "object", "properties": {"file-path": {"type": "string"},
                                                                    "from": {"type": "string"}}})]
    calls = [("fetch", {"file-path": "é \n\"q\" \\ 😀", "from": "x"})]
    text = tc.render(calls, "pythonic")
    assert [(c.name, c.arguments) for c in tc.parse(text, "pythonic", tools, "r")[1]] == calls, text


def test_harmony_as_gpt_oss_writes_it() -> None:
    # gpt-oss (vLLM's openai parser): a message on the commentary channel addressed to the tool,
    # its arguments JSON; the recipient before the channel or after it; the engine's text ends
    # without the <|call|> it stopped on
    text = ('<|start|>assistant<|channel|>commentary<|message|>Reading it first.<|end|>'
            '<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>'
            '{"path": "src/a.py", "limit": 40}')
    content, calls = tc.parse(text, "harmony", TOOLS, "c7")
    assert content == "Reading it first."
    assert [(c.name, c.arguments) for c in calls] == [("read_file", {"path": "src/a.py", "limit": 40})]
    text = '<|start|>assistant to=functions.run_tests<|channel|>commentary json<|message|>{"verbose": true}<|call|>'
    assert [(c.name, c.arguments) for c in tc.parse(text, "harmony", TOOLS, "c8")[1]] == [("run_tests", {"verbose": True})]
    # a bare tool name as recipient is the tool too
    text = '<|channel|>commentary to=run_tests <|constrain|>json<|message|>{}'
    assert [c.name for c in tc.parse(text, "harmony", TOOLS, "c9")[1]] == ["run_tests"]
    # stays text, in its markup: arguments cut off by max_tokens, a tool not offered (harmony's
    # built-in browser), arguments that are no object
    for text in ['<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{"path": "src/',
                 '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>',
                 '<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>["a.py"]']:
        content, calls = tc.parse(text, "harmony", TOOLS, "x")
        assert calls == [] and "to=" in content and content.endswith(text.split("<|message|>")[1]), text
    # a final answer is text, without its markup
    assert tc.parse("<|channel|>final<|message|>All tests pass.", "harmony", TOOLS, "x") == ("All tests pass.", [])


@pytest.mark.parametrize("fmt", ["hermes", "glm45", "pythonic", "harmony"])
def test_what_does_not_parse_stays_text(fmt: str) -> None:
    for text in ["no call at all", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{\"name\": \"rm_rf\"}\n</tool_call>",
                 "<tool_call>unknown_tool\n<arg_key>a</arg_key>\n<arg_value>b</arg_value>\n</tool_call>",
                 "<tool_call>read_file\n<arg_key>path</arg_key>"]:  # cut off by max_tokens
        content, calls = tc.parse(text, fmt, TOOLS, "x")
        assert calls == [] and content == text.strip()


@pytest.mark.parametrize("fmt", ["hermes", "glm45", "pythonic", "harmony"])
def test_render_is_what_parse_reads(fmt: str) -> None:
    calls = [("read_file", {"path": "a b/c.py", "limit": 7}), ("run_tests", {"verbose": False, "only": ["x", "y"]})]
    content, parsed = tc.parse(tc.render(calls, fmt), fmt, TOOLS, "r")
    assert content == "" and [(c.name, c.arguments) for c in parsed] == calls
    # a file's body keeps its edge newlines and spaces (a write tool's content is the file)
    body = [("read_file", {"path": "\n  x = 1\n\n"})]
    assert [c.arguments for c in tc.parse(tc.render(body, fmt), fmt, TOOLS, "r")[1]] == [body[0][1]]


def test_synthetic_calls_fill_the_schema_and_follow_the_choice() -> None:
    name, args = tc.synthetic_call(TOOLS, "read_file", "call-1")  # type: ignore[misc]
    assert name == "read_file" and set(args) == {"path"} and isinstance(args["path"], str)
    picked = {tc.synthetic_call(TOOLS, None, f"call-{i}")[0] for i in range(40)}  # type: ignore[index]
    assert picked == {"read_file", "run_tests"}
    assert tc.synthetic_call(TOOLS, "none", "c") is None and tc.synthetic_call([], None, "c") is None
    assert tc.synthetic_call(TOOLS, None, "same") == tc.synthetic_call(TOOLS, None, "same")


def test_requests_tools_in_each_apis_shape_and_refusals_by_name() -> None:
    body = {"tools": [{"type": "function", "function": {"name": "read_file", "parameters": TOOLS[0].parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "read_file"}}}
    tools, choice = tc.openai_tools(body)
    assert [t.name for t in tools] == ["read_file"] and choice == "read_file"
    assert tc.openai_tools({"tools": body["tools"], "tool_choice": "none"})[1] == "none"
    tools, choice = tc.anthropic_tools({"tools": [{"name": "read_file", "input_schema": TOOLS[0].parameters}],
                                        "tool_choice": {"type": "any"}})
    assert [t.name for t in tools] == ["read_file"] and choice == tc.ANY_TOOL  # a call of any tool
    assert tc.openai_tools({"tools": body["tools"], "tool_choice": "required"})[1] == tc.ANY_TOOL
    assert tc.openai_tools({"tools": body["tools"], "tool_choice": "auto"})[1] is None
    fn = body["tools"][0]
    for bad in ({"tools": "x"}, {"tools": [{"type": "function"}]}, {"tools": [], "tool_choice": 3},
                # names both APIs refuse (a call names its tool in the model's text), and two tools of one name
                {"tools": [{"type": "function", "function": {**fn["function"], "name": "read file"}}]},
                {"tools": [{"type": "function", "function": {**fn["function"], "name": "x" * 129}}]},
                {"tools": [fn, fn]},
                # a schema both APIs refuse and vLLM's grammar cannot enforce (the sim engine had taken it)
                {"tools": [{"type": "function", "function": {**fn["function"], "parameters": {
                    "type": "object", "properties": {"x": {"type": "strin"}}}}}]}):
        with pytest.raises(tc.ToolsError):
            tc.openai_tools(bad)
    assert [t.name for t in tc.anthropic_tools({"tools": [{"name": "mcp__repo__read-file", "input_schema": {}}]})[0]] \
        == ["mcp__repo__read-file"]
    assert tc.tools_from_json(tc.tools_text(TOOLS)) == TOOLS
    with pytest.raises(ValueError):
        tc.tools_from_json(json.dumps({"not": "a list"}))



@pytest.mark.parametrize("schema", [{"type": "array", "items": {"type": "string"}}, {"type": "string"}])
def test_a_tool_whose_arguments_are_not_an_object_is_refused_naming_the_field(schema: dict[str, Any]) -> None:
    # both APIs' rule: the sim engine had answered such a tool with `{}`, which breaks the schema given
    with pytest.raises(tc.ToolsError) as e:
        tc.openai_tools({"tools": [{"type": "function", "function": {"name": "x", "parameters": schema}}]})
    assert e.value.param == "tools[0].function.parameters" and "type object" in str(e.value)
    with pytest.raises(tc.ToolsError) as e:
        tc.anthropic_tools({"tools": [{"name": "x", "input_schema": schema}]})
    assert e.value.param == "tools[0].input_schema"
    # a schema that leaves its type out describes an object's properties, as both take it
    assert tc.openai_tools({"tools": [{"type": "function", "function": {"name": "x", "parameters": {
        "properties": {"a": {"type": "string"}}}}}]})[0][0].name == "x"


def test_a_chat_tool_of_another_type_is_refused_by_its_type() -> None:
    """OpenAI's custom (freeform) tool sent to chat completions had been told it "must be a
    function tool with a name", though it has one: the refusal names its type, and where
    custom tools are served."""
    with pytest.raises(tc.ToolsError) as e:
        tc.openai_tools({"tools": [{"type": "custom", "custom": {"name": "cx", "description": "d"}}]})
    assert e.value.param == "tools[0].type" and "/v1/responses" in str(e.value)
    with pytest.raises(tc.ToolsError) as e:
        tc.openai_tools({"tools": [{"type": "function", "function": {"name": "x"}}, {"type": "web_search"}]})
    assert e.value.param == "tools[1].type" and "only function tools" in str(e.value)


def test_a_refused_tool_name_is_named_where_each_api_writes_it() -> None:
    with pytest.raises(tc.ToolsError) as e:
        tc.openai_tools({"tools": [{"type": "function", "function": {"name": "has space"}}]})
    assert e.value.param == "tools[0].function.name"
    with pytest.raises(tc.ToolsError) as e:
        tc.anthropic_tools({"tools": [{"name": "a", "input_schema": {}}, {"name": "a", "input_schema": {}}]})
    assert e.value.param == "tools[1].name"


def test_a_forced_calls_arguments_come_in_the_order_its_schema_declares() -> None:
    """The engine's tools kept each schema's properties sorted, so a forced call was decoded
    in alphabetical order (`read_file(path, line)` began with the optional line, a real
    model pushed off its habit); vLLM's own server keeps the declared order."""
    tools = [tc.Tool("read_file", "", {"type": "object", "properties": {"zeta": {"type": "boolean"},
                                                                        "alpha": {"type": "boolean"}},
                                       "required": ["zeta", "alpha"]})]
    (back,) = tc.tools_from_json(tc.tools_text(tools))
    assert list(back.parameters["properties"]) == ["zeta", "alpha"]
    pytest.importorskip("xgrammar", reason="the grammar is xgrammar's, which vLLM brings")
    from services.engine.vllm_backend import forced_tool_call
    from shared.schema import EngineHint

    so = forced_tool_call(EngineHint(tools_json=tc.tools_text(tools), tool_choice="read_file",
                                     tool_call_format="hermes"), "glm45")
    assert _accepts(so, tc.render([("read_file", {"zeta": True, "alpha": False})], "hermes"))
    assert not _accepts(so, tc.render([("read_file", {"alpha": False, "zeta": True})], "hermes"))


def test_a_named_tool_choice_forces_a_call_the_parser_reads() -> None:
    """What a real engine's structured output is held to when the request names the tool:
    every text the grammar admits is a hermes call of that tool with arguments its schema allows."""
    tools = [tc.Tool("read_file", "", {"type": "object", "properties": {"path": {"enum": ["a.py", "b.py"]},
                                                                        "whole": {"type": "boolean"}},
                                       "required": ["path", "whole"]}), tc.Tool("ls", "", {})]
    begin, schema, end = tc.forced_call(tools, "read_file", "hermes")
    assert (begin, end) == ("<tool_call>\n", "\n</tool_call>") and schema["properties"]["name"] == {"const": "read_file"}
    assert tc.forced_call(tools, None, "hermes") is None and tc.forced_call(tools, "none", "hermes") is None
    assert tc.forced_call(tools, "read_file", "glm45") is None  # not one JSON object: the model decides
    pytest.importorskip("xgrammar", reason="the grammar is xgrammar's, which vLLM brings")
    from services.engine.vllm_backend import forced_tool_call
    from shared.schema import EngineHint

    so = forced_tool_call(EngineHint(tools_json=tc.tools_text(tools), tool_choice="read_file",
                                     tool_call_format="hermes"), "glm45")
    text = tc.render([("read_file", {"path": "b.py", "whole": False})], "hermes")
    assert _accepts(so, text)
    assert not _accepts(so, tc.render([("read_file", {"path": "c.py", "whole": False})], "hermes"))
    assert not _accepts(so, tc.render([("ls", {})], "hermes"))
    _, calls = tc.parse(text, "hermes", tools, "k")
    assert [(c.name, c.arguments) for c in calls] == [("read_file", {"path": "b.py", "whole": False})]
    # tool_choice "required" (Anthropic's "any"): a call of any one of the tools, nothing else
    any_call = forced_tool_call(EngineHint(tools_json=tc.tools_text(tools), tool_choice=tc.ANY_TOOL,
                                           tool_call_format="hermes"), "glm45")
    assert _accepts(any_call, text) and _accepts(any_call, tc.render([("ls", {})], "hermes"))
    assert not _accepts(any_call, "plain text") and not _accepts(any_call, tc.render([("rm", {})], "hermes"))
    # a typed answer beside tools the model may call: the answer's JSON, or a call of any tool
    from services.engine.vllm_backend import structured_output
    from shared.schema import Sampling

    answer = {"type": "object", "properties": {"verdict": {"enum": ["fix", "skip"]}}, "required": ["verdict"]}
    either = structured_output(EngineHint(tools_json=tc.tools_text(tools), tool_call_format="hermes"),
                               Sampling(json_schema=json.dumps(answer)), "hermes")
    assert _accepts(either, '{"verdict": "fix"}') and _accepts(either, text)
    assert not _accepts(either, "plain text") and not _accepts(either, '{"verdict": "maybe"}')
    # tools turned off: the answer alone; GLM's calls (not one JSON object): anything after the opening tag
    alone = structured_output(EngineHint(tools_json=tc.tools_text(tools), tool_choice="none", tool_call_format="hermes"),
                              Sampling(json_schema=json.dumps(answer)), "hermes")
    assert not _accepts(alone, text) and _accepts(alone, '{"verdict": "skip"}')
    glm = structured_output(EngineHint(tools_json=tc.tools_text(tools), tool_call_format="glm45"),
                            Sampling(json_schema=json.dumps(answer)), "glm45")
    glm_call = tc.render([("read_file", {"path": "a.py", "whole": True})], "glm45")
    assert _accepts(glm, glm_call) and not _accepts(glm, "plain text")
    # harmony (gpt-oss): its calls and channels are special tokens, which the vLLM engine keeps in
    # the streamed text; a typed answer is held to its schema where no tool is offered, and the
    # choice between a call and the answer is left to the model where one is
    from services.engine.vllm_backend import keeps_special_tokens

    harmony = EngineHint(tools_json=tc.tools_text(tools), tool_call_format="harmony")
    assert structured_output(harmony, Sampling(json_schema=json.dumps(answer)), "harmony") is None
    assert forced_tool_call(EngineHint(tools_json=tc.tools_text(tools), tool_choice="read_file",
                                       tool_call_format="harmony"), "harmony") is None
    alone = structured_output(None, Sampling(json_schema=json.dumps(answer)), "harmony")
    assert _accepts(alone, '{"verdict": "skip"}')
    assert keeps_special_tokens(None, "harmony") and keeps_special_tokens(harmony, "hermes")
    assert not keeps_special_tokens(None, "hermes") and not keeps_special_tokens(EngineHint(), "glm45")
    # where tools are offered the parsers read the text with them (vLLM's hermes parser asks so)
    assert keeps_special_tokens(EngineHint(tools_json=tc.tools_text(tools)), "hermes")
    assert not keeps_special_tokens(EngineHint(tools_json=tc.tools_text(tools), tool_choice="none"), "hermes")


def test_a_structured_outputs_number_bounds_are_held_and_a_keyword_no_grammar_holds_refused() -> None:
    """A regex (outlines-core's, before) dropped numbers' bounds: a probe's integer of 0-9 came
    back 70 digits long, `finish_reason: stop`. The grammar holds them."""
    pytest.importorskip("xgrammar", reason="the grammar is xgrammar's, which vLLM brings")
    from services.engine.vllm_backend import structured_output
    from shared.schema import Sampling

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
              "required": ["n", "p"], "additionalProperties": False}
    so = structured_output(None, Sampling(json_schema=json.dumps(schema)), "hermes")
    assert _accepts(so, '{"n": 7, "p": 0.25}') and _accepts(so, '{"n": 0, "p": 1}')
    for bad in ('{"n": 15, "p": 0.5}', '{"n": -1, "p": 0.5}', '{"n": 3, "p": 0}', '{"n": 3, "p": 1.5}',
                '{"n": ' + "9" * 70 + ', "p": 0.5}', '{"n": 3,  "p": 0.5}'):  # (and no padding)
        assert not _accepts(so, bad), bad
    with pytest.raises(ValueError, match="cannot be enforced"):
        structured_output(None, Sampling(json_schema=json.dumps({"type": "integer", "multipleOf": 5})), "hermes")


def _accepts(so: Any, text: str) -> bool:
    """Whether a structured output's grammar admits `text` whole, as vLLM's xgrammar holds it."""
    from xgrammar.testing import _is_grammar_accept_string

    return bool(_is_grammar_accept_string(so.grammar, text))


def test_tool_rounds_count_the_tool_results_since_the_user_last_spoke() -> None:
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}, {"id": "b"}]},
            {"role": "tool", "tool_call_id": "a", "content": "x"}, {"role": "tool", "tool_call_id": "b", "content": "y"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
            {"role": "tool", "tool_call_id": "c", "content": "z"}]
    assert tc.tool_rounds(chat) == 3
    assert tc.tool_rounds(chat + [{"role": "user", "content": "go on"}]) == 0  # the user spoke: a new request
    assert tc.tool_rounds([{"role": "user", "content": "hi"}]) == 0 and tc.tool_rounds(None) == 0
    assert tc.tool_rounds([{"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "1"}]) == 1
    # Anthropic: tool results are blocks of a user message; any other block is the user speaking
    result = {"type": "tool_result", "tool_use_id": "t", "content": "x"}
    ant = [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": [{"type": "tool_use"}]},
           {"role": "user", "content": [result, result]}, {"role": "assistant", "content": [{"type": "tool_use"}]},
           {"role": "user", "content": [result]}]
    assert tc.tool_rounds(ant) == 3
    assert tc.tool_rounds(ant + [{"role": "user", "content": [result, {"type": "text", "text": "and now?"}]}]) == 0


def test_anthropics_server_tools_are_left_out_and_its_client_tools_offered() -> None:
    # Claude Code offers web search as Anthropic's server tool wherever it is pointed; a model
    # here that called it would hand the agent a call it cannot run. The text editor, bash and
    # memory tools the agent runs itself: offered with the arguments Anthropic documents
    body = {"tools": [{"name": "Bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
                      {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                      {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
                      {"type": "custom", "name": "Read", "input_schema": {"type": "object"}}]}
    tools, choice = tc.anthropic_tools(body)
    assert [t.name for t in tools] == ["Bash", "str_replace_based_edit_tool", "Read"] and choice is None
    assert tc.anthropic_tools({"tools": [{"type": "web_search_20250305", "name": "web_search"}]})[0] == []
    assert tc.anthropic_tools({"tools": [{"type": "mcp_toolset", "mcp_server_name": "docs"}]})[0] == []
    # an OpenAI function tool sent to Messages is a mistake to name, not a tool to drop in silence
    for wrong in ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                  {"type": "web_search", "name": "w"}, {"type": 7, "name": "x"}):
        with pytest.raises(tc.ToolsError) as e:
            tc.anthropic_tools({"tools": [body["tools"][0], wrong]})
        assert e.value.param == "tools[1].type"
    import jsonschema

    typed = [{"type": "bash_20250124", "name": "bash"}, {"type": "text_editor_20250124", "name": "str_replace_editor"},
             {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 10000},
             {"type": "memory_20250818", "name": "memory"}, {"type": "computer_20250124", "name": "computer",
                                                             "display_width_px": 1024, "display_height_px": 768},
             {"type": "code_execution_20250825", "name": "code_execution"}]
    offered = {t.name: t for t in tc.anthropic_tools({"tools": typed})[0]}
    assert list(offered) == ["bash", "str_replace_editor", "str_replace_based_edit_tool", "memory"]
    assert [tc.anthropic_left_out(t) for t in typed] == [False, False, False, False, True, True]
    # calls as Anthropic documents them are valid; the 2025-07-28 editor has no undo_edit
    for name, args in (("bash", {"command": "ls -la"}), ("bash", {"restart": True}),
                       ("str_replace_editor", {"command": "undo_edit", "path": "/repo/a.py"}),
                       ("str_replace_based_edit_tool", {"command": "view", "path": "/repo", "view_range": [1, -1]}),
                       ("str_replace_based_edit_tool", {"command": "str_replace", "path": "/a.py", "old_str": "x",
                                                        "new_str": "y"}),
                       ("memory", {"command": "rename", "old_path": "/memories/a", "new_path": "/memories/b"})):
        jsonschema.validate(args, offered[name].parameters)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"command": "undo_edit", "path": "/a.py"}, offered["str_replace_based_edit_tool"].parameters)
    # the synthetic model's calls of them are valid too
    for name, tool in offered.items():
        called, args = tc.synthetic_call([tool], name, f"k-{name}")  # type: ignore[misc]
        assert called == name
        jsonschema.validate(args, tool.parameters)
