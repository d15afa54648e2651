"""Screenshots of the Playground for the README: Chat with a streamed reply and the Monitor under load, light and dark.

    python -m tools.playground_screenshots                  # starts ignis serve (built-in model, dflash2 at 7, CPU)
    python -m tools.playground_screenshots --url http://127.0.0.1:8000 --out docs

Owns: the scene (a conversation, background requests so the Monitor's charts move) and the files
`playground-{chat,monitor}-{light,dark}.png`. Does not own: the browser (tools/browser.py) or the pages.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tools.browser import chromium

PROMPT = "Write a Python class for a binary search tree with insert, delete and search."
BACKGROUND = [
    "def merge_sort(items):", "class LRUCache:", "def parse_args(argv):", "import asyncio\n\nasync def main():",
    "def fibonacci(n: int) -> int:", "def read_config(path):",
]
VIEWPORT = {"width": 1360, "height": 900}


@contextmanager
def serve() -> Iterator[str]:
    cmd = [sys.executable, "-m", "ignis.cli", "serve", "--profile", "cpu", "--port", "0",
           "--set", "spec.backend=dflash2", "--set", "spec.draft_tokens=7", "--set", "log.level=warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if m := re.search(r"OpenAI API\s+(http://\S+)/v1", line):
                yield m.group(1)
                return
        raise RuntimeError("ignis serve did not start")
    finally:
        proc.terminate()
        proc.wait(60)


def complete(url: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=300).read()


def load(url: str, stop: threading.Event, lanes: int) -> list[threading.Thread]:
    """`lanes` clients sending completions one after another until `stop`, so the charts have something to show."""
    def client(i: int) -> None:
        n = i
        while not stop.is_set():
            complete(url, BACKGROUND[n % len(BACKGROUND)], 96 + 32 * (n % 4))
            n += lanes
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(lanes)]
    for t in threads:
        t.start()
    return threads


def shoot(url: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with chromium() as browser:
        conversation = None
        for theme in ("light", "dark"):
            ctx = browser.new_context(viewport=VIEWPORT, color_scheme=theme, device_scale_factor=1)
            page = ctx.new_page()
            page.goto(f"{url}/playground")
            page.evaluate("s => localStorage.setItem('ignis.playground.settings', s)", json.dumps({"max_tokens": 220}))
            if conversation is None:
                page.reload()
                page.fill('[data-testid="prompt"]', PROMPT)
                page.press('[data-testid="prompt"]', "Enter")
                page.wait_for_selector('[data-role="assistant"][data-done="true"]', timeout=120_000)
                conversation = page.evaluate("localStorage.getItem('ignis.playground.conversation')")
            else:
                page.evaluate("c => localStorage.setItem('ignis.playground.conversation', c)", conversation)
                page.reload()
            page.wait_for_timeout(500)
            page.screenshot(path=str(out / f"playground-chat-{theme}.png"))
            ctx.close()

        stop = threading.Event()
        threads = load(url, stop, lanes=3)
        try:
            pages = []
            for theme in ("light", "dark"):
                ctx = browser.new_context(viewport=VIEWPORT, color_scheme=theme, device_scale_factor=1)
                page = ctx.new_page()
                page.goto(f"{url}/playground/monitor")
                pages.append((theme, page))
            pages[0][1].wait_for_timeout(40_000)
            for theme, page in pages:
                page.screenshot(path=str(out / f"playground-monitor-{theme}.png"), full_page=True)
        finally:
            stop.set()
            for t in threads:
                t.join(300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running ignis serve; default: start one")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    if args.url:
        shoot(args.url.rstrip("/"), args.out)
    else:
        with serve() as url:
            shoot(url, args.out)


if __name__ == "__main__":
    main()
