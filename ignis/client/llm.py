"""`LLM`: the synchronous, batch Python API (vLLM-shaped).

Owns: turning prompts (text, token ids, or chat conversations) into engine requests, validating all of them before
any is queued, collecting the outputs in order, and their metrics. Does not own: the engine (reached through an
`EngineClient`) or text streaming (ignis.client.async_llm).
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from ignis.artifact import resolve_model_path
from ignis.client.base import EngineClient
from ignis.client.output import OutputState
from ignis.config import IgnisConfig, load_config
from ignis.errors import InputError
from ignis.ipc.messages import EngineRequest, RequestStats
from ignis.logging import configure, log_resolved
from ignis.outputs import CompletionOutput, RequestOutput
from ignis.params import SamplingParams, check_prompt
from ignis.tokenizer import Tokenizer

Prompt = str | Mapping[str, Any]


def resolve_config(
    model: str | None, profile: str | None, config: str | Path | None, overrides: Mapping[str, Any] | None
) -> IgnisConfig:
    merged = dict(overrides or {})
    if model is not None:
        merged["model.path"] = str(model)
    return load_config(profile=profile, path=config, overrides=merged)


class LLM:
    """Generate from a model in batches.

    >>> llm = LLM()                                   # the built-in model
    >>> llm = LLM("path/to/artifact", profile="cpu", overrides={"spec.backend": "off"})
    >>> outs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=64, temperature=0.0))
    >>> llm = LLM(address="ipc:///run/ignis/engine.sock")  # a GPU process already running (`ignis serve`)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        profile: str | None = None,
        config: str | Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        client: EngineClient | None = None,
        address: str | None = None,
    ) -> None:
        self.config = resolve_config(model, profile, config, overrides)
        configure(self.config.log.level, self.config.log.format)
        log_resolved(self.config)
        self.tokenizer = Tokenizer.from_dir(resolve_model_path(self.config))
        if client is None:
            # The GPU process: a child on a private address, or the one already running at `address`.
            from ignis.client.process_client import ProcessClient

            client = ProcessClient(self.config, address)
        self.client = client
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]  # request ids stay unique when several clients share one engine

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        encoded = [self._encode(i, p) for i, p in enumerate(prompts)]
        return self._run(encoded, params)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        params: SamplingParams | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        one = bool(messages) and isinstance(messages[0], Mapping)
        convs = cast(Sequence[Sequence[Mapping[str, Any]]], [messages] if one else messages)
        texts = [self.tokenizer.apply_chat_template([dict(m) for m in c], **template_kwargs) for c in convs]
        return self.generate(texts, params)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _encode(self, index: int, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, ids = None, list(prompt["prompt_token_ids"])
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            text = str(prompt["prompt"])
            ids = self.tokenizer.encode(text)
        else:
            raise InputError(f"prompts[{index}]", "must be a string, {'prompt': str} or {'prompt_token_ids': [...]}")
        try:
            check_prompt(ids, context=self.client.info.context, vocab_size=self.client.info.vocab_size)
        except InputError as e:
            raise InputError(f"prompts[{index}].{e.field}", e.message) from None
        return text, ids

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids or tuple(self.client.info.eos_token_ids)
        return sorted(set(params.stop_token_ids) | set(eos))

    def _run(self, encoded: list[tuple[str | None, list[int]]], params: SamplingParams) -> list[RequestOutput]:
        states: dict[str, tuple[int, int, OutputState]] = {}
        stop_ids = self._stop_ids(params)
        pending: deque[tuple[str, list[int], SamplingParams]] = deque()
        for i, (_, ids) in enumerate(encoded):
            for j in range(params.n):
                sample = params if params.seed is None else _with_seed(params, params.seed + j)
                rid = f"{self._prefix}-{next(self._ids)}"
                states[rid] = (i, j, OutputState(rid, sample, self.tokenizer))
                pending.append((rid, ids, sample))
        stats: dict[str, RequestStats | None] = {}
        reasons: dict[str, tuple[str | None, int | str | None]] = {}
        logprobs: dict[str, list[dict[int, float]]] = {}
        live: set[str] = set()
        # A batch larger than the engine's lanes and queue goes in as room frees up.
        room = self.client.info.lanes + self.config.engine.max_waiting
        try:
            while len(reasons) < len(states):
                while pending and len(live) < room:
                    rid, ids, sample = pending.popleft()
                    self.client.add(EngineRequest(id=rid, prompt_token_ids=ids, params=sample.for_engine(),
                                                  stop_token_ids=stop_ids))
                    live.add(rid)
                for delta in self.client.get_deltas(timeout=None):
                    if delta.id not in live:
                        continue
                    st = states[delta.id][2]
                    td = st.feed(delta)
                    if td.logprobs:
                        logprobs.setdefault(delta.id, []).extend(td.logprobs)
                    if td.stop_hit and not delta.finished:
                        self.client.abort([delta.id])
                    if td.finished:
                        reasons[delta.id] = (td.finish_reason, td.stop_reason)
                        stats[delta.id] = td.stats
                        live.discard(delta.id)
        except BaseException:
            if live:
                self.client.abort(sorted(live))  # nothing that was accepted keeps running for nobody
            raise
        outputs = [
            RequestOutput(request_id=str(i), prompt=text, prompt_token_ids=ids, outputs=[], finished=True)
            for i, (text, ids) in enumerate(encoded)
        ]
        for rid, (i, j, st) in states.items():
            reason, stop_reason = reasons[rid]
            outputs[i].outputs.append(
                CompletionOutput(j, st.text, st.token_ids, reason, stop_reason, logprobs.get(rid) if params.logprobs is not None else None)
            )
            _add_metrics(outputs[i].metrics, stats.get(rid))
        for out in outputs:
            out.outputs.sort(key=lambda c: c.index)
        return outputs


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, seed=seed)


def _add_metrics(metrics: dict[str, Any], stats: RequestStats | None) -> None:
    if stats is None:
        return
    for key, value in stats.as_dict().items():
        if isinstance(value, list):
            cur = metrics.setdefault(key, [])
            for i, v in enumerate(value):
                if i < len(cur):
                    cur[i] += v
                else:
                    cur.append(v)
        elif key == "tokens_per_s":
            continue
        elif key in ("prompt_tokens", "prompt_ms") and key in metrics:
            continue  # the n samples share one prompt
        elif key == "prompt_tokens_resumed":
            metrics[key] = max(metrics.get(key, 0), value)  # of that one prompt: the sample that resumed furthest
        else:
            metrics[key] = metrics.get(key, 0) + value
    decode_ms = metrics.get("decode_ms", 0.0)
    metrics["tokens_per_s"] = 1000.0 * metrics.get("decode_tokens", 0) / decode_ms if decode_ms > 0 else 0.0
