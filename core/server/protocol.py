"""The request bodies of the HTTP routes, one pydantic schema per route: types and bounds are
checked here, before any work, and a failure is a 400 that names the field. The same schemas
make the OpenAPI document served at /openapi.json (`srv.server.openapi`).

Unknown fields of the OpenAI bodies are ignored, as OpenAI's own server and SGLang do;
`sampling_params` of /generate refuses them (srv.engine.params), since a sampling parameter
srv does not know would silently change nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from srv.engine.errors import InvalidRequest
from srv.engine.params import (MAX_TOKEN_IDS_LOGPROB, NonEmptyStr, SamplingParamsInput, SharedSamplingFields,
                               StrictInput, TokenCount, TokenId, TopLogprobs)

# OpenAI's bound for the completions route's logprobs (its chat route's is TopLogprobs).
MAX_COMPLETION_LOGPROBS = 5
# Prompts of one /v1/completions or /generate batch, and choices (prompts times n) of one call.
MAX_BATCH = 2048
MAX_CHOICES = 2048

TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Priority = Annotated[int, Field(ge=-2**31, le=2**31 - 1)]


class StreamOptions(StrictInput):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(StrictInput):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictInput):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(SharedSamplingFields):
    """The sampling fields the OpenAI routes share (OpenAI's, and SGLang's extra ones)."""

    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    min_tokens: TokenCount | None = None
    response_format: ResponseFormat | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    model: str | None = None
    user: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: NonEmptyStr | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH)] | TokenIds \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)]
    suffix: str | None = None
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None


class TextPart(StrictInput):
    type: Literal["text"]
    text: str


class FunctionCall(StrictInput):
    name: str = ""
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(StrictInput):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictInput):
    # Fields of its own that a chat template reads (reasoning_content, say) pass through to it.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(StrictInput):
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictInput):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictInput):
    name: str


class NamedToolChoice(StrictInput):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # SGLang's and vLLM's: the last assistant message is the start of the answer.
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    # Keyword arguments for the chat template (Qwen3's enable_thinking, say).
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's, with --reasoning-parser: the reasoning as reasoning_content (False: all content),
    # and streamed as it comes (False: in one delta once it ends).
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class SessionParamsInput(StrictInput):
    """`session_params` of /generate: this prompt is a turn of an open session (see srv.engine.sessions)."""

    id: NonEmptyStr
    rid: NonEmptyStr | None = None     # the turn it continues (default: the session's latest)
    offset: Annotated[int, Field(ge=0)] | None = None   # keep this many tokens of that turn's context
    replace: bool = False              # drop the other turns branching from the same one
    drop_previous_output: bool = False


class OpenSessionRequest(StrictInput):
    """POST /open_session."""

    capacity_of_str_len: Annotated[int, Field(ge=1)]   # the longest context a turn may have (tokens)
    session_id: NonEmptyStr | None = None


class CloseSessionRequest(StrictInput):
    """POST /close_session."""

    session_id: NonEmptyStr


class GenerateRequest(StrictInput):
    """POST /generate (SGLang's native route): one prompt or a batch, as text or token ids."""

    text: str | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    sampling_params: SamplingParamsInput | Annotated[list[SamplingParamsInput], Field(max_length=MAX_BATCH)] \
        | None = None
    return_logprob: bool | None = None
    top_logprobs_num: TopLogprobs | None = None
    logprob_start_len: Annotated[int, Field(ge=-1)] | None = None
    return_text_in_logprobs: bool | None = None
    # With return_logprob: these tokens' log-probabilities at every output position.
    token_ids_logprob: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS_LOGPROB)] | None = None
    stream: bool | None = None
    rid: str | None = None
    priority: Priority | None = None
    session_params: SessionParamsInput | None = None
    return_hidden_states: bool | None = None   # with --enable-return-hidden-states
    custom_logit_processor: str | None = None  # with --enable-custom-logit-processor
    lora_path: NonEmptyStr | None = None       # a LoRA adapter's name (--lora-paths)
    # The data-parallel group to run it on (else --load-balance-method picks); SGLang's older
    # name for the same field is data_parallel_rank.
    routed_dp_rank: Annotated[int, Field(ge=0)] | None = None
    data_parallel_rank: Annotated[int, Field(ge=0)] | None = None

    def routed_rank(self) -> int | None:
        """The rank either field names; a 400 where they name two."""
        given = {rank for rank in (self.routed_dp_rank, self.data_parallel_rank) if rank is not None}
        if len(given) > 1:
            raise InvalidRequest("routed_dp_rank and data_parallel_rank name different data-parallel ranks",
                                 "routed_dp_rank")
        return given.pop() if given else None


class AbortRequestBody(StrictInput):
    """POST /abort_request: one request by rid, or every request."""

    rid: NonEmptyStr | None = None
    abort_all: bool = False


class PauseGenerationRequest(StrictInput):
    """POST /pause_generation."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class StartProfileRequest(StrictInput):
    """POST /start_profile: torch.profiler over the scheduler's steps, as a Chrome trace."""

    output_dir: NonEmptyStr | None = None   # default: $SGLANG_TORCH_PROFILER_DIR, else /tmp/srv-profiles
    num_steps: Annotated[int, Field(ge=1)] | None = None   # stop by itself after this many steps
    activities: Annotated[list[Literal["CPU", "GPU", "MEM", "CUDA_PROFILER", "RPD"]], Field(min_length=1)] | None = None
    record_shapes: bool = False
    with_stack: bool = False
    profile_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")] | None = None


class ConfigureLoggingRequest(StrictInput):
    """POST /configure_logging: change --log-requests, its level and --crash-dump-folder while serving."""

    log_requests: bool | None = None
    log_requests_level: Annotated[int, Field(ge=0, le=3)] | None = None
    crash_dump_folder: str | None = None


class TokenizeRequest(StrictInput):
    """POST /tokenize and /v1/tokenize: the token ids of a prompt, or of each of a list."""

    model: str | None = None
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH)]
    add_special_tokens: bool = True


class DetokenizeRequest(StrictInput):
    """POST /detokenize and /v1/detokenize: the text of token ids, or of each of a list."""

    model: str | None = None
    tokens: TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)]
    skip_special_tokens: bool = False


class ScoreRequest(StrictInput):
    """POST /v1/score (SGLang's): the probabilities of label tokens right after a query and each item."""

    model: str | None = None
    query: NonEmptyStr | TokenIds
    items: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH)]
            | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)])
    label_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS_LOGPROB)]
    apply_softmax: bool = False   # normalized over the labels (else each label's own probability)
    item_first: bool = False      # the item before the query


class ScoreResponse(BaseModel):
    object: Literal["scoring"] = "scoring"
    scores: list[list[float]]
    model: str
    usage: dict[str, int]


class RerankRequest(StrictInput):
    """POST /v1/rerank: documents ordered by relevance to a query."""

    model: str | None = None
    query: NonEmptyStr
    documents: Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True


class RerankResult(BaseModel):
    score: float
    index: int
    document: str | None = None
    meta_info: dict[str, Any] | None = None


class SeparateReasoningRequest(StrictInput):
    """POST /separate_reasoning (SGLang's): a text split into its reasoning and the rest."""

    text: str
    reasoning_parser: NonEmptyStr | None = None   # default: --reasoning-parser


class UpdateWeightsFromDiskRequest(StrictInput):
    """POST /update_weights_from_disk: serve another checkpoint of the same model."""

    model_path: NonEmptyStr
    load_format: NonEmptyStr | None = None
    abort_all_requests: bool = False   # else the running requests finish first
    weight_version: NonEmptyStr | None = None


class GetWeightsByNameRequest(StrictInput):
    """POST /get_weights_by_name: the first values of one parameter, flattened."""

    name: NonEmptyStr
    truncate_size: Annotated[int, Field(ge=1, le=1_000_000)] = 100


class UpdateWeightVersionRequest(StrictInput):
    """POST /update_weight_version: the label of the served weights."""

    new_version: NonEmptyStr
    abort_all_requests: bool = False


class MemoryOccupationRequest(StrictInput):
    """POST /release_memory_occupation and /resume_memory_occupation (--enable-memory-saver)."""

    tags: Annotated[list[Literal["kv_cache", "weights"]], Field(min_length=1)] | None = None   # default: both


class LoadLoRAAdapterRequest(StrictInput):
    """POST /load_lora_adapter (with --enable-lora)."""

    lora_name: NonEmptyStr
    lora_path: NonEmptyStr
    pinned: bool = False   # SGLang's: never evicted (srv evicts no adapter by itself)


class UnloadLoRAAdapterRequest(StrictInput):
    """POST /unload_lora_adapter."""

    lora_name: NonEmptyStr


class DumpExpertDistributionRequest(StrictInput):
    """POST /dump_expert_distribution_record."""

    output_dir: NonEmptyStr | None = None   # default: $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp


class ExpertDistribution(BaseModel):
    """/dump_expert_distribution_record: the file written and what it holds, in sum."""

    success: bool
    path: str
    mode: str
    passes: int   # forward passes kept (per_pass and per_token modes)
    logical_count: list[list[int]]   # tokens routed to each expert of each layer
    balancedness: float   # mean over layers of (mean load / largest load) of the experts


class OperationResult(BaseModel):
    """What the operations routes answer (/pause_generation, /start_profile, ...)."""

    success: bool
    message: str
    path: str | None = None   # /start_profile and /stop_profile: the trace's file
    loaded_adapters: list[str] | None = None   # /load_lora_adapter and /unload_lora_adapter


class LoadEntry(BaseModel):
    """/get_load answers one of these per data-parallel rank."""

    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int


class ParseFunctionCallRequest(StrictInput):
    """POST /parse_function_call (SGLang's): the tool calls in a text, as a tool-call parser reads them."""

    text: str
    tool_call_parser: NonEmptyStr | None = None   # default: --tool-call-parser
    tools: list[Tool] | None = None               # each call's tool_index is its place here (-1: none)


class ParsedCall(BaseModel):
    tool_index: int
    name: str
    parameters: str   # the arguments, a JSON object as text


class ParseFunctionCallResponse(BaseModel):
    normal_text: str
    calls: list[ParsedCall]


class SeparateReasoningResponse(BaseModel):
    text: str
    reasoning_text: str


class EmbeddingRequest(StrictInput):
    """POST /v1/embeddings (OpenAI's): the embedding of a text, of token ids, or of each of a list."""

    model: str | None = None
    input: (NonEmptyStr | TokenIds | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH)]
            | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


class EncodeRequest(StrictInput):
    """POST /encode (SGLang's): the embedding of a text or token ids, or of each of a list."""

    text: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)] | None = None


# ---- responses (for the OpenAPI document; the routes build them as plain dicts) ----------------


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str   # a base64 string of little-endian float32 with encoding_format base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class EncodeResult(BaseModel):
    embedding: list[float]
    meta_info: dict[str, Any]


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeResponse(BaseModel):
    text: str | list[str]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: dict[str, str]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None   # with --reasoning-parser
    tool_calls: list[ToolCallOut] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] | None = None


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FinishReason(BaseModel):
    type: str
    matched: int | str | None


class MetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[Any]] | None = None
    output_token_ids_logprobs: list[list[Any]] | None = None
    hidden_states: list[list[float]] | None = None   # return_hidden_states: one a computed position


class GenerateResult(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail
