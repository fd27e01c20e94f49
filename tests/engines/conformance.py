"""Engine conformance: what every engine must do, written against the Engine interface only.

A test module builds a `Subject` (a started engine with room for `SLOTS` sequences, and a
direct greedy call to the same model to compare with) and runs every case in `CASES` on it:

    @pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
    async def test_conformance(subject, case): await case(subject)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.engines.outputs import Result, collect
from tokenyard.engines import Engine, EngineRequest, StepOutput
from tokenyard.engines.detok import SequenceDecoder
from tokenyard.errors import InvalidRequest
from tokenyard.messages import FinishReason, SamplingParams

# Sequences the subject's engine must hold at once (its capacity may be larger).
SLOTS = 2
PROMPTS = [
    "The queue holds",
    "Once upon a time there was",
    "def add(a, b):",
    "Le café",
]

Reference = Callable[[list[int], int], Awaitable[list[int]]]


@dataclass
class Subject:
    """An engine under test and a direct greedy call to its model (EOS ignored)."""

    engine: Engine
    reference: Reference
    # max_tokens of a sequence that is still running when the test cancels it
    long_tokens: int = 1500
    timeout: float = 120.0


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def hf_reference(model_path: Path) -> Reference:
    """Plain transformers `generate`, greedy: the direct call for engines of an HF model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()

    def run(prompt: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
        tokens: list[int] = out[0, len(prompt) :].tolist()
        return tokens

    async def reference(prompt: list[int], n: int) -> list[int]:
        return await asyncio.to_thread(run, prompt, n)

    return reference


async def run_one(s: Subject, seq_id: str, prompt: list[int], params: SamplingParams) -> Result:
    s.engine.add(EngineRequest(seq_id, prompt, params))
    return (await collect(s.engine, 1, s.timeout))[seq_id]


async def wait_for(s: Subject, seq_id: str) -> StepOutput:
    """Read outputs until `seq_id` finishes; return its last output."""
    async with asyncio.timeout(s.timeout):
        while True:
            for out in await s.engine.outputs():
                if out.seq_id == seq_id and out.finish_reason is not None:
                    return out


def streamed_text(s: Subject, prompt: list[int], params: SamplingParams, ids: list[int]) -> str:
    """The text an attempt had streamed once it had produced `ids`."""
    tok = s.engine.tokenizer
    return SequenceDecoder(tok.decode, params, prompt_ids=prompt).feed(ids).text


# -- cases ----------------------------------------------------------------------------------


async def greedy_parity(s: Subject) -> None:
    """Concurrent greedy sequences produce exactly what a direct call to the model does."""
    tok = s.engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:SLOTS]]
    for i, p in enumerate(prompts):
        s.engine.add(EngineRequest(f"g{i}", p, greedy(24)))
    res = await collect(s.engine, len(prompts), s.timeout)
    for i, p in enumerate(prompts):
        r = res[f"g{i}"]
        ref = await s.reference(p, 24)
        assert r.token_ids == ref, f"prompt {i}"
        assert r.text == tok.decode(ref)
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
        assert r.finish.completion_tokens == 24
        assert r.finish.prompt_tokens == len(p)


async def cancel_frees_capacity(s: Subject) -> None:
    """Aborting a running sequence ends it CANCELLED and its slot serves the next one."""
    tok = s.engine.tokenizer
    prompt = tok.encode("long story")
    long = [f"long{i}" for i in range(SLOTS)]
    for seq_id in long:
        s.engine.add(EngineRequest(seq_id, prompt, greedy(s.long_tokens)))
    started: set[str] = set()
    async with asyncio.timeout(s.timeout):
        while started != set(long):
            started |= {o.seq_id for o in await s.engine.outputs() if o.token_ids}
    s.engine.abort(long[0])
    assert (await wait_for(s, long[0])).finish_reason is FinishReason.CANCELLED
    s.engine.add(EngineRequest("short", prompt, greedy(5)))
    finished: dict[str, StepOutput] = {}
    async with asyncio.timeout(s.timeout):
        while "short" not in finished:
            for out in await s.engine.outputs():
                assert out.seq_id != long[0], "output after the cancelled sequence ended"
                if out.finish_reason is not None:
                    finished[out.seq_id] = out
    assert finished["short"].finish_reason is FinishReason.LENGTH
    assert finished["short"].completion_tokens == 5
    assert not set(long[1:]) & set(finished), "the other long sequences still run"
    for seq_id in long[1:]:
        s.engine.abort(seq_id)
        assert (await wait_for(s, seq_id)).finish_reason is FinishReason.CANCELLED
    s.engine.abort("unknown-id")  # ignored
    async with asyncio.timeout(10):
        while s.engine.stats().running:
            await asyncio.sleep(0.05)


async def resume_parity(s: Subject) -> None:
    """A sequence resumed from prompt + k streamed tokens continues an unbroken run exactly."""
    tok = s.engine.tokenizer
    prompt = tok.encode("Once upon a time")
    params = greedy(30)
    full = await run_one(s, "full", prompt, params)
    assert len(full.token_ids) == 30
    for k in (1, 11, 29):
        s.engine.add(EngineRequest(f"r{k}", prompt, params, resume_token_ids=full.token_ids[:k]))
        r = (await collect(s.engine, 1, s.timeout))[f"r{k}"]
        assert full.token_ids[:k] + r.token_ids == full.token_ids, f"k={k}"
        assert streamed_text(s, prompt, params, full.token_ids[:k]) + r.text == full.text
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
        assert r.finish.completion_tokens == 30
        assert r.finish.prompt_tokens == len(prompt)


async def preempt_then_resume(s: Subject) -> None:
    """A preemption as the worker does it on any engine: abort a running sequence, keeping
    the tokens it produced up to its end (the CANCELLED output may carry a last step's), then
    add it again from prompt + those tokens: together they are the unbroken run, once each."""
    tok = s.engine.tokenizer
    prompt = tok.encode("Preempted in the middle")
    s.engine.add(EngineRequest("victim", prompt, greedy(s.long_tokens)))
    kept: list[int] = []
    async with asyncio.timeout(s.timeout):
        while len(kept) < 5:
            for out in await s.engine.outputs():
                if out.seq_id == "victim":
                    kept += out.token_ids
    s.engine.abort("victim")
    async with asyncio.timeout(s.timeout):
        ended = False
        while not ended:
            for out in await s.engine.outputs():
                if out.seq_id == "victim":
                    kept += out.token_ids
                    ended = out.finish_reason is not None
                    if ended:
                        assert out.finish_reason is FinishReason.CANCELLED
    n = len(kept) + 20
    s.engine.add(EngineRequest("victim", prompt, greedy(n), resume_token_ids=tuple(kept)))
    rest = (await collect(s.engine, 1, s.timeout))["victim"]
    assert kept + rest.token_ids == await s.reference(prompt, n)
    assert rest.finish is not None and rest.finish.completion_tokens == n


async def resume_already_complete(s: Subject) -> None:
    """Resumed tokens that already reach max_tokens finish at once, with nothing new."""
    tok = s.engine.tokenizer
    prompt = tok.encode("hello")
    full = await run_one(s, "done-full", prompt, greedy(4))
    s.engine.add(EngineRequest("done-again", prompt, greedy(4), resume_token_ids=full.token_ids))
    r = (await collect(s.engine, 1, s.timeout))["done-again"]
    assert r.token_ids == []
    assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
    assert r.finish.completion_tokens == 4


async def refusals(s: Subject) -> None:
    """What the model cannot take raises InvalidRequest in add(), and the engine goes on."""
    tok = s.engine.tokenizer
    limit = tok.max_model_len
    prompt = tok.encode("hello")
    with pytest.raises(InvalidRequest) as exc:
        s.engine.add(EngineRequest("too-long", [prompt[0]] * limit, greedy(1)))
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest):
        s.engine.add(EngineRequest("too-much", prompt, greedy(limit)))
    with pytest.raises(InvalidRequest):
        s.engine.add(EngineRequest("empty", [], greedy(4)))
    with pytest.raises(InvalidRequest):
        s.engine.add(EngineRequest("no-tokens", prompt, greedy(0)))
    with pytest.raises(InvalidRequest):
        s.engine.add(
            EngineRequest("negative", prompt, SamplingParams(max_tokens=4, temperature=-1.0))
        )
    r = await run_one(s, "after", prompt, greedy(3))
    assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH


def _spanning_stop(full: Result, tok_decode: Callable[[list[int]], str]) -> tuple[str, int]:
    """A 3-character stop string of the text and a token count k that ends inside it."""
    text = full.text
    for start in range(8, len(text) - 3):
        stop = text[start : start + 3]
        if "\ufffd" in stop or text.find(stop) != start:
            continue
        for k in range(1, len(full.token_ids)):
            covered = len(tok_decode(full.token_ids[:k]).rstrip("\ufffd"))
            if start < covered < start + len(stop):
                return stop, k
    raise AssertionError("no stop string spans a token boundary in this text")


async def stop_strings(s: Subject) -> None:
    """A stop string ends the sequence, is not emitted, and is found across a resume point."""
    tok = s.engine.tokenizer
    prompt = tok.encode("def add(a, b):")
    full = await run_one(s, "stop-full", prompt, greedy(40))
    stop, k = _spanning_stop(full, tok.decode)
    expected = full.text[: full.text.find(stop)]
    params = greedy(40, stop=(stop, "never-appears"))
    r = await run_one(s, "stopped", prompt, params)
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    assert r.text == expected
    assert r.finish.completion_tokens < 40
    # The first attempt stopped streaming inside the stop string; the resumed one completes it.
    s.engine.add(EngineRequest("stop-resumed", prompt, params, resume_token_ids=full.token_ids[:k]))
    r2 = (await collect(s.engine, 1, s.timeout))["stop-resumed"]
    assert r2.finish is not None and r2.finish.finish_reason is FinishReason.STOP
    assert streamed_text(s, prompt, params, full.token_ids[:k]) + r2.text == expected


async def seeds(s: Subject) -> None:
    """Sampling with a seed is reproducible, and another seed samples differently."""
    prompt = s.engine.tokenizer.encode("The queue holds")
    res = {}
    for group in ([(0, 1), (1, 1)], [(2, 2)]):  # engines run what fits: two at a time
        for i, seed in group:
            params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed)
            s.engine.add(EngineRequest(f"seed{i}", prompt, params))
        res.update(await collect(s.engine, len(group), s.timeout))
    assert res["seed0"].token_ids == res["seed1"].token_ids
    assert res["seed0"].token_ids != res["seed2"].token_ids
    assert all(len(r.token_ids) == r.finish.completion_tokens for r in res.values() if r.finish)


CASES = [
    greedy_parity,
    cancel_frees_capacity,
    resume_parity,
    preempt_then_resume,
    resume_already_complete,
    refusals,
    stop_strings,
    seeds,
]
CASE_IDS = [c.__name__ for c in CASES]
