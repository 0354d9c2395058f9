"""Request and response bodies of the OpenAI API, as pydantic models.

Requests validate what the HTTP boundary owns: JSON types (strictly, so that ``true`` is
never read as 1 nor ``1`` as true), finite numbers, text that is valid Unicode, ranges that
hold whatever the model, and fields the server does not implement yet. The sampling ranges
themselves are checked once, by SamplingParams, and what depends on the model (token ids
against the vocabulary, lengths against max_model_len) by the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

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
    """JSON escapes can spell a lone surrogate (``"\\ud800"``) that no UTF-8 encoder takes;
    left in, it fails deep in the tokenizer as a 500, so it is refused where it arrives."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode", "the text holds a lone surrogate (U+{code}) at index {index}, not valid Unicode",
            {"code": f"{ord(text[exc.start]):04X}", "index": exc.start}) from None
    return text


Encodable = AfterValidator(_utf8_encodable)
Text = Annotated[str, Encodable]
"""Every string the server reads: prompts, messages, stop strings, names."""


def int_range(low: int, high: int = 2**63 - 1) -> Any:
    """A JSON integer (never a boolean or a float) in [low, high]. The default top keeps
    every count within the 64 bits that the engine's messages carry: JSON has no limit,
    and 10**400 is as easy to send as 4."""
    return Annotated[StrictInt, Field(ge=low, le=high)]


TokenId = int_range(0)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Count = int_range(0)
MaxTokens = int_range(1)
LogprobCount = int_range(0, 20)
TopK = int_range(-1)
Choices = int_range(1, 128)
Seed = int_range(-2**63, 2**64 - 1)
"""Any 64-bit seed, signed or not."""

UNION_TAGS = frozenset({"string", "list", "strings", "token_ids", "token_id_lists"})
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


def _string_or_list(item: Any) -> Any:
    """A string or a list of ``item``, as stop strings and message contents are."""
    return Annotated[
        Union[Annotated[Text, Tag("string")], Annotated[list[item], Tag("list")]],
        Discriminator(_json_kind, custom_error_type="string_or_list_type",
                      custom_error_message="Input should be a string or a list")]


Prompt = Annotated[
    Union[Annotated[Text, Tag("string")], Annotated[list[Text], Tag("strings"), Field(min_length=1)],
          Annotated[TokenIds, Tag("token_ids")],
          Annotated[list[TokenIds], Tag("token_id_lists"), Field(min_length=1)]],
    Discriminator(_prompt_form, custom_error_type="prompt_type",
                  custom_error_message="Input should be a string, a list of strings, a list of token ids "
                                       "or a list of lists of token ids")]
Stop = _string_or_list(Text)


class RequestModel(BaseModel):
    """Base of every request body and its parts: ``NaN`` and ``Infinity``, which Python's
    JSON parser accepts, are refused in every float field (``StrictFloat`` still takes an
    integer, ``1`` for ``1.0``, but no boolean or numeric string)."""

    model_config = ConfigDict(allow_inf_nan=False)


class StreamOptions(RequestModel):
    include_usage: StrictBool = False


_UNSUPPORTED = ("response_format", "tools", "tool_choice", "functions", "function_call", "logit_bias",
                "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "tool_choice": ("none",),
    "logit_bias": ({},),
}
"""Values of unsupported fields that ask for nothing beyond plain generation (null aside)."""


class SamplingFields(RequestModel):
    """What completions and chat share: sampling, stopping, and the vLLM extensions."""

    model_config = ConfigDict(extra="ignore")

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
    user: Text | None = None

    # Structured output and tools, not built yet: declared so that asking for them is
    # refused by _refuse_unsupported rather than dropped with the unknown fields.
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        """Ignoring these would answer a client that asked for JSON or a tool call with free
        text and a 200; null and the neutral values ask for nothing, so they pass."""
        if value is None or value in _NEUTRAL_VALUES.get(info.field_name or "", ()):
            return value
        raise PydanticCustomError(UNSUPPORTED_PARAMETER, "not supported by this server yet")

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


Content = _string_or_list(ChatContentPart)


class ChatMessage(RequestModel):
    """Any role goes through: the chat template decides which it knows, as in vLLM."""

    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(min_length=1), Encodable]
    content: Content | None = None
    name: Text | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: content flattened to one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: LogprobCount | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_seconds)
    owned_by: str = "tokenmill"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
