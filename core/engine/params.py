"""Sampling parameters as callers give them: one pydantic schema with SGLang's names, types and
bounds, used by `/generate`'s `sampling_params`, by the OpenAI routes (whose fields map onto it)
and by `srv.Engine`. The bound types are shared with the HTTP request schemas
(`srv.server.protocol`), so each bound is written once.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from srv.engine.errors import InvalidRequest
from srv.sdk.sampling import SamplingParams

# OpenAI's own bound on the choices of one request; each choice is a request of its own here.
MAX_N = 128
# The most top log-probabilities a token may ask for (OpenAI's chat bound).
MAX_TOP_LOGPROBS = 20
# Stop strings per request: each is matched against every new piece of text.
MAX_STOP_STRINGS = 64
INT64_MAX = 2**63 - 1


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("top_k must be -1 (off) or >= 1")
    return value


TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
# Tokens whose log-probabilities one request may follow at every position (token_ids_logprob).
MAX_TOKEN_IDS_LOGPROB = 1024
TokenCount = Annotated[int, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=-1, le=INT64_MAX), AfterValidator(_not_zero)]
MinP = Annotated[float, Field(ge=0, le=1)]
RepetitionPenalty = Annotated[float, Field(gt=0)]
Seed = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
N = Annotated[int, Field(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
Stop = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)]
StopRegex = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)]
# Token ids (as JSON object keys) to a bias added to their logits.
LogitBias = dict[Annotated[str, Field(pattern=r"^\d{1,18}$")], float]


class StrictInput(BaseModel):
    """JSON types as written (no "1" for 1, no true for 1), and no NaN or infinity."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, populate_by_name=True)


class SharedSamplingFields(StrictInput):
    """The sampling parameters that /generate and the OpenAI routes name alike."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: LogitBias | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    stop_regex: StopRegex | None = None
    no_stop_trim: bool | None = None
    ignore_eos: bool | None = None
    n: N | None = None
    # Constrained decoding: SGLang's (OpenAI's own is response_format).
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    # SGLang's custom logit processor (with --enable-custom-logit-processor) and its parameters.
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None


class SamplingParamsInput(SharedSamplingFields):
    """`sampling_params` of SGLang's `/generate` (and of `srv.Engine.generate`)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: TokenCount | None = None
    min_new_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    logprob_start_len: Annotated[int, Field(ge=-1)] | None = None
    token_ids_logprob: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS_LOGPROB)] | None = None
    return_hidden_states: bool | None = None
    lora_path: NonEmptyStr | None = None   # a LoRA adapter's name (--lora-paths)


def validation_error(exc: ValidationError) -> InvalidRequest:
    """The problem pydantic found, as a 400: "field[0].sub: what is wrong". Of the errors a
    union reports (one per member it tried), the one that got deepest into the value."""
    error = max(exc.errors(include_url=False, include_input=False), key=lambda e: len(_field_path(e["loc"])))
    path = _field_path(error["loc"])
    field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")
    message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"{field}: {message}" if field else message, path[0] if path and isinstance(path[0], str) else None)


_TYPE_WORDS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _field_path(location: tuple[Any, ...]) -> list[str | int]:
    """The fields and indexes of an error's location, without the union members pydantic names
    in it ("str", "list[constrained-str]", "TextPart", "function-after[...]")."""
    return [part for part in location if isinstance(part, int)
            or (re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _TYPE_WORDS)]


def make_sampling_params(raw: dict[str, Any] | SamplingParamsInput | None) -> SamplingParams:
    """SamplingParams from what a caller gave, checked against the schema; InvalidRequest if not."""
    if isinstance(raw, SamplingParamsInput):
        given = raw
    else:
        if raw is not None and not isinstance(raw, dict):
            raise InvalidRequest("sampling_params must be an object", "sampling_params")
        try:
            given = SamplingParamsInput.model_validate(raw or {})
        except ValidationError as exc:
            raise validation_error(exc) from None
    values = given.model_dump(exclude_none=True)
    for name in ("stop", "stop_regex"):
        if isinstance(values.get(name), str):
            values[name] = [values[name]]
    for pattern in values.get("stop_regex", []):
        check_stop_regex(pattern)
    if isinstance(values.get("json_schema"), dict):
        values["json_schema"] = json.dumps(values["json_schema"])
    if "logit_bias" in values:
        values["logit_bias"] = {int(k): v for k, v in values["logit_bias"].items()} or None
    params = SamplingParams(**values)
    if sum(getattr(params, kind) is not None for kind in ("json_schema", "regex", "ebnf")) > 1:
        raise InvalidRequest("give at most one of json_schema, regex and ebnf")
    return params


def check_stop_regex(pattern: str) -> None:
    """A stop_regex must compile (it is matched with the `regex` module, which can tell a
    partial match at the end of the text, so streamed text never shows what a match removes)."""
    import regex

    try:
        regex.compile(pattern)
    except regex.error as exc:
        raise InvalidRequest(f"stop_regex {pattern!r} is not a valid regular expression: {exc}", "stop_regex") from None


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed`: the first choice keeps it,
    the others draw from seeds of their own, so n choices are n independent samples."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


def max_new_tokens_given(raw: dict[str, Any] | SamplingParamsInput | None) -> bool:
    """Whether the caller chose max_new_tokens (a choice is checked against the context; the
    default is cut to fit it)."""
    if isinstance(raw, SamplingParamsInput):
        return raw.max_new_tokens is not None
    return isinstance(raw, dict) and raw.get("max_new_tokens") is not None
