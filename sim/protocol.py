"""HTTP bodies the sim accepts (OpenAI chat/completions, SGLang /generate) and the errors it returns.

Validation is lenient where SGLang is (unknown fields are ignored, numbers in strings coerce) and
strict where it must be to stay a 400 instead of a crash: wrong container types, negative or
non-integer token counts, `n` > 1, batched prompts.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator

from sim import tokenizer


class BadRequest(ValueError):
    """A request body the sim refuses with HTTP 400; `param` names the offending field."""

    from_validation = False  # set for a body that failed validation (its HTTP answer has "param": null)

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def openai_error(message: str, param: str | None = None, code: int = 400) -> dict[str, Any]:
    """SGLang's OpenAI-route error body (`ErrorResponse`)."""
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(code, "InternalServerError")
    return {"object": "error", "message": message, "type": kind, "param": param, "code": code}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Lenient):
    type: StrictStr = "text"
    text: StrictStr | None = None


class ChatMessage(_Lenient):
    role: StrictStr
    content: Union[StrictStr, list[ContentPart], None] = None


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatCompletionRequest(_Lenient):
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    rid: StrictStr | None = None
    routed_dp_rank: int | None = None  # pins an attention-DP rank (sim.dp)
    data_parallel_rank: int | None = None  # its deprecated alias (0.4.9: the only name)
    lora_path: Union[list[StrictStr | None], StrictStr, None] = None  # an adapter (sim.lora)

    @field_validator("n")
    @classmethod
    def _single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("the simulator serves n=1 only")
        return n


class CompletionRequest(_Lenient):
    model: StrictStr | None = None
    prompt: Union[StrictStr, list[StrictStr], list[int], list[list[int]]]
    max_tokens: int = Field(default=16, ge=0)  # OpenAI's and SGLang's default
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    echo: bool = False
    rid: StrictStr | None = None
    routed_dp_rank: int | None = None  # pins an attention-DP rank (sim.dp)
    data_parallel_rank: int | None = None  # its deprecated alias (0.4.9: the only name)
    lora_path: Union[list[StrictStr | None], StrictStr, None] = None  # an adapter (sim.lora)

    @field_validator("n")
    @classmethod
    def _single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("the simulator serves n=1 only")
        return n


class SamplingParams(_Lenient):
    max_new_tokens: int | None = Field(default=None, ge=0)


class GenerateRequest(_Lenient):
    text: Union[StrictStr, list[StrictStr], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: SamplingParams | None = None
    stream: bool = False
    rid: StrictStr | None = None
    routed_dp_rank: int | None = None  # pins an attention-DP rank (sim.dp)
    data_parallel_rank: int | None = None  # its deprecated alias (0.4.9: the only name)
    lora_path: Union[list[StrictStr | None], StrictStr, None] = None  # an adapter (sim.lora)


def _first_error(exc: ValidationError) -> BadRequest:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    out = BadRequest(f"{loc}: {msg}" if loc else msg, param=loc or None)
    out.from_validation = True
    return out


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Parse and validate a JSON body, raising BadRequest with a message naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _first_error(exc) from exc


def _single(prompt: Any, what: str) -> Any:
    """A batch of one is its element; larger batches are refused (the sim serves one at a time)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        if len(prompt) != 1:
            raise BadRequest(f"{what}: batched prompts are not supported by the simulator", what)
        return prompt[0]
    return prompt


def _check_ids(ids: list[int], what: str) -> list[int]:
    if any(t < 0 or t >= tokenizer.VOCAB_SIZE for t in ids):
        raise BadRequest(f"{what}: token ids must be in [0, {tokenizer.VOCAB_SIZE})", what)
    return ids


def chat_input_ids(req: ChatCompletionRequest) -> list[int]:
    return tokenizer.apply_chat_template([m.model_dump() for m in req.messages])


def completion_input_ids(req: CompletionRequest) -> list[int]:
    prompt = _single(req.prompt, "prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_bos=True)
    return _check_ids(list(prompt), "prompt")


def generate_input_ids(req: GenerateRequest) -> list[int]:
    if req.input_ids is not None:
        return _check_ids(list(_single(req.input_ids, "input_ids")), "input_ids")
    if req.text is not None:
        return tokenizer.encode(_single(req.text, "text"), add_bos=True)
    raise BadRequest("Either text or input_ids should be provided.", "text")


Endpoint = Literal["chat", "completion", "generate"]
