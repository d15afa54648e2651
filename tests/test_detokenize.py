"""Incremental detokenization: streamed text equals the whole decode, stop strings stay exact across token
boundaries, and a long answer costs linear front-end time."""

from __future__ import annotations

import time

from ignis.artifact import BUILTIN
from ignis.client.output import OutputState
from ignis.ipc.messages import RequestDelta
from ignis.params import SamplingParams
from ignis.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(BUILTIN)
TEXT = "def f(x):\n    return {'café': x, 'π': 3.14} # 😀 naïve\n" * 3


def stream(ids: list[int], params: SamplingParams, step: int = 1) -> tuple[str, OutputState]:
    st = OutputState("r", params, TOK)
    out = ""
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        d = st.feed(RequestDelta(id="r", token_ids=ids[i : i + step], finished=last, finish_reason="length" if last else None))
        out += d.text
        if d.finished:
            break
    return out, st


def test_streamed_text_equals_the_whole_decode() -> None:
    ids = TOK.encode(TEXT)
    for step in (1, 2, 5):
        text, st = stream(ids, SamplingParams(), step)
        assert text == TOK.decode(ids) == st.text


def test_stop_strings_cut_exactly_across_token_boundaries() -> None:
    ids = TOK.encode(TEXT)
    for stop in ("return {", "é': x", "😀", "\n    r"):
        text, st = stream(ids, SamplingParams(stop=(stop,)))
        assert text == TEXT[: TEXT.index(stop)], stop
        kept, _ = stream(ids, SamplingParams(stop=(stop,), include_stop_str_in_output=True))
        assert kept == TEXT[: TEXT.index(stop) + len(stop)]


def _window_costs(n: int, window: int) -> tuple[float, float]:
    """Time of the first and of the last `window` tokens of one n-token stream, two tokens a delta."""
    ids = (TOK.encode(TEXT) * (n // 10))[:n]
    st = OutputState("r", SamplingParams(stop=("never appears",)), TOK)
    times = []
    for i in range(0, n, 2):
        t0 = time.perf_counter()
        st.feed(RequestDelta(id="r", token_ids=ids[i : i + 2]))
        times.append(time.perf_counter() - t0)
    per = window // 2
    return sum(times[:per]), sum(times[-per:])


def test_a_long_answer_costs_linear_time() -> None:
    # The last 2k tokens of a 32k answer cost what the first 2k did: linear in the output. Re-decoding the whole
    # output on every delta would make them ~30x dearer.
    ratios = []
    for _ in range(3):
        first, last = _window_costs(32768, 2048)
        ratios.append(last / first)
    assert min(ratios) < 3.0, ratios
