"""`AsyncLLM`: streaming generation from asyncio code, over the same protocol the server uses.

Owns: turning one prompt into its n engine requests (one queue for all of them), feeding each request's deltas
through its OutputState (incremental text, stop strings), and aborting what is still running when the caller
stops listening (break, cancel, error). Does not own: the socket and liveness (ignis.client.async_client),
text rules (ignis.client.output) or HTTP (ignis.server).

    async with AsyncLLM(profile="cpu") as llm:
        async for out in llm.stream("def fib(n):", SamplingParams(max_tokens=32, temperature=0.0)):
            print(out.text, end="")
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec

from ignis.artifact import resolve_model_path
from ignis.client.async_client import AsyncEngineClient, Item
from ignis.client.llm import Prompt, _add_metrics, resolve_config
from ignis.client.output import OutputState
from ignis.config import IgnisConfig
from ignis.errors import InputError
from ignis.ipc.messages import EngineRequest, RequestStats
from ignis.logging import configure, log_resolved
from ignis.outputs import CompletionOutput, RequestOutput
from ignis.params import SamplingParams, check_prompt
from ignis.tokenizer import Tokenizer


@dataclass
class StreamOutput:
    """New output of one of a request's n samples."""

    request_id: str
    index: int  # which of the n samples
    text: str  # text released since this sample's previous output
    token_ids: list[int]  # tokens received since this sample's previous output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None  # per token of this output: {token id: logprob}, chosen + top-N
    stats: RequestStats | None  # on the finished output: timings and speculation counts


class AsyncLLM:
    """Stream from a model. Starts the GPU process as a child, or connects to a running one (`address=`)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        profile: str | None = None,
        config: str | Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        address: str | None = None,
    ) -> None:
        cfg = resolve_config(model, profile, config, overrides)
        configure(cfg.log.level, cfg.log.format)
        log_resolved(cfg)
        self._setup(cfg, Tokenizer.from_dir(resolve_model_path(cfg)), AsyncEngineClient(cfg, address))

    @classmethod
    def from_parts(cls, config: IgnisConfig, tokenizer: Tokenizer, client: AsyncEngineClient) -> AsyncLLM:
        """Over a client someone else made (a front-end connects without waiting for the engine)."""
        self = cls.__new__(cls)
        self._setup(config, tokenizer, client)
        return self

    def _setup(self, config: IgnisConfig, tokenizer: Tokenizer, client: AsyncEngineClient) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    async def start(self) -> None:
        await self.client.start(wait=True)

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def prompt_ids(self, prompt: Prompt | Sequence[int]) -> list[int]:
        """Token ids of a prompt (text, {'prompt': text}, {'prompt_token_ids': ids} or ids), checked against the
        engine's context and vocabulary."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            ids = self.tokenizer.encode(str(prompt["prompt"]))
        elif isinstance(prompt, Sequence):
            ids = list(cast(Sequence[int], prompt))  # check_prompt refuses anything but ints in the vocabulary
        else:
            raise InputError("prompt", "must be a string, token ids, {'prompt': str} or {'prompt_token_ids': [...]}")
        info = self.client.info
        check_prompt(ids, context=info.context, vocab_size=info.vocab_size)
        return ids

    def stop_ids(self, params: SamplingParams) -> list[int]:
        if params.ignore_eos:
            return sorted(set(params.stop_token_ids))
        eos = self.tokenizer.eos_token_ids or tuple(self.client.info.eos_token_ids)
        return sorted(set(params.stop_token_ids) | set(eos))

    async def stream(
        self, prompt: Prompt | Sequence[int], params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[StreamOutput]:
        """Outputs of every sample as they come. Leaving the loop early (or being cancelled) aborts the rest."""
        params = params or SamplingParams()
        if not self.client.started:
            await self.start()
        ids = self.prompt_ids(prompt)
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        stop_ids = self.stop_ids(params)
        queue: asyncio.Queue[Item] = asyncio.Queue()
        states: dict[str, tuple[int, OutputState]] = {}
        live: set[str] = set()
        try:
            for j in range(params.n):
                seed = None if params.seed is None else (params.seed + j) % 2**63
                sample = msgspec.structs.replace(params, n=1, seed=seed)
                cid = rid if params.n == 1 else f"{rid}-{j}"
                req = EngineRequest(id=cid, prompt_token_ids=ids, params=sample.for_engine(), stop_token_ids=stop_ids)
                self.client.add(req, queue)
                states[cid] = (j, OutputState(cid, sample, self.tokenizer))
                live.add(cid)
            while live:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.id not in live:
                    continue
                j, st = states[item.id]
                td = st.feed(item)
                if td.stop_hit and not item.finished:
                    self.client.abort([item.id])
                if td.finished:
                    live.discard(item.id)
                yield StreamOutput(rid, j, td.text, td.token_ids, td.finished, td.finish_reason, td.stop_reason,
                                   td.logprobs, td.stats)
        finally:
            if live:
                self.client.abort(sorted(live))

    async def generate(self, prompt: Prompt | Sequence[int], params: SamplingParams | None = None) -> RequestOutput:
        """The whole output at once (the same shape as `ignis.LLM.generate` returns per prompt)."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        outs: dict[int, CompletionOutput] = {}
        metrics: dict[str, Any] = {}
        async for o in self.stream(prompt, params):
            c = outs.setdefault(o.index, CompletionOutput(o.index, "", [], None))
            c.text += o.text
            c.token_ids.extend(o.token_ids)
            if params.logprobs is not None and o.logprobs:
                c.logprobs = (c.logprobs or []) + o.logprobs
            if o.finished:
                c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
                _add_metrics(metrics, o.stats)
        return RequestOutput(
            request_id="0", prompt=text, prompt_token_ids=self.prompt_ids(prompt), outputs=[outs[i] for i in sorted(outs)],
            finished=True, metrics=metrics,
        )
