"""Built-in reasoning parsers (`--reasoning-parser`), under SGLang's names."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"

FORMATS = "srv.plugins.reasoning.formats"


@hookimpl
def srv_register_reasoning_parsers(register):
    register("deepseek-r1", f"{FORMATS}:OpenedThinkParser",
             description="<think>...</think>, the reasoning opened by the chat template (DeepSeek-R1)")
    register("qwen3-thinking", f"{FORMATS}:OpenedThinkParser",
             description="<think>...</think>, opened by the chat template (Qwen3 thinking models, 2507 and later)")
    register("qwen3", f"{FORMATS}:ThinkParser", priority=10,
             description="<think>...</think> when the output begins with it (Qwen3 with enable_thinking)")
    register("deepseek-v3", f"{FORMATS}:ThinkParser",
             description="<think>...</think> when the output begins with it (DeepSeek-V3.1 with thinking)")
    register("glm45", f"{FORMATS}:ThinkParser",
             description="<think>...</think> when the output begins with it (GLM-4.5)")
    register("kimi", f"{FORMATS}:KimiParser", description="◁think▷...◁/think▷ (Kimi)")
    register("gpt-oss", f"{FORMATS}:HarmonyParser",
             description="the harmony analysis channel before the final one (gpt-oss)")
