"""The Stepper on hand-made plans: a prefill step (one chunk sampled, one
chunk of a longer prompt not), a mixed step, then pure decodes, checked
token by token against transformers; the stepper changes no request state;
a repeated decode signature reuses the last step's inputs on the device and
gives what the host path gives."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from rollout.engine.plan import ScheduledChunk, StepPlan, StepResult
from rollout.engine.sequence import Request, Sequence
from tests.conftest import make_engine
from tests.factories import hf_logprobs
from workspace import DecodeCacheMismatch

PROMPT_A = [3, 14, 15, 92, 65, 35, 8, 9, 7, 9, 32, 38, 46, 26, 43, 38, 32, 79]  # 18 tokens: spans two pages
PROMPT_B = [2, 71, 82, 81, 82, 8, 45, 90, 45]
DECODE_STEPS = 5


def make_sequence(seq_id: int, prompt: list[int], pages: list[int]) -> Sequence:
    """A greedy sample whose KV goes to `pages` (the test plays the scheduler)."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    request = Request(seq_id, list(prompt), params, seed=0, max_tokens=32, stop_token_ids=frozenset())
    seq = Sequence(seq_id, request, 0, list(prompt), block_table=list(pages))
    request.samples = [seq]
    return seq


def chunk(seq: Sequence, length: int, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(seq, seq.num_computed_tokens, length, [seq] if sample else [])


def plans(a: Sequence, b: Sequence, version: int):
    """The steps of the scenario, each made from the sequences' state when it is due."""
    yield StepPlan([chunk(a, len(PROMPT_A)), chunk(b, 3, sample=False)], [], version)
    yield StepPlan([chunk(b, len(PROMPT_B) - 3), chunk(a, 1)], [], version)  # prefills first, as scheduled
    for _ in range(DECODE_STEPS):
        yield StepPlan([chunk(a, 1), chunk(b, 1)], [], version)


def request_state(seqs: list[Sequence]) -> list[tuple]:
    return [
        (
            s.status,
            s.num_computed_tokens,
            list(s.token_ids),
            list(s.block_table),
            list(s.logprobs),
            list(s.versions),
            s.finish_reason,
            s.cacheable,
            s.request.started,
            s.request.leader,
        )
        for s in seqs
    ]


def apply(plan: StepPlan, result: StepResult) -> None:
    """What the scheduler's update does to these sequences."""
    for c in plan.chunks:
        c.seq.num_computed_tokens += c.length
    for s, token, logprob in zip(plan.samplers, result.tokens, result.logprobs, strict=True):
        s.append(token, logprob, result.version)


def run(engine, host_path: bool = False) -> tuple[list[StepPlan], list[StepResult], list[list[int]]]:
    """Every step of the scenario on `engine`'s stepper; with `host_path`, the
    decode cache is forgotten before each step, so every input comes from the host."""
    a = make_sequence(1000, PROMPT_A, pages=[0, 1, 2])
    b = make_sequence(1001, PROMPT_B, pages=[5, 4])  # pages in any order
    done, results, contexts = [], [], []
    for plan in plans(a, b, engine.policy_version):
        if host_path:
            engine.stepper.cache.invalidate()
        before = request_state([a, b])
        contexts.append([list(s.token_ids) for s in plan.samplers])
        result = engine.stepper.step(plan)
        assert request_state([a, b]) == before  # the stepper reads the plan, never writes it
        assert result.version == plan.version and len(result.tokens) == len(plan.samplers)
        apply(plan, result)
        done.append(plan)
        results.append(result)
    return done, results, contexts


def reference_next(hf, ids: list[int]) -> tuple[int, float]:
    """Greedy next token of transformers and its raw logprob (float64)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].double()
    token = int(logits.argmax())
    return token, hf_logprobs(hf, ids, [token])[0].item()


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_steps_match_transformers_and_leave_request_state_alone(qwen2, kernels):
    engine = make_engine(qwen2.path, kernels=kernels)
    plans_run, results, contexts = run(engine)
    assert [len(r.tokens) for r in results] == [1, 2] + [2] * DECODE_STEPS
    for step, (result, step_contexts) in enumerate(zip(results, contexts, strict=True)):
        for ids, token, logprob in zip(step_contexts, result.tokens, result.logprobs, strict=True):
            expected_token, expected_logprob = reference_next(qwen2.hf, ids)
            assert token == expected_token, f"step {step}"
            assert abs(logprob - expected_logprob) < 1e-4, f"step {step}"


def test_a_repeated_decode_signature_reuses_inputs_and_matches_the_host_path(qwen2):
    fast = make_engine(qwen2.path, debug_decode_cache=True)  # each hit also checks its inputs against the host's
    host = make_engine(qwen2.path)
    _, fast_results, _ = run(fast)
    _, host_results, _ = run(host, host_path=True)
    # Steps 0-1 hold prefill chunks, step 2 is the first pure decode: every later one is a hit.
    assert (fast.decode_cache.hits, fast.decode_cache.misses) == (DECODE_STEPS - 1, 1)
    assert (host.decode_cache.hits, host.decode_cache.misses) == (0, DECODE_STEPS)
    assert [r.tokens for r in fast_results] == [r.tokens for r in host_results]
    assert [r.logprobs for r in fast_results] == [r.logprobs for r in host_results]


def test_debug_mode_catches_a_block_table_row_the_record_does_not_know(qwen2):
    engine = make_engine(qwen2.path, debug_decode_cache=True)
    a = make_sequence(1000, PROMPT_A, pages=[0, 1, 2])
    b = make_sequence(1001, PROMPT_B, pages=[5, 4])
    steps = plans(a, b, engine.policy_version)
    for _ in range(3):  # the prefill, the mixed step, the first pure decode
        plan = next(steps)
        apply(plan, engine.stepper.step(plan))
    assert engine.workspace.buffer("block_tables")[1, 0].item() == 5
    engine.workspace.buffer("block_tables")[1, 0] = 4  # behind the persistent rows' back
    with pytest.raises(DecodeCacheMismatch, match="attention metadata"):
        engine.stepper.step(next(steps))
