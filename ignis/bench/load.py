"""Driving load: requests streamed at a fixed concurrency (and optionally a request rate), each one timed.

Owns: one streamed request as a client sees it (time to the first text, to the last byte, tokens from `usage`, and
ignis's `timings` when the server sends them) and one concurrency level (at most `concurrency` in flight; with a
`rate`, arrivals are a Poisson process at that many requests a second). Does not own: what is sent (.workloads) or
the summary (.report).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ignis.bench.workloads import Item


@dataclass
class Sample:
    """One request as the client saw it; times in seconds from sending it."""

    ok: bool
    error: str | None = None
    ttft: float = 0.0  # to the first chunk with text
    e2e: float = 0.0  # to the end of the stream
    prompt_tokens: int = 0
    output_tokens: int = 0
    rounds: int | None = None  # ignis only: verify rounds and accepted drafts (llama.cpp-style timings)
    accepted: int | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def send(client: httpx.AsyncClient, base_url: str, item: Item, model: str, ignore_eos: bool = False) -> Sample:
    t0 = time.perf_counter()
    sample = Sample(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", base_url + item.path, json=item.body(model, ignore_eos)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                return Sample(ok=False, error=f"HTTP {r.status_code}: {body[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if _text(chunk):
                    chunks += 1
                    if sample.ttft == 0.0:
                        sample.ttft = time.perf_counter() - t0
                _usage(chunk, sample)
    except (httpx.HTTPError, ValueError) as e:
        return Sample(ok=False, error=f"{type(e).__name__}: {e}")
    sample.e2e = time.perf_counter() - t0
    sample.output_tokens = sample.output_tokens or chunks  # servers that send no usage: one token a chunk
    sample.ok = sample.ttft > 0.0 or sample.output_tokens == 0
    return sample


def _text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def _usage(chunk: dict[str, Any], sample: Sample) -> None:
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        sample.output_tokens = int(usage.get("completion_tokens") or 0)
    timings = chunk.get("timings")
    if isinstance(timings, dict) and "rounds" in timings:
        sample.rounds = int(timings["rounds"])
        sample.accepted = int(timings.get("draft_n_accepted") or 0)


async def level(base_url: str, model: str, items: list[Item], *, concurrency: int, requests: int, rate: float,
                timeout_s: float, api_key: str | None, ignore_eos: bool = False, offset: int = 0,
                on_done: Callable[[int], None] | None = None) -> tuple[list[Sample], float]:
    """Send `requests` items (cycling through `items` from `offset`) with at most `concurrency` in flight.
    Returns the samples and the wall time from the first send to the last answer."""
    gate = asyncio.Semaphore(concurrency)
    arrivals = random.Random(offset)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    done = 0

    async with httpx.AsyncClient(timeout=timeout_s, headers=headers, limits=limits) as client:
        async def one(i: int) -> Sample:
            nonlocal done
            async with gate:
                s = await send(client, base_url, items[(offset + i) % len(items)], model, ignore_eos)
            done += 1
            if on_done is not None:
                on_done(done)
            return s

        t0 = time.perf_counter()
        tasks = []
        for i in range(requests):
            tasks.append(asyncio.create_task(one(i)))
            if rate != float("inf") and i + 1 < requests:
                await asyncio.sleep(arrivals.expovariate(rate))
        samples = list(await asyncio.gather(*tasks))
        return samples, time.perf_counter() - t0


async def model_name(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The first model the server lists (`GET /models`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
        r = await client.get(base_url + "/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
