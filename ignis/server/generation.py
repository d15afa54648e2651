"""One HTTP generation on the front-end: its prompts' streams merged, raced against the client leaving, summed up.

Owns: running the n samples of each prompt as one stream of (choice index, output), aborting all of them when the
client disconnects or the response ends early, usage and llama.cpp-style timings, and logprobs in OpenAI's two
shapes. Does not own: response envelopes (ignis.server.openai) or engine requests (ignis.client.async_llm).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from ignis.client.async_llm import AsyncLLM, StreamOutput
from ignis.ipc.messages import RequestStats
from ignis.params import SamplingParams
from ignis.tokenizer import Tokenizer

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the response started; its requests were aborted."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # the handler itself was cancelled (shutdown): the work must not outlive it
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merged(
    llm: AsyncLLM, prompts: Sequence[list[int]], params: SamplingParams
) -> AsyncGenerator[tuple[int, StreamOutput], None]:
    """Every sample of every prompt as it comes, as (choice index = prompt * n + sample, output)."""
    if len(prompts) == 1:
        async for o in llm.stream(prompts[0], params):
            yield o.index, o
        return
    queue: asyncio.Queue[tuple[int, StreamOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, ids: list[int]) -> None:
        try:
            async for o in llm.stream(ids, params):
                queue.put_nowait((i * params.n + o.index, o))
        except Exception as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats | None = None

    def add(self, o: StreamOutput) -> None:
        self.text += o.text
        self.token_ids.extend(o.token_ids)
        self.logprobs.extend(o.logprobs or [])
        if o.finished:
            self.finish_reason, self.stats = finish_reason(o.finish_reason), o.stats


def finish_reason(reason: str | None) -> str | None:
    # OpenAI knows "stop" and "length"; an engine abort here only follows a stop string or a departed client.
    return "stop" if reason == "abort" else reason


async def collect(events: AsyncIterator[tuple[int, StreamOutput]], count: int) -> list[Choice]:
    choices = [Choice() for _ in range(count)]
    async for index, o in events:
        choices[index].add(o)
    return choices


def usage(prompts: Sequence[list[int]], completion_tokens: int,
          stats: Sequence[RequestStats | None] = ()) -> dict[str, Any]:
    """OpenAI's usage. stats: the choices' RequestStats in index order (prompt i's samples are choices i*n..i*n+n-1);
    cached_tokens counts, per prompt, the prompt tokens a retained slot held for the sample that resumed furthest."""
    prompt_tokens = sum(len(p) for p in prompts)
    n = max(len(stats) // max(len(prompts), 1), 1)
    resumed: dict[int, int] = {}
    for i, s in enumerate(stats):
        if s is not None:
            resumed[i // n] = max(resumed.get(i // n, 0), s.prompt_tokens_resumed)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(resumed.values())}}


def timings(prompts: Sequence[list[int]], stats: Sequence[RequestStats | None]) -> dict[str, Any]:
    """llama.cpp's names, from the engine's RequestStats; samples ran side by side, so their ms take the max."""
    got = [s for s in stats if s is not None]
    predicted_n = sum(s.decode_tokens for s in got)
    predicted_ms = max((s.decode_ms for s in got), default=0.0)
    return {
        "prompt_n": sum(len(p) for p in prompts),
        "prompt_ms": max((s.prompt_ms for s in got), default=0.0),
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_second": 1000.0 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
        "rounds": sum(s.rounds for s in got),
        "draft_n": sum(s.drafted for s in got),
        "draft_n_accepted": sum(s.accepted for s in got),
    }


def _top(lp: dict[int, float], chosen: int, n: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def completion_logprobs(tok: Tokenizer, token_ids: list[int], lps: list[dict[int, float]], n: int, offset: int) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, lp in zip(token_ids, lps):
        s = tok.decode([t], skip_special_tokens=False)
        tokens.append(s)
        token_lps.append(lp.get(t))
        tops.append({tok.decode([i], skip_special_tokens=False): v for i, v in _top(lp, t, n)})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: Tokenizer, token_ids: list[int], lps: list[dict[int, float]], n: int) -> dict:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""

    def entry(i: int, v: float | None) -> dict:
        s = tok.decode([i], skip_special_tokens=False)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    content = []
    for t, lp in zip(token_ids, lps):
        content.append({**entry(t, lp.get(t)), "top_logprobs": [entry(i, v) for i, v in _top(lp, t, n)]})
    return {"content": content}
