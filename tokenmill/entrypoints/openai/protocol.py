"""Request and response bodies of the OpenAI API, as pydantic models.

Requests validate what the HTTP boundary owns: JSON types (strictly, so that ``true`` is
never read as 1 nor ``1`` as true), finite numbers, text that is valid Unicode, ranges that
hold whatever the model, and fields the server does not implement yet. The sampling ranges
themselves are checked once, by SamplingParams, and what depends on the model (token ids
against the vocabulary, lengths against max_model_len) by the engine.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenmill.tokenizer import invalid_unicode_at

logger = logging.getLogger(__name__)

# Error types of our own validators that are also the OpenAI error code the client sees.
UNSUPPORTED_PARAMETER = "unsupported_parameter"
UNSUPPORTED_VALUE = "unsupported_value"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_seconds() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _utf8_encodable(text: str) -> str:
    """JSON escapes can spell a lone surrogate (``"\\ud800"``); left in, it fails deep in the
    tokenizer as a 500, so it is refused where it arrives."""
    index = invalid_unicode_at(text)
    if index is not None:
        raise PydanticCustomError(
            "invalid_unicode",
            "the text holds a lone surrogate (U+{code}) at index {index}, not valid Unicode",
            {"code": f"{ord(text[index]):04X}", "index": index},
        )
    return text


Encodable = AfterValidator(_utf8_encodable)
Text = Annotated[str, Encodable]
"""Every string the server reads: prompts, messages, stop strings, names."""


def int_range(low: int, high: int = 2**63 - 1) -> Any:
    """A JSON integer (never a boolean or a float) in [low, high]. The default top keeps
    every count within the 64 bits that the engine's messages carry: JSON has no limit,
    and 10**400 is as easy to send as 4."""
    return Annotated[StrictInt, Field(ge=low, le=high)]


# The named ranges are ``int_range``'s types written out, so that a type checker reads them as ints.
_INT64_MAX = 2**63 - 1
TokenId: TypeAlias = Annotated[StrictInt, Field(ge=0, le=_INT64_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Count: TypeAlias = Annotated[StrictInt, Field(ge=0, le=_INT64_MAX)]
MaxTokens: TypeAlias = Annotated[StrictInt, Field(ge=1, le=_INT64_MAX)]
LogprobCount: TypeAlias = Annotated[StrictInt, Field(ge=0, le=20)]
TopK: TypeAlias = Annotated[StrictInt, Field(ge=-1, le=_INT64_MAX)]
Choices: TypeAlias = Annotated[StrictInt, Field(ge=1, le=128)]
Seed: TypeAlias = Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)]
"""Any 64-bit seed, signed or not."""

UNION_TAGS = frozenset({"string", "list", "strings", "token_ids", "token_id_lists", "named"})
"""The tags of the unions below; they show in validation error locations but are no part
of the body's path, so error messages leave them out."""


def _json_kind(value: Any) -> str | None:
    """Picks the one union member a value can mean, so that a bad value gets that member's
    error instead of one error per member."""
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return None


def _prompt_form(value: Any) -> str | None:
    """Like ``_json_kind``, with a list told apart by its first item."""
    if _json_kind(value) != "list":
        return _json_kind(value)
    first = value[0] if value else None
    if isinstance(first, str):
        return "strings"
    return "token_id_lists" if isinstance(first, list) else "token_ids"


_STRING_OR_LIST = Discriminator(
    _json_kind, custom_error_type="string_or_list_type", custom_error_message="Input should be a string or a list"
)
"""Tells a string from a list of items, as stop strings and message contents are."""


Prompt = Annotated[
    (
        Annotated[Text, Tag("string")]
        | Annotated[list[Text], Tag("strings"), Field(min_length=1)]
        | Annotated[TokenIds, Tag("token_ids")]
        | Annotated[list[TokenIds], Tag("token_id_lists"), Field(min_length=1)]
    ),
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_type",
        custom_error_message="Input should be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids",
    ),
]
Stop: TypeAlias = Annotated[Annotated[Text, Tag("string")] | Annotated[list[Text], Tag("list")], _STRING_OR_LIST]


class RequestModel(BaseModel):
    """Base of every request body and its parts: ``NaN`` and ``Infinity``, which Python's
    JSON parser accepts, are refused in every float field (``StrictFloat`` still takes an
    integer, ``1`` for ``1.0``, but no boolean or numeric string)."""

    model_config = ConfigDict(allow_inf_nan=False)


class StreamOptions(RequestModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # usage in every chunk (with include_usage), as vLLM


_UNSUPPORTED = (
    "functions",
    "function_call",
    "best_of",
    "use_beam_search",
    "length_penalty",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "prompt_embeds",
    "vllm_xargs",
    "kv_transfer_params",
    "audio",
    "modalities",
    "spaces_between_special_tokens",
)
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "bad_words": ([],),
    "logits_processors": ([],),
    "vllm_xargs": ({},),
    "modalities": (["text"],),
    "spaces_between_special_tokens": (True,),
}
"""Values of unsupported fields that ask for nothing beyond plain generation (null aside)."""
_CHAT_UNSUPPORTED = ("documents", "reasoning_effort", "mm_processor_kwargs")
_warned_unknown: set[str] = set()
_MAX_WARNED = 1024  # names remembered: a client sending random names must not grow it forever


def refuse_unsupported(value: Any, info: ValidationInfo) -> Any:
    """Ignoring these would answer a client that asked for a legacy function call or beam search
    with free text and a 200; null and the neutral values ask for nothing, so they pass."""
    if value is None or value in _NEUTRAL_VALUES.get(info.field_name or "", ()):
        return value
    raise PydanticCustomError(UNSUPPORTED_PARAMETER, "not supported by this server yet")


def _logit_bias_key(key: str) -> int:
    """JSON object keys are strings: a token id must be spelled as plain decimal digits."""
    if not (key.isascii() and key.isdigit()):
        raise PydanticCustomError("invalid_logit_bias", "the key '{key}' is not a token id", {"key": key})
    return int(key)


class SamplingFields(RequestModel):
    """What completions and chat share: sampling, stopping, and the vLLM extensions."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: TopK | None = None
    min_p: StrictFloat | None = None
    n: Choices = 1
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: Count = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    logit_bias: dict[Text, StrictFloat] | None = None
    prompt_logprobs: int_range(-1, 20) | None = None  # type: ignore[valid-type]
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    truncate_prompt_tokens: int_range(-1) | None = None  # type: ignore[valid-type]
    priority: int_range(-(2**63)) = 0  # type: ignore[valid-type]
    request_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None

    # Output-neutral: they change neither what is generated nor what is returned.
    user: Text | None = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    cache_salt: Any = None
    prediction: Any = None

    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    # Legacy function calls, beam search and the like, not built: declared so that asking for
    # them is refused by refuse_unsupported rather than dropped as unknown.
    functions: Any = None
    function_call: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    prompt_embeds: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    audio: Any = None
    modalities: Any = None
    spaces_between_special_tokens: Any = None

    _refuse_unsupported = field_validator(*_UNSUPPORTED)(refuse_unsupported)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        """0 would keep no prompt at all; -1 is vLLM's "up to max_model_len"."""
        if value == 0:
            raise PydanticCustomError("invalid_truncation", "must be -1 or an integer >= 1, got 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are checked here, where a key that is no token id can be named; against the
        vocabulary by the engine, which knows it."""
        for key in value or {}:
            _logit_bias_key(key)
        return value

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> SamplingFields:
        """Unknown fields are accepted, as vLLM does, but said once per name: a misspelled
        parameter should not pass unnoticed forever."""
        for name in (self.model_extra or {}).keys() - _warned_unknown:
            if len(_warned_unknown) >= _MAX_WARNED:
                break
            _warned_unknown.add(name)
            logger.warning("the request field %r is not known to this server and is ignored", name)
        return self

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` keyed by token id, as SamplingParams takes it; biases clipped to
        [-100, 100], the range OpenAI documents (vLLM clips the same way)."""
        if not self.logit_bias:
            return None
        return {_logit_bias_key(k): min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()}

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        """OpenAI refuses stream options on a whole response; ``stream`` missing from the data
        means it was invalid, which is reported on its own."""
        if value is not None and info.data.get("stream") is False:
            raise PydanticCustomError("stream_options_without_stream", "only allowed when stream is true")
        return value


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: MaxTokens | None = 16
    logprobs: LogprobCount | None = None
    echo: StrictBool = False
    suffix: Text | None = None
    add_special_tokens: StrictBool = True  # the tokenizer's BOS and the like around a text prompt


class ChatContentPart(RequestModel):
    type: Text
    text: Text

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        """Images, audio and files need a multimodal model; saying so beats dropping them."""
        if value != "text":
            raise PydanticCustomError(UNSUPPORTED_VALUE, "only text content parts are supported")
        return value


Content: TypeAlias = Annotated[
    Annotated[Text, Tag("string")] | Annotated[list[ChatContentPart], Tag("list")], _STRING_OR_LIST
]

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _function_name(name: str) -> str:
    """OpenAI's rule; it also keeps every name a plain JSON string in the call grammars."""
    if not FUNCTION_NAME.fullmatch(name):
        raise PydanticCustomError(
            "invalid_function_name",
            "a function name is 1 to 64 letters, digits, underscores or dashes, got {name}",
            {"name": repr(name[:80])},
        )
    return name


FunctionName = Annotated[str, AfterValidator(_function_name)]


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: Text | None = None
    parameters: dict[Text, Any] | None = None  # a JSON schema of type object; none (or {}): no parameters
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Arguments are a JSON object, so the schema must describe one (OpenAI refuses others too)."""
        if value and value.get("type") != "object":
            raise PydanticCustomError(
                "invalid_parameters",
                'must be a JSON schema of "type": "object", got "type": {kind}',
                {"kind": json.dumps(value.get("type"))},
            )
        return value


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: Text


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


def _choice_form(value: Any) -> str | None:
    return "string" if isinstance(value, str) else "named" if isinstance(value, dict) else None


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("string")] | Annotated[NamedToolChoice, Tag("named")],
    Discriminator(
        _choice_form,
        custom_error_type="tool_choice_type",
        custom_error_message='Input should be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
    ),
]


class MessageFunctionCall(RequestModel):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class MessageToolCall(RequestModel):
    """A call in an earlier assistant message."""

    id: Text
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(RequestModel):
    """Any role goes through: the chat template decides which it knows, as in vLLM."""

    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(min_length=1), Encodable]
    content: Content | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message's answer to that call
    reasoning: Text | None = None  # an assistant's earlier thinking, as replies carry it
    reasoning_content: Text | None = None  # the same, under its older name

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: content flattened to one string, and the
        tool fields that are set. Earlier thinking goes under both names: Qwen3's and
        DeepSeek's templates read ``reasoning_content``, newer ones ``reasoning``."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        tool_fields = self.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        thinking = {} if thought is None else {"reasoning": thought, "reasoning_content": thought}
        return {"role": self.role, "content": content or ""} | tool_fields | thinking

    @model_validator(mode="after")
    def _one_thought(self) -> ChatMessage:
        """Both names given must say the same: which one a template reads should not matter."""
        if (
            self.reasoning is not None
            and self.reasoning_content is not None
            and self.reasoning != self.reasoning_content
        ):
            raise PydanticCustomError(
                "conflicting_reasoning", "reasoning and reasoning_content are two names of one field: they differ"
            )
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: int_range(-1, 20) | None = None  # type: ignore[valid-type]
    echo: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[Text, Any] | None = None
    documents: Any = None
    reasoning_effort: Any = None
    mm_processor_kwargs: Any = None
    add_special_tokens: StrictBool = False  # the template writes the special tokens it wants
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # unset: "auto" with tools, else "none"
    parallel_tool_calls: StrictBool | None = None  # false: tool_choice "required" makes one call
    include_reasoning: StrictBool = True  # false: a reasoning parser's thinking is left out of the reply

    _refuse_chat_unsupported = field_validator(*_CHAT_UNSUPPORTED)(refuse_unsupported)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """One prompt position's token in vLLM's ``prompt_logprobs`` format; ``rank`` is None
    where the engine's top list does not reach the token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(BaseModel):
    id: str = Field(default_factory=new_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCallOut


def _without_null(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """OpenAI leaves these keys out rather than sending null."""
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


class ChatResponseMessage(BaseModel):
    role: str = "assistant"  # the last message's role when add_generation_prompt is false, as vLLM
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # the thinking, with a reasoning parser (vLLM's name)
    reasoning_content: str | None = None  # the same text, under vLLM's older name

    @model_serializer(mode="wrap")
    def _calls_when_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "tool_calls", "reasoning", "reasoning_content")


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first delta only
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "name", "arguments")


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: the first names it (with ``id`` and ``type``), the others
    carry further pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _set_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "id", "type")


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None  # a piece of the thinking, before any content
    reasoning_content: str | None = None  # the same piece, under vLLM's older name

    @model_serializer(mode="wrap")
    def _calls_when_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "tool_calls", "reasoning", "reasoning_content")


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _prompt_ids_once(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """vLLM sends ``prompt_token_ids`` in a stream's first chunk only, and leaves the key
        out of the others."""
        data = handler(self)
        if data.get("prompt_token_ids") is None:
            data.pop("prompt_token_ids", None)
        return data


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_seconds)
    owned_by: str = "tokenmill"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
