"""Tool-call formats that put JSON between `<tool_call>` markers."""

from __future__ import annotations

import json
from typing import Any

from srv.sdk.tools import ToolCall, ToolCallParser


class HermesParser(ToolCallParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call; the
    chat templates of Hermes and Qwen render the tools themselves."""


class SmolLM2Parser(ToolCallParser):
    """`<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`, with the system prompt
    of SmolLM2's function-calling training data (its chat template does not render tools)."""

    array = True

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        functions = [tool.get("function", tool) for tool in tools]
        example = self.format_calls([ToolCall("func_name1", '{"params_name1": "params_value1"}')])
        return ("You are an expert in composing functions. You are given a question and a set of possible "
                "functions. Based on the question, you will need to make one or more function/tool calls to "
                "achieve the purpose.\n\nYou have access to the following tools:\n"
                f"<tools>{json.dumps(functions)}</tools>\n\n"
                "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
                f"The example format is as follows. Please make sure the parameter type is correct.\n{example}")
