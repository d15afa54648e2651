"""The slow reliability probes against a real `ignis serve`, with the figures docs/RELIABILITY.md quotes.

Starts `ignis serve` (two front-ends, the built-in model unless --model) and runs, in order: N concurrent greedy
streams against their solo outputs; memory of both processes around oversized input; a front-end killed while it
streams; the GPU process killed under load; a drain (SIGTERM) with streams in flight. Prints one line per probe
and exits 1 if any guarantee did not hold.

    python -m tools.reliability                      # the built-in model on the CPU profile
    python -m tools.reliability --streams 64 --profile cpu --model PATH
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import zmq

PROMPTS = ["def fib(n):", "class Stack:", "import os\n", "for i in range(", "def parse(text):", "x = [",
           "async def main():", "# sort a list\n"]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    engine_address: str

    def events(self, name: str) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()
                if line.startswith("{") and f'"{name}"' in line]

    def engine_pid(self) -> int:
        return int(self.events("ignis.serve.engine_started")[-1]["pid"])

    def frontend_pid(self, index: int) -> int:
        return int([e for e in self.events("ignis.serve.frontend_started") if e["frontend"] == index][-1]["pid"])


def start(args: argparse.Namespace, base: Path) -> Server:
    address = f"ipc://{base}/engine.sock"
    cmd = [sys.executable, "-m", "ignis.cli", "serve", "--profile", args.profile, "--port", "0",
           "--set", "server.frontends=2", "--set", f"server.engine_address={address}", "--set", "log.format=json",
           "--set", f"engine.lanes={args.lanes}", "--set", "engine.max_waiting=512"]
    if args.model:
        cmd += ["--model", args.model]
    log = base / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"OpenAI API\s+(http://\S+)/v1", line):
            return Server(proc, m.group(1), log, address)
    raise SystemExit(f"ignis serve did not start:\n{log.read_text()[-3000:]}")


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                 first: asyncio.Event | None = None, served: list[str] | None = None) -> tuple[str, str | None, str]:
    """(text, finish reason or None, the front-end that served it); an SSE error event raises RuntimeError.
    `first` is set on the first event; `served` gets the serving front-end's number as soon as it is known."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    text, reason = "", None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        frontend = r.headers["x-ignis-frontend"]
        if served is not None:
            served.append(frontend)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if first is not None:
                first.set()
            for c in event["choices"]:
                text += c["text"]
                reason = c["finish_reason"] or reason
    return text, reason, frontend


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


async def solo(url: str, max_tokens: int) -> dict[str, str]:
    async with _client() as c:
        return {p: (await stream(c, url, p, max_tokens))[0] for p in PROMPTS}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def report(name: str, held: bool, figures: str) -> bool:
    print(f"| {name} | {'held' if held else 'FAILED'} | {figures} |", flush=True)
    return held


async def probe_streams(s: Server, n: int, max_tokens: int, alone: dict[str, str]) -> bool:
    async with _client() as c:
        t = time.monotonic()
        got = await asyncio.gather(*(stream(c, s.url, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n)))
        wall = time.monotonic() - t
    same = sum(text == alone[PROMPTS[i % len(PROMPTS)]] for i, (text, _, _) in enumerate(got))
    return report(f"{n} concurrent greedy streams == solo", same == n,
                  f"{same}/{n} identical to their solo output, {n * max_tokens} tokens in {wall:.1f} s")


async def probe_memory(s: Server) -> bool:
    fe, eng = s.frontend_pid(0), s.engine_pid()
    fe0, eng0 = rss_mib(fe), rss_mib(eng)
    async with httpx.AsyncClient(timeout=120) as c:
        statuses = []
        for body in ({"prompt": "x" * 20_000_000}, {"prompt": "x", "stop": "s" * 10_000_000},
                     {"prompt": "x", "stop": ["s"] * 1000}, {"prompt": "x", "n": 1000}):
            for _ in range(2):  # either front-end
                statuses.append((await c.post(f"{s.url}/v1/completions", json=body)).status_code)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(s.engine_address)
    raw.send(msgspec.msgpack.encode({"type": "add", "id": "big", "prompt_token_ids": [1000] * 10_000_000,
                                     "params": {}}))  # ~30 MB
    await asyncio.sleep(2.0)
    raw.close()
    ctx.term()
    fe1, eng1 = rss_mib(fe), rss_mib(eng)
    held = all(400 <= x < 500 for x in statuses) and fe1 - fe0 < 64 and eng1 - eng0 < 64
    return report("oversized input: 20 MB prompt, 10 MB stop string, 1,000 stops, n = 1000, a 30 MB engine frame",
                  held, f"statuses {sorted(set(statuses))}; front-end {fe0:.0f} -> {fe1:.0f} MiB, "
                  f"engine {eng0:.0f} -> {eng1:.0f} MiB")


async def probe_frontend_kill(s: Server, max_tokens: int, alone: dict[str, str]) -> bool:
    async with _client() as c:
        served: list[list[str]] = [[] for _ in range(16)]
        tasks = []
        for i in range(16):  # one at a time, each on its own connection: the two front-ends take turns accepting
            first = asyncio.Event()
            tasks.append(asyncio.create_task(stream(c, s.url, PROMPTS[i % len(PROMPTS)], max_tokens, first,
                                                    served[i])))
            await first.wait()
        counts = {f: sum(x == [f] for x in served) for f in ("0", "1")}
        victim = max(counts, key=lambda f: counts[f])  # the busier one
        os.kill(s.frontend_pid(int(victim)), signal.SIGKILL)
        t = time.monotonic()
        # The engine frees the dead front-end's lanes once it sees the connection drop.
        while True:
            m = (await c.get(f"{s.url}/metrics")).text
            running = float(re.search(r"^ignis_requests_running (\S+)", m, re.M).group(1))  # type: ignore[union-attr]
            if running <= 16 - counts[victim]:
                break
            await asyncio.sleep(0.02)
        freed_s = time.monotonic() - t
        results = await asyncio.gather(*tasks, return_exceptions=True)
    survivors = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
    same = sum(r[0] == alone[PROMPTS[i % len(PROMPTS)]] for i, r in survivors)  # type: ignore[index]
    lost = len(results) - len(survivors)
    return report("front-end killed (kill -9) while 16 streams run on two front-ends",
                  lost == counts[victim] and 0 < same == len(survivors),
                  f"its {lost} streams cut, their lanes free {freed_s:.2f} s after the kill; {same}/{len(survivors)} "
                  "on the other front-end complete and identical to solo")


async def probe_engine_kill(s: Server, max_tokens: int, alone: dict[str, str]) -> bool:
    async with _client() as c:
        while (await c.get(f"{s.url}/health")).status_code != 200:  # the killed front-end's restart
            await asyncio.sleep(0.1)
        firsts = [asyncio.Event() for _ in range(16)]
        tasks = [asyncio.create_task(stream(c, s.url, PROMPTS[i % len(PROMPTS)], max_tokens, firsts[i]))
                 for i in range(16)]
        await asyncio.gather(*(f.wait() for f in firsts))
        os.kill(s.engine_pid(), signal.SIGKILL)
        t = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed_s = time.monotonic() - t
        errors = sum(isinstance(r, RuntimeError) for r in results)
        while True:
            try:
                if all([(await c.get(f"{s.url}/health")).status_code == 200 for _ in range(4)]):
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        back_s = time.monotonic() - t
        again = await stream(c, s.url, PROMPTS[0], max_tokens)
    return report("GPU process killed (kill -9) under 16 streams", errors == 16 and again[0] == alone[PROMPTS[0]],
                  f"{errors}/16 streams ended with an error event {failed_s:.2f} s after the kill; serving again "
                  f"after {back_s:.1f} s, output identical to before")


async def probe_drain(s: Server, max_tokens: int, alone: dict[str, str]) -> bool:
    async with _client() as c:
        firsts = [asyncio.Event() for _ in range(8)]
        tasks = [asyncio.create_task(stream(c, s.url, PROMPTS[i], max_tokens, firsts[i])) for i in range(8)]
        await asyncio.gather(*(f.wait() for f in firsts))
        s.proc.send_signal(signal.SIGTERM)
        t = time.monotonic()
        await asyncio.sleep(0.2)
        r = await c.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        refused_ms = 1000 * (time.monotonic() - t - 0.2)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    same = sum(not isinstance(x, BaseException) and x[0] == alone[PROMPTS[i]] for i, x in enumerate(results))
    code = await asyncio.to_thread(s.proc.wait, 120)
    total = time.monotonic() - t
    held = r.status_code == 503 and "retry-after" in r.headers and same == 8 and code == 0
    return report("drain (SIGTERM) with 8 streams in flight", held,
                  f"new request: {r.status_code} with Retry-After in {refused_ms:.0f} ms; {same}/8 in flight complete "
                  f"and identical to solo; exit code {code} after {total:.1f} s")


async def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        s = start(args, Path(tmp))
        try:
            alone = await solo(s.url, args.max_tokens)
            print(f"ignis serve --profile {args.profile} (2 front-ends, {args.lanes} lanes, "
                  f"{args.model or 'the built-in model'}), {args.max_tokens}-token greedy streams\n", flush=True)
            print("| probe | result | figures |\n|---|---|---|", flush=True)
            long = 4 * args.max_tokens  # streams that are still running when something is killed
            alone_long = await solo(s.url, long)
            ok = [
                await probe_streams(s, args.streams, args.max_tokens, alone),
                await probe_memory(s),
                await probe_frontend_kill(s, long, alone_long),
                await probe_engine_kill(s, long, alone_long),
                await probe_drain(s, long, alone_long),
            ]
        finally:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
                s.proc.wait(120)
    return 0 if all(ok) else 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.reliability", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="artifact directory (default: the built-in model)")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--lanes", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse())))
