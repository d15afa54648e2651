"""The Playground as people use it: `ignis serve` on the built-in model with dflash2 at 7 drafts (CPU profile), its
Chat and Monitor pages driven in headless Chromium (Debian's chromium package through Playwright), and the JSON the
Monitor reads checked against /metrics.

A machine without Chromium fails the browser test with what to install; it is never skipped.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ignis.config import IgnisConfig, load_config
from serving import launch

STATIC = Path(__file__).resolve().parent.parent / "ignis" / "server" / "playground" / "static"
SVG_NS = "http://www.w3.org/2000/svg"  # a namespace name inside SVG markup, not something fetched


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("playground") / "serve.log"
    with launch(["--profile", "cpu", "--port", "0", "--set", "spec.backend=dflash2", "--set", "spec.draft_tokens=7",
                 "--set", "log.format=json"], log) as s:
        yield Server(s.proc, s.url, log)


def scrape(server: Server) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def wait_until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def complete(server: Server, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


# ---- the pages and the JSON they read ----------------------------------------------------------------------


def test_the_pages_and_every_file_they_load_come_from_the_package_with_nothing_from_the_network(server: Server) -> None:
    for path, title in (("/", "ignis · Chat"), ("/playground", "ignis · Chat"), ("/playground/monitor", "ignis · Monitor")):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert f"<title>{title}</title>" in r.text
        for ref in re.findall(r'(?:src|href)="([^"]+)"', r.text):
            if ref.startswith("/playground/static/"):
                assert httpx.get(server.url + ref).status_code == 200, ref
    served = {p.name for p in STATIC.iterdir()}
    assert {"chat.js", "monitor.js", "charts.js", "common.js", "style.css"} <= served
    for name in sorted(served):
        r = httpx.get(f"{server.url}/playground/static/{name}")
        assert r.status_code == 200 and r.content == (STATIC / name).read_bytes(), name
        assert not re.findall(r"(?:https?:)?//[\w.-]+\.\w+/", r.text.replace(SVG_NS, "")), f"{name} refers off the server"
    assert httpx.get(f"{server.url}/playground/static/chat.js").headers["content-type"].startswith("text/javascript")
    missing = httpx.get(f"{server.url}/playground/static/nope.js")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_every_static_file_is_package_data_so_an_installed_wheel_serves_the_pages() -> None:
    project = tomllib.loads((STATIC.parents[3] / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert "ignis.server.playground" in setuptools["packages"]
    patterns = setuptools["package-data"]["ignis.server.playground"]
    for f in STATIC.iterdir():
        assert any(fnmatch.fnmatch(f"static/{f.name}", p) for p in patterns), f.name


def test_metrics_json_carries_the_numbers_of_metrics_and_what_the_engine_runs(server: Server) -> None:
    complete(server, "def fib(n):", 24)
    snap = httpx.get(f"{server.url}/metrics.json").json()
    m = scrape(server)
    s = snap["stats"]
    assert snap["engine"]["backend"] == "dflash2" and snap["engine"]["draft_tokens"] == 7
    assert snap["engine"]["model_name"] == "ignis-builtin" and snap["engine"]["lanes"] == 4
    assert s["requests_total"] == m["ignis_requests_total"] >= 1
    assert s["generation_tokens_total"] == m["ignis_generation_tokens_total"] >= 24
    assert s["rounds"] == m["ignis_speculative_rounds_total"] > 0
    assert s["drafted"] == m["ignis_speculative_drafted_tokens_total"]
    assert s["accepted"] == m["ignis_speculative_accepted_tokens_total"]
    assert len(s["position_drafted"]) == 7
    for i in range(7):
        assert s["position_drafted"][i] == m[f"ignis_speculative_position_drafted_total{{position={i}}}"]
        assert s["position_accepted"][i] == m[f"ignis_speculative_position_accepted_total{{position={i}}}"]
    assert s["running"] == m["ignis_requests_running"] == 0 and abs(snap["time"] - time.time()) < 60


def _from_command(line: str) -> IgnisConfig:
    """The config `ignis serve` would resolve from this command line."""
    args = shlex.split(line)
    assert args[:2] == ["ignis", "serve"]
    profile = args[args.index("--profile") + 1] if "--profile" in args else None
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    return load_config(profile=profile, overrides=sets)


def test_control_describes_the_running_config_and_turns_a_change_into_the_serve_line_that_runs_it(server: Server) -> None:
    c = httpx.get(f"{server.url}/playground/config").json()
    running = IgnisConfig.from_dict(c["config"])
    assert running.spec.backend == "dflash2" and running.spec.draft_tokens == 7 and c["profile"] == "cpu"
    assert {"off", "mtp", "dflash2"} <= set(c["backends"]["installed"])
    assert c["backends"]["mtp"] is True and c["backends"]["drafter_width"] == 7
    assert _from_command(c["command"]) == running  # the line reproduces what runs
    keys = {s["key"]: s for s in c["settings"]}
    assert keys["spec.backend"]["choices"] == c["backends"]["installed"] and keys["spec.draft_tokens"]["value"] == 7
    assert all(s["restart"] for s in c["settings"])

    r = httpx.post(f"{server.url}/playground/command", json={"set": {"spec.backend": "mtp", "spec.draft_tokens": "3"}})
    assert r.status_code == 200, r.text
    body = r.json()
    wanted = _from_command(body["command"])
    assert wanted.spec.backend == "mtp" and wanted.spec.draft_tokens == 3 and wanted.engine == running.engine
    assert body["changed"] == ["spec.backend", "spec.draft_tokens"] and body["restart"] is True
    same = httpx.post(f"{server.url}/playground/command", json={"set": {"engine.lanes": 4}}).json()
    assert same["restart"] is False and _from_command(same["command"]) == running

    for change, param in (({"spec.draft_tokens": "9"}, "spec.draft_tokens"), ({"engine.lane": "2"}, "engine.lane"),
                          ({"spec.backend": "nope"}, "spec.backend"), ({"spec.backend": "off"}, "spec.draft_tokens")):
        r = httpx.post(f"{server.url}/playground/command", json={"set": change})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (change, r.text)
    r = httpx.post(f"{server.url}/playground/command", json={"spec.backend": "mtp"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "set"


# ---- in the browser ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from tools.browser import chromium

    try:
        with chromium() as b:
            yield b
    except RuntimeError as e:  # no Chromium or no playwright: fail and say what to install, never skip
        pytest.fail(str(e), pytrace=False)


def _reply(page: Any, index: int) -> dict[str, Any]:
    return page.evaluate("""i => {
        const node = document.querySelector(`[data-testid="message"][data-index="${i}"]`);
        const timings = {};
        node.querySelectorAll('[data-testid="timings"] [data-k]').forEach(s => { timings[s.dataset.k] = s.textContent; });
        const stored = JSON.parse(localStorage.getItem("ignis.playground.conversation"))[i];
        return {done: node.dataset.done === "true", text: stored.content, shown: node.querySelector('[data-testid="reply"]')?.innerText ?? "",
                code: [...node.querySelectorAll('pre code')].map(c => c.textContent), timings};
    }""", index)


def _bars(page: Any) -> dict[str, float]:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        '[data-testid="chart-acceptance"] rect.bar')].map(b => [b.dataset.position, Number(b.dataset.rate)]))""")


def test_chat_streams_with_timings_stops_frees_the_lane_survives_a_reload_and_the_monitor_follows(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    page = browser.new_context(viewport={"width": 1280, "height": 860}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server.url}/playground")
    page.wait_for_selector('[data-testid="engine-chip"] .dot.ok')

    # A prompt, typed and sent: the streamed reply equals the API's own greedy answer, with its timings beside it.
    prompt = "Write a Python function that reverses a list."
    page.fill('[data-setting="max_tokens"]', "40")
    page.fill('[data-testid="prompt"]', prompt)
    page.press('[data-testid="prompt"]', "Enter")
    page.wait_for_selector('[data-index="1"][data-done="true"]', timeout=60_000)
    reply = _reply(page, 1)
    api = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0, "top_p": 1}).json()
    expected = api["choices"][0]["message"]["content"]
    assert reply["text"] == expected
    fenced = re.fullmatch(r"```\w*\n(.*?)(?:```)?", expected, re.S)
    assert fenced, expected  # the built-in code model answers with a fenced block: it is shown as code
    assert reply["code"] == [fenced.group(1).rstrip("\n")]
    t = reply["timings"]
    assert t["backend"] == "backend dflash2 × 7"
    assert re.fullmatch(r"TTFT \d+ ms", t["ttft"]) and re.fullmatch(r"decode [\d.]+ tok/s", t["tps"])
    rounds = int(t["rounds"].split()[-1])
    accepted, drafted = map(int, re.fullmatch(r"accepted (\d+) / (\d+)", t["accepted"]).groups())
    # The same greedy request through the API runs the same rounds (CPU arithmetic is exact and batch-invariant).
    assert (rounds, drafted, accepted) == (api["timings"]["rounds"], api["timings"]["draft_n"], api["timings"]["draft_n_accepted"])
    assert 0 < rounds < 40 and drafted <= 7 * rounds
    assert float(t["tpr"].split()[-1]) == pytest.approx(1 + accepted / rounds, abs=0.01)
    assert t["tokens"].endswith("→ 40")

    # A long reply, stopped while it streams: the engine frees its lane at once.
    page.fill('[data-setting="max_tokens"]', "3000")
    page.fill('[data-testid="prompt"]', "Write a long Python module for a binary search tree.")
    page.press('[data-testid="prompt"]', "Enter")
    wait_until(lambda: len(_reply(page, 3)["shown"]) > 20, 60, "the long reply to be shown as it streams")
    assert not _reply(page, 3)["done"] and scrape(server)["ignis_requests_running"] == 1
    streamed = len(_reply(page, 3)["text"])
    page.click('[data-testid="stop"]')
    freed = time.monotonic()
    wait_until(lambda: scrape(server)["ignis_requests_running"] == 0, 5, "the lane to be freed")
    assert time.monotonic() - freed < 5
    page.wait_for_selector('[data-index="3"][data-done="true"] [data-k="stopped"]')
    stopped = _reply(page, 3)["text"]
    assert len(stopped) >= streamed
    generated = scrape(server)["ignis_generation_tokens_total"]
    time.sleep(0.5)
    assert scrape(server)["ignis_generation_tokens_total"] == generated  # nothing runs on after the stop

    # A reload keeps the conversation, timings and all, and the theme picked.
    theme = page.get_attribute("html", "data-theme")
    page.click('[data-testid="theme"]')
    assert page.get_attribute("html", "data-theme") == {"light": "dark", "dark": "light"}[theme]
    page.reload()
    assert page.get_attribute("html", "data-theme") != theme
    page.wait_for_selector('[data-testid="message"][data-index="3"]')
    assert _reply(page, 1) == reply and _reply(page, 3)["text"] == stopped
    assert page.input_value('[data-setting="max_tokens"]') == "3000"
    page.screenshot(path=str(tmp_path / "chat.png"))

    # The Monitor: resolved config, backends, control, and the acceptance chart moving after a request.
    page.goto(f"{server.url}/playground/monitor")
    page.wait_for_selector('[data-testid="chart-acceptance"] rect.bar')
    page.wait_for_selector('[data-testid="restart-fields"] [data-key="spec.backend"]')
    summary = page.inner_text('[data-testid="config-summary"]')
    for row in ("backend\tdflash2", "draft tokens\t7", "draft head\tfull", "profile\tcpu", "lanes\t4", "context\t4,096"):
        assert row in summary, summary
    assert page.get_attribute('[data-backend="dflash2"]', "data-running") == "true"
    before = _bars(page)
    assert sorted(before) == [str(i) for i in range(1, 8)]
    complete(server, "class Stack:\n    def push(self, item):", 64)
    snap = httpx.get(f"{server.url}/metrics.json").json()["stats"]
    rates = {str(i + 1): a / d for i, (a, d) in enumerate(zip(snap["position_accepted"], snap["position_drafted"]))}
    wait_until(lambda: _bars(page) == pytest.approx(rates, abs=1e-4), 10, "the acceptance chart to show the request")
    assert rates != before
    assert page.inner_text('[data-testid="tile-requests"] [data-value]') == str(snap["requests_total"])
    assert page.inner_text('[data-testid="tile-lanes"] [data-value]') == "0"

    page.select_option('[data-key="spec.backend"]', "mtp")
    page.fill('[data-key="spec.draft_tokens"]', "3")
    page.dispatch_event('[data-key="spec.draft_tokens"]', "change")
    wait_until(lambda: "spec.draft_tokens=3" in page.inner_text('[data-testid="command"]'), 5, "the serve line")
    line = page.inner_text('[data-testid="command"]')
    assert _from_command(line).spec.backend == "mtp" and "restart" in page.inner_text('[data-testid="command-note"]').lower()
    page.fill('[data-key="spec.draft_tokens"]', "9")
    page.dispatch_event('[data-key="spec.draft_tokens"]', "change")
    page.wait_for_selector('[data-testid="command-note"].bad', timeout=5_000)
    assert "spec.draft_tokens: got 9" in page.inner_text('[data-testid="command-note"]')
    assert page.get_attribute('[data-key="spec.draft_tokens"]', "aria-invalid") == "true"
    page.screenshot(path=str(tmp_path / "monitor.png"), full_page=True)

    for shot in ("chat.png", "monitor.png"):
        assert (tmp_path / shot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not errors, errors
