"""Built-in tool-call parsers (`--tool-call-parser`)."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_tool_call_parsers(register):
    register("hermes", "srv.plugins.tools.parsers:HermesParser", priority=20,
             description='one JSON call per <tool_call>...</tool_call> block (Hermes, Qwen 2.5/3, SmolLM3)')
    register("qwen25", "srv.plugins.tools.parsers:HermesParser", priority=10,
             description="SGLang's name for the Hermes format, as Qwen 2.5 and later write it")
    register("smollm2", "srv.plugins.tools.parsers:SmolLM2Parser", priority=5,
             description="a JSON array of calls in <tool_call>...</tool_call>, as SmolLM2 was trained to write")
    register("llama3", "srv.plugins.tools.json_formats:Llama3Parser",
             description='Llama 3.1/3.2 JSON calls {"name": ..., "parameters": {...}}, ";"-separated, '
                         "as the whole output or after <|python_tag|>")
    register("mistral", "srv.plugins.tools.json_formats:MistralParser",
             description="Mistral's [TOOL_CALLS] followed by a JSON array of calls, or by NAME[ARGS]{...}")
    register("pythonic", "srv.plugins.tools.pythonic:PythonicParser",
             description="a Python list of calls with literal keyword arguments, [f(a=1), g()] (Llama 4)")
    register("deepseekv3", "srv.plugins.tools.sections:DeepSeekV3Parser",
             description="DeepSeek V3's <｜tool▁calls▁begin｜> section of function<｜tool▁sep｜>NAME and ```json calls")
    register("kimi_k2", "srv.plugins.tools.sections:KimiK2Parser",
             description="Kimi K2's <|tool_calls_section_begin|> section of functions.NAME:INDEX calls with JSON arguments")
    register("qwen3_coder", "srv.plugins.tools.xml_formats:Qwen3CoderParser",
             description="Qwen3-Coder's <tool_call><function=NAME><parameter=KEY>VALUE</parameter>... calls")
    register("glm45", "srv.plugins.tools.xml_formats:Glm45Parser",
             description="GLM-4.5's <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>... calls")
    register("gpt-oss", "srv.plugins.tools.harmony:HarmonyParser",
             description="OpenAI harmony messages (gpt-oss): calls to functions.NAME, the final channel as content")
