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
