"""The agent frameworks' own OpenAI clients against `ignis serve`: litellm, langchain-openai (bind_tools,
with_structured_output) and llama-index's OpenAILike (chat_with_tools). Tool calls are forced (the built-in model is
a tiny code model), so what is checked is that each framework's request is accepted and its parser gets the call."""

from __future__ import annotations

import os

import httpx
import jsonschema
import pytest

from agent_server import agents_url  # noqa: F401  (the shared server)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False},
    },
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def base(agents_url: str) -> tuple[str, str]:  # noqa: F811
    model = httpx.get(f"{agents_url}/v1/models").json()["data"][0]["id"]
    return f"{agents_url}/v1", model


def test_litellm_tool_call_with_the_penalties_its_configs_send(base: tuple[str, str]) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network for its price list
    import litellm

    url, model = base
    r = litellm.completion(model=f"openai/{model}", api_base=url, api_key="none", messages=[{"role": "user", "content": ASK}],
                           tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=40,
                           temperature=0, presence_penalty=0.1, frequency_penalty=0.1)
    calls = r.choices[0].message.tool_calls
    assert calls[0].function.name == "get_weather" and "city" in calls[0].function.arguments
    assert r.choices[0].finish_reason == "tool_calls"


def test_langchain_bind_tools_and_with_structured_output(base: tuple[str, str]) -> None:
    from langchain_openai import ChatOpenAI

    url, model = base
    llm = ChatOpenAI(base_url=url, api_key="none", model=model, temperature=0, max_tokens=40)  # type: ignore[arg-type]
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False).invoke(ASK)
    assert msg.tool_calls[0]["name"] == "get_weather" and isinstance(msg.tool_calls[0]["args"]["city"], str)
    schema = {"title": "Module", "type": "object", "additionalProperties": False, "required": ["name", "lines"],
              "properties": {"name": {"type": "string", "maxLength": 16}, "lines": {"type": "integer", "maximum": 999}}}
    out = llm.with_structured_output(schema, method="json_schema").invoke("Describe a module.")
    jsonschema.validate(out, schema)
    tools_out = llm.with_structured_output(schema, method="function_calling").invoke("Describe a module.")
    jsonschema.validate(tools_out, schema)


def test_llama_index_openai_like_chat_with_tools(base: tuple[str, str]) -> None:
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return "sunny"

    url, model = base
    llm = OpenAILike(model=model, api_base=url, api_key="none", is_chat_model=True, is_function_calling_model=True,
                     max_tokens=40, temperature=0, context_window=4096)
    tool = FunctionTool.from_defaults(fn=get_weather)
    resp = llm.chat_with_tools([tool], user_msg=ASK, tool_required=True, allow_parallel_tool_calls=False)
    calls = llm.get_tool_calls_from_response(resp, error_on_no_tool_call=True)
    assert calls[0].tool_name == "get_weather" and isinstance(calls[0].tool_kwargs.get("city"), str)
