"""Reasoning formats: markers around the model's thinking."""

from __future__ import annotations

from srv.sdk.reasoning import ReasoningParser


class ThinkParser(ReasoningParser):
    """`<think>...</think>` at the start of the output; an output without it is all answer."""


class OpenedThinkParser(ReasoningParser):
    """`<think>...</think>` where the chat template ends the prompt with `<think>`: the output
    starts inside the reasoning and runs to `</think>`."""

    starts_in_reasoning = True


class KimiParser(ReasoningParser):
    start_marker = "◁think▷"
    end_marker = "◁/think▷"


class HarmonyParser(ReasoningParser):
    """OpenAI's harmony format (gpt-oss), its special tokens kept in the text: the analysis
    channel's message is the reasoning, the final channel's the answer. (Tool calls in the
    commentary channel are the tool-call parser's.)"""

    start_marker = "<|channel|>analysis<|message|>"
    end_marker = "<|end|><|start|>assistant<|channel|>final<|message|>"
