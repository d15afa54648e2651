"""Retained slots in the engine: a resumed turn's greedy output equals a full prefill's, for every backend, whether
the state stayed on its lane or went to the host and back; a prompt that diverges inside a retained sequence never
resumes from it; a backend that cannot retain prefills everything."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from ignis.backends.dflash2.weights import save_random_drafter
from ignis.backends.off import Off
from ignis.config import load_config
from ignis.engine.core import Engine
from ignis.ipc.messages import EngineRequest, RequestDelta
from ignis.model.config import ModelConfig
from ignis.params import SamplingParams
from tiny import tiny_checkpoint

VOCAB = 512
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=17, mtp=True, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def drafter(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_drafter(tmp_path_factory.mktemp("drafter"), ModelConfig.from_dir(ckpt), seed=7, num_layers=2,
                               taps=2, sliding_window=16)


def engine(ckpt: Path, drafter: Path, backend: str, exact: str = "on", **settings: Any) -> Engine:
    """An engine with `backend` (3 drafts a round when it drafts); `settings` are engine.* keys. exact "off": decoding
    lanes go through the device round (the GPU's path, here on the CPU)."""
    overrides: dict[str, Any] = {"model.path": str(ckpt), "spec.backend": backend, "log.level": "warning",
                                 "model.exact": exact}
    if backend != "off":
        overrides["spec.draft_tokens"] = 3
    if backend == "dflash2":
        overrides["spec.drafter"] = str(drafter)
    overrides.update({f"engine.{k}": v for k, v in settings.items()})
    return Engine(load_config(profile="cpu", overrides=overrides))


def turn(e: Engine, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> RequestDelta:
    """Run one request to its end on `e` (other lanes idle); its tokens and final stats."""
    e.add(EngineRequest(id=rid, prompt_token_ids=prompt, params=params))
    tokens: list[int] = []
    while True:
        for d in e.step():
            if d.id == rid:
                tokens += d.token_ids
                if d.finished:
                    return RequestDelta(id=rid, token_ids=tokens, finished=True, finish_reason=d.finish_reason,
                                        stats=d.stats)


_REFERENCE: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def full_prefill(ckpt: Path, drafter: Path, backend: str, prompt: list[int], exact: str = "on") -> list[int]:
    """The reference: a fresh engine, which has nothing retained, so the whole prompt is prefilled (remembered per
    backend and prompt: the tests share one checkpoint and drafter)."""
    key = (backend + exact, tuple(prompt))
    if key not in _REFERENCE:
        _REFERENCE[key] = turn(engine(ckpt, drafter, backend, exact, lanes=1), "ref", prompt).token_ids
    return _REFERENCE[key]


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize(("backend", "lanes"), [("off", 1), ("off", 2), ("mtp", 1), ("dflash2", 1)])
def test_second_and_third_turns_resume_and_equal_a_full_prefill(ckpt: Path, drafter: Path, backend: str,
                                                                 lanes: int) -> None:
    """Two conversations take turns. With two lanes each resumes on its own lane; with one, each turn moves the other
    conversation's state to the host, and the next turn copies it back (the lone fifth conversation resumes on its
    lane). First-turn lengths around prefill_chunk (64)
    boundaries, added turns from one token to more than a chunk."""
    rng = random.Random(len(backend))  # the same conversations for one lane and two
    e = engine(ckpt, drafter, backend, lanes=lanes)
    restored: list[int] = []
    restore = e.store.restore
    e.store.restore = lambda moves: (restored.extend(r.key for r in moves.restores), restore(moves))[1]  # type: ignore[method-assign]
    starts = [(1, 3), (63, 1), (64, 70), (65, 2), (126, 1)]
    conversations = [(rand(rng, a), b) for a, b in starts]
    for pair in (conversations[:2], conversations[2:4], conversations[4:]):
        history = {i: p for i, (p, _) in enumerate(pair)}
        for step in range(3):  # first, second and third turns, the conversations alternating
            for i, (_, added) in enumerate(pair):
                prompt = history[i] if step == 0 else history[i] + rand(rng, added + step)
                out = turn(e, f"{i}.{step}.{len(prompt)}", prompt)
                assert out.token_ids == full_prefill(ckpt, drafter, backend, prompt), (backend, step, len(prompt))
                assert out.stats is not None
                if step == 0:
                    assert out.stats.prompt_tokens_resumed == 0
                else:  # everything the last turn ran: its prompt and its output but the last token (the anchor)
                    assert out.stats.prompt_tokens_resumed == len(history[i]) - 1
                history[i] = prompt + out.token_ids
    s = e.stats()
    assert s.retained_hits == 10 and s.prompt_tokens_resumed_total > 0
    # One lane: every later turn but those of the lone last conversation came back from the host; two: none did.
    assert len(restored) == (8 if lanes == 1 else 0)


@pytest.mark.parametrize("backend", ["mtp", "dflash2"])
def test_the_device_round_resumes_from_the_host_too(ckpt: Path, drafter: Path, backend: str) -> None:
    """Outside exact mode decoding lanes run the device round (static shapes, the backend's device form), which reads
    a restored lane like any other. Its arithmetic depends on the batch, so this compares tokens, not bits."""
    rng = random.Random(2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    e = engine(ckpt, drafter, backend, "off", lanes=1)
    assert e.runner.device_round is not None
    history = [rand(rng, 70), rand(rng, 30)]
    for step in range(3):
        for i in (0, 1):
            prompt = history[i] + (rand(rng, 5) if step else [])
            out = turn(e, f"{i}.{step}", prompt, params)
            assert out.stats is not None and out.stats.prompt_tokens_resumed == (len(history[i]) - 1 if step else 0)
            assert out.token_ids == turn(engine(ckpt, drafter, backend, "off", lanes=1), "ref", prompt, params).token_ids
            history[i] = prompt + out.token_ids


@pytest.mark.parametrize("backend", ["off", "mtp"])
def test_a_prompt_that_diverges_inside_a_retained_sequence_is_prefilled_whole(ckpt: Path, drafter: Path,
                                                                             backend: str) -> None:
    rng = random.Random(5)
    e = engine(ckpt, drafter, backend, lanes=1)
    first = rand(rng, 70)
    seq = first + turn(e, "first", first).token_ids  # the state covers seq[:-1]; seq[-1] is the token after it
    changed = seq[:8] + rand(rng, len(seq) - 9) + seq[-1:]  # same first 8 tokens, same length and last token
    anchor = list(seq)
    anchor[-1] = (anchor[-1] + 1) % VOCAB  # every covered position equal, the token after them not
    for name, prompt in [("inside", changed + rand(rng, 5)), ("anchor", anchor + rand(rng, 3)),
                         ("ends at the covered end", seq[:-1]), ("shorter", seq[:50])]:
        out = turn(e, name, prompt)
        assert out.stats is not None and out.stats.prompt_tokens_resumed == 0, name
        assert out.token_ids == full_prefill(ckpt, drafter, backend, prompt), name
    # The original state went to the host meanwhile (one lane); a prompt that does extend it still resumes from it.
    prompt = seq + rand(rng, 4)
    out = turn(e, "extends", prompt)
    assert out.stats is not None and out.stats.prompt_tokens_resumed == len(seq) - 1
    assert out.token_ids == full_prefill(ckpt, drafter, backend, prompt)
    assert e.stats().retained_hits == 1


def test_an_aborted_prefill_is_retained_and_a_resent_prompt_resumes_from_it(ckpt: Path, drafter: Path) -> None:
    e = engine(ckpt, drafter, "off", lanes=1, max_rows=64)
    prompt = rand(random.Random(8), 200)
    e.add(EngineRequest(id="a", prompt_token_ids=prompt, params=GREEDY))
    e.step()
    e.step()  # two chunks of 64 prefilled
    e.abort(["a"])
    out = turn(e, "b", prompt)
    assert out.stats is not None and out.stats.prompt_tokens_resumed == 128
    assert out.token_ids == full_prefill(ckpt, drafter, "off", prompt)


def test_the_host_bound_drops_what_does_not_fit_and_a_dropped_state_means_a_full_prefill(ckpt: Path,
                                                                                         drafter: Path) -> None:
    probe = engine(ckpt, drafter, "off", lanes=1)
    rng = random.Random(9)
    e = engine(ckpt, drafter, "off", lanes=1, retained_host_memory=probe.store.state_bytes(80))
    a, b = rand(rng, 70), rand(rng, 60)
    seq_a = a + turn(e, "a", a).token_ids  # 74 positions: fits the bound
    seq_b = b + turn(e, "b", b).token_ids  # moves a's state to the host
    assert e.stats().retained_host_bytes == probe.store.state_bytes(len(seq_a) - 1)
    c = rand(rng, 90)
    turn(e, "c", c)  # b's state goes to the host: a's is dropped to make room
    assert e.stats().retained_host_bytes == probe.store.state_bytes(len(seq_b) - 1)
    prompt = seq_a + rand(rng, 3)
    out = turn(e, "a2", prompt)
    assert out.stats is not None and out.stats.prompt_tokens_resumed == 0
    assert out.token_ids == full_prefill(ckpt, drafter, "off", prompt)
    # a2 took the lane from c's state, which covers 94 positions, more than the bound: dropped, never copied.
    assert e.stats().retained_host_bytes == probe.store.state_bytes(len(seq_b) - 1)
    again = turn(e, "c2", c + rand(rng, 30))
    assert again.stats is not None and again.stats.prompt_tokens_resumed == 0


def test_a_backend_that_cannot_retain_prefills_every_prompt(ckpt: Path, drafter: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Off, "lane_views", lambda self, lane, length: None)
    e = engine(ckpt, drafter, "off", lanes=1)
    assert e.scheduler.retained is None
    first = rand(random.Random(3), 20)
    prompt = first + turn(e, "1", first).token_ids + [7]
    out = turn(e, "2", prompt)
    assert out.stats is not None and out.stats.prompt_tokens_resumed == 0
    assert e.stats().retained_slots == 0 and e.stats().retained_misses == 0
