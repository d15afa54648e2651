"""AsyncLLM over a running GPU process: concurrent streams are exact, cancelled ones free their lanes, nothing leaks."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ignis import AsyncLLM, SamplingParams
from ignis.engine.process import EngineProcess
from ignis.ipc.addresses import private_ipc_address
from serving import tiny_artifact

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
OVERRIDES = {"log.level": "warning", "engine.context": 512, "engine.lanes": 16, "spec.backend": "off"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_artifact(tmp_path_factory.mktemp("async"))


@pytest.fixture(scope="module")
def address(model: Path) -> Iterator[str]:
    from serving import config

    addr = private_ipc_address()
    proc = EngineProcess(config(model, **{"engine.lanes": 16}), addr.address)
    try:
        yield addr.address
    finally:
        proc.stop()
        addr.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(4, 8192) for _ in range(rng.randrange(3, 30))] for _ in range(8)]


@pytest.fixture(scope="module")
def alone(model: Path, address: str, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens when it runs by itself."""

    async def main() -> list[list[int]]:
        async with AsyncLLM(str(model), profile="cpu", overrides=OVERRIDES, address=address) as llm:
            return [(await llm.generate(p, GREEDY)).outputs[0].token_ids for p in prompts]

    return asyncio.run(main())


async def _tokens(llm: AsyncLLM, prompt: list[int], params: SamplingParams) -> list[int]:
    out: list[int] = []
    async for o in llm.stream(prompt, params):
        out.extend(o.token_ids)
    return out


async def _idle(llm: AsyncLLM, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (s := await llm.client.stats()).running or s.waiting:
        assert time.monotonic() < deadline, f"lanes still held: {s.running} running, {s.waiting} waiting"
        await asyncio.sleep(0.05)


def test_sixteen_concurrent_streams_each_get_exactly_their_tokens_alone(model, address, prompts, alone) -> None:
    async def main() -> list[list[int]]:
        async with AsyncLLM(str(model), profile="cpu", overrides=OVERRIDES, address=address) as llm:
            return await asyncio.gather(*(_tokens(llm, prompts[i % 8], GREEDY) for i in range(16)))

    together = asyncio.run(main())
    assert all(len(t) == GREEDY.max_tokens for t in alone) and len({tuple(t) for t in alone}) == 8
    assert together == [alone[i % 8] for i in range(16)]


def test_cancelling_ten_of_a_hundred_streams_leaves_the_rest_exact_and_frees_every_lane(model, address, prompts, alone) -> None:
    async def main() -> None:
        async with AsyncLLM(str(model), profile="cpu", overrides=OVERRIDES, address=address) as llm:
            started = asyncio.Event()

            async def doomed(p: list[int]) -> None:
                async for _ in llm.stream(p, LONG):
                    started.set()

            short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)  # greedy: a prefix of GREEDY's
            kept = {i: asyncio.create_task(_tokens(llm, prompts[i % 8], short)) for i in range(100) if i % 10}
            cancelled = [asyncio.create_task(doomed(prompts[i % 8])) for i in range(0, 100, 10)]
            await started.wait()
            for t in cancelled:
                t.cancel()
            results = await asyncio.gather(*kept.values())
            for i, tokens in zip(kept, results):
                assert tokens == alone[i % 8][:3], f"stream {i} differs from its prompt alone"
            assert all(t.cancelled() for t in cancelled)
            await _idle(llm)

    asyncio.run(main())


def test_leaving_a_stream_early_aborts_it_and_stop_strings_end_it(model, address, alone, prompts) -> None:
    async def main() -> None:
        async with AsyncLLM(str(model), profile="cpu", overrides=OVERRIDES, address=address) as llm:
            async for o in llm.stream(prompts[0], LONG):
                assert o.token_ids and not o.finished
                break
            await _idle(llm)
            text = llm.tokenizer.decode(alone[1])
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            out = await llm.generate(prompts[1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop=[stop]))
            c = out.outputs[0]
            assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[: text.index(stop)]
            await _idle(llm)

    asyncio.run(main())


def test_an_embedded_engine_is_started_as_a_child_and_closing_stops_it_and_removes_its_address(model) -> None:
    async def main() -> tuple[object, Path]:
        llm = AsyncLLM(str(model), profile="cpu", overrides=OVERRIDES)
        owned = llm.client._owned
        assert owned is not None and owned.address.private_dir is not None
        where = owned.address.private_dir
        try:
            out = await llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2))
            assert [len(c.token_ids) for c in out.outputs] == [3, 3]
            assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy: both samples agree
            assert out.metrics["decode_tokens"] == 6
        finally:
            await llm.close()
        return owned, where

    owned, where = asyncio.run(main())
    assert not owned.process.alive() and not where.exists()  # type: ignore[attr-defined]
