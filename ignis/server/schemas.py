"""The OpenAI request bodies the front-end accepts, and their translation into SamplingParams.

Owns: the fields of `/v1/completions` and `/v1/chat/completions` requests (msgspec structs; unknown fields are
ignored as OpenAI clients send extras, while the OpenAI fields that would change the answer and that ignis cannot
honour are declared and refused with a 400 naming them), and `sampling_params`. Does not own: responses (ignis.server.openai) or
prompt checks against the engine (ignis.client.async_llm).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ignis.errors import InputError
from ignis.params import SamplingParams, StructuredOutputs
from ignis.server.limits import check_depth

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})  # OpenAI's; anything else could forge a turn


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Generation(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, json_object, regex, grammar (Lark), choice
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InputError("stream_options", "is only allowed with stream: true")

    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            if not k.strip().isdigit():
                raise InputError("logit_bias", f"keys must be token ids, got {k!r}")
            out[int(k)] = v
        return out


class CompletionRequest(_Generation, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.refuse_unsupported()
        if self.echo:
            raise InputError("echo", "is not supported by ignis")
        if self.suffix:
            raise InputError("suffix", "is not supported by ignis")
        if self.best_of not in (None, self.n):
            raise InputError("best_of", "is not supported by ignis (only best_of == n)")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids (a list of ints is one prompt, as in the OpenAI API)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [list(p)]
        if p and all(isinstance(x, str) for x in p):
            return list(p)
        if p and all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
            return [list(x) for x in p]
        raise InputError("prompt", "must be a string, a list of strings, token ids or a list of token id lists")


class ChatCompletionRequest(_Generation, kw_only=True):
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # OpenAI fields that would change the answer and that ignis does not implement: refused, never ignored.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None

    def check(self) -> None:
        self.refuse_unsupported()
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise InputError(name, "is OpenAI's deprecated form; send 'tools' and 'tool_choice' instead")
        if self.audio is not None or (self.modalities not in (None, ["text"])):
            raise InputError("audio" if self.audio is not None else "modalities", "ignis generates text only")
        for name in ("prediction", "web_search_options"):
            if getattr(self, name) is not None:
                raise InputError(name, "is not supported by ignis")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise InputError("chat_template_kwargs", "must be an object")
        if self.top_logprobs is not None and not self.logprobs:
            raise InputError("top_logprobs", "needs logprobs: true")
        if not self.messages:
            raise InputError("messages", "must hold at least one message")

    def conversation(self) -> list[dict[str, Any]]:
        """Messages with content flattened to text (OpenAI's list-of-parts form allows text parts only here)."""
        out = []
        for i, m in enumerate(self.messages):
            role = m.get("role")
            if role not in ROLES:
                raise InputError(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}, got {role!r}")
            content = m.get("content")
            if content is None and role != "assistant":  # an assistant turn may carry only tool calls
                raise InputError(f"messages[{i}].content", f"a {role} message needs a content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                        raise InputError(f"messages[{i}].content", "only text parts are supported")
                    parts.append(part["text"])
                content = "".join(parts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise InputError(f"messages[{i}].content", "must be a string or a list of text parts")
            out.append({**m, "content": content})
        return out


def sampling_params(
    req: _Generation, *, max_tokens: int, logprobs: int | None, structured: StructuredOutputs | None = None
) -> SamplingParams:
    """OpenAI fields -> SamplingParams; its own checks raise InputError naming the field."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    fields: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, seed=req.seed,
        logit_bias=req.token_bias(), structured_outputs=structured,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    return SamplingParams(**fields)


def decode_body(body: bytes, kind: Any) -> Any:
    """Parse a JSON body; a malformed or too deeply nested one raises InputError naming the field at fault."""
    check_depth(body)
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError:  # deeper than check_depth saw (it cannot see through malformed JSON)
        raise InputError("body", "nests arrays and objects too deeply") from None
    except msgspec.ValidationError as e:
        text = str(e)
        field = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else "body"
        raise InputError(field, text.split(" - at ")[0]) from None
    except msgspec.DecodeError as e:
        raise InputError("body", f"is not valid JSON: {e}") from None
