"""Text <-> token ids for an artifact: `tokenizer.json` through `tokenizers`, the chat template through jinja2.

Owns: encoding, decoding (whole or one token at a time), chat templates and the artifact's stop tokens. Does not own:
when text is released and stop strings (ignis.client.output). The GPU process never imports this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from ignis.errors import ArtifactError, InputError


def _raise(message: str) -> None:
    raise InputError("messages", message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, config: dict[str, Any], eos_ids: tuple[int, ...]) -> None:
        self._tok = tok
        self.config = config
        self.eos_token_ids = eos_ids
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            i for i, t in tok.get_added_tokens_decoder().items() if getattr(t, "special", False)
        )
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        self._template = None
        self._template_source: str | None = template or None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = _tojson
            self._template = env.from_string(template)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ArtifactError(f"{path} has no tokenizer.json; ignis reads Hugging Face fast-tokenizer files")
        tok = _HFTokenizer.from_file(str(tj))
        cfg_path = path / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        eos: list[int] = []
        name = _token_name(config.get("eos_token"))
        eos_id = tok.token_to_id(name) if name is not None else None
        if eos_id is not None:
            eos.append(eos_id)
        model_cfg = path / "config.json"
        if model_cfg.is_file():
            mc = json.loads(model_cfg.read_text())
            ids = mc.get("eos_token_id", mc.get("text_config", {}).get("eos_token_id"))
            for i in [ids] if isinstance(ids, int) else (ids or []):
                if i not in eos:
                    eos.append(i)
        gen_cfg = path / "generation_config.json"
        if gen_cfg.is_file():
            ids = json.loads(gen_cfg.read_text()).get("eos_token_id")
            for i in [ids] if isinstance(ids, int) else (ids or []):
                if i not in eos:
                    eos.append(i)
        return cls(tok, config, tuple(eos))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while Rust works (encode holds it): a front-end that tokenizes a long prompt
        # in a worker thread keeps its event loop, and every other stream, running.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, *, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """A decoder fed one token at a time: the new text it completes, or None while a character is still split."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token: stream.step(self._tok, token)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def chat_template(self) -> str | None:
        """The template's source (front-ends read which tool-call format and think markers it uses)."""
        return self._template_source

    def apply_chat_template(self, messages: list[dict[str, Any]], /, *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages`; `kwargs` become template variables (tools, enable_thinking, ...). Any failure of the
        template (a raise_exception, a filter given the wrong type, an undefined name) is the caller's input error."""
        if self._template is None:
            raise InputError("messages", "this model has no chat template; send a plain prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise InputError(f"messages[{i}]", "each message needs a 'role' and a 'content'")
        if "messages" in kwargs:
            raise InputError("chat_template_kwargs", "may not set 'messages'")
        variables = {
            "bos_token": _token_name(self.config.get("bos_token")) or "",
            "eos_token": _token_name(self.config.get("eos_token")) or "",
            **kwargs,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(messages=messages, **variables)
        except InputError:
            raise
        except Exception as e:  # the template is user-facing code run on user data: whatever it raises is a 400
            raise InputError("messages", f"the chat template could not render them: {type(e).__name__}: {e}") from e


def _token_name(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
