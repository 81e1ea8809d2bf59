"""`TrainerBridge.collect` with over-sampling (`min_groups`, `leftover`) and
dynamic sampling (`keep_group`, `refill`), on an in-process engine: the batch
holds exactly the groups asked for, each complete and named by its prompt;
what was aborted, carried, dropped and refilled is counted; aborted groups'
KV is freed; carried groups arrive in the next batch with the settings they
were sampled with; a collect that times out leaves every group to the retry."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import make_engine
from tests.reference import processed_logprobs
from trainer_bridge import TrainerBridge, token_logprobs

PARAMS = SamplingParams(n=2, max_tokens=40, stop_token_ids=[7, 8, 9], seed=1)  # lengths vary: a long tail
PROMPTS = [[10 + i, 20, 30 + i] for i in range(8)]


def _wait_free(engine) -> None:
    deadline = time.monotonic() + 30
    while engine.stats()["kv_pages_used"]:
        assert time.monotonic() < deadline, "aborted groups kept their KV"
        time.sleep(0.02)


def _assert_groups(batch, prompts) -> None:
    """Each batch group is one whole submitted group, named by its prompt."""
    assert len(batch.prompts) == len(set(map(tuple, batch.prompts))) == batch.group_index.max().item() + 1
    for g, prompt in enumerate(batch.prompts):
        rows = (batch.group_index == g).nonzero().flatten().tolist()
        assert len(rows) == PARAMS.n and prompt in prompts
        for r in rows:
            ids = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
            assert ids == prompt
            assert batch.finish_reasons[r] in ("stop", "length")


def test_over_sampling_takes_the_first_groups_and_aborts_the_rest(qwen2):
    engine = make_engine(qwen2.path)
    bridge = TrainerBridge(engine)
    batch = bridge.collect(bridge.submit(PROMPTS, PARAMS), timeout=60, min_groups=5)
    _assert_groups(batch, PROMPTS)
    assert len(batch.prompts) == 5
    assert batch.collect_stats["aborted_groups"] == 3 and batch.collect_stats["carried_groups"] == 0
    _wait_free(engine)


def test_leftover_keep_carries_groups_into_the_next_batch(qwen2):
    engine = make_engine(qwen2.path)
    bridge = TrainerBridge(engine, max_staleness=0)
    first = bridge.collect(bridge.submit(PROMPTS, PARAMS), timeout=60, min_groups=5, leftover="keep")
    assert first.collect_stats["carried_groups"] == 3
    fresh = [[50 + i, 20, 30] for i in range(4)]
    second = bridge.collect(bridge.submit(fresh, PARAMS), timeout=60, min_groups=7, leftover="abort")
    _assert_groups(second, PROMPTS + fresh)
    carried = [p for p in second.prompts if p in PROMPTS]
    assert len(carried) == 3 and not set(map(tuple, carried)) & set(map(tuple, first.prompts))
    _wait_free(engine)


class HoldAfterFirstFinish:
    """A step callback that holds the engine at the step after the first sequence
    finished (its output is out by then) until `release` is set."""

    def __init__(self, sequences: int) -> None:
        self.sequences, self.finished = sequences, False
        self.holding, self.release = threading.Event(), threading.Event()

    def __call__(self, info) -> None:
        if self.finished and not self.holding.is_set():
            self.holding.set()
            assert self.release.wait(60), "the test never released the engine"
        self.finished |= info.num_waiting == 0 and info.num_running < self.sequences


def test_a_timed_out_collect_loses_no_group(qwen2):
    """The engine holds with some groups finished; a collect for all of them times
    out; the retry returns every group, those the first one had read included."""
    hold = HoldAfterFirstFinish(len(PROMPTS))
    bridge = TrainerBridge(make_engine(qwen2.path, step_callback=hold))
    pending = bridge.submit(PROMPTS, SamplingParams(n=1, max_tokens=40, stop_token_ids=[7, 8, 9], seed=1))
    assert hold.holding.wait(60)
    with pytest.raises(TimeoutError):
        bridge.collect(pending, timeout=0.4, min_groups=len(PROMPTS))
    hold.release.set()
    batch = bridge.collect(pending, timeout=60, min_groups=len(PROMPTS))
    assert sorted(batch.prompts) == sorted(PROMPTS) and len(batch) == len(PROMPTS)


def _reference_logprobs(model, batch, row: int, settings: list[SamplingParams]) -> list[torch.Tensor]:
    """float64 processed logprobs of one row's response tokens, under each of `settings`."""
    prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
    response = batch.response_ids[row][batch.response_mask[row].bool()]
    with torch.no_grad():
        logits = model(torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1 : -1]
    tokens = response.tolist()
    return [
        torch.stack(
            [
                processed_logprobs(logits[t], p.temperature, p.top_k, p.top_p, p.min_p)[tok]
                for t, tok in enumerate(tokens)
            ]
        )
        for p in settings
    ]


def test_carried_groups_keep_the_settings_they_were_sampled_with(qwen2):
    """Step 1 samples at temperature 0.6, top-k 50 and carries 5 groups; step 2 samples
    at 1.0: the carried rows keep 0.6 and 50, so the trainer's recompute matches the
    engine's logprobs on every row, and a float64 recompute under each row's settings."""
    bridge = TrainerBridge(make_engine(qwen2.path))
    cool = SamplingParams(n=2, max_tokens=24, stop_token_ids=[7, 8, 9], seed=1, temperature=0.6, top_k=50)
    hot = SamplingParams(n=2, max_tokens=24, stop_token_ids=[7, 8, 9], seed=2, temperature=1.0)
    first = bridge.collect(bridge.submit(PROMPTS, cool), timeout=60, min_groups=3, leftover="keep")
    fresh = [[50 + i, 20, 30] for i in range(4)]
    batch = bridge.collect(bridge.submit(fresh, hot), timeout=60, min_groups=9, leftover="abort")
    carried = [g for g, p in enumerate(batch.prompts) if p in PROMPTS]
    assert len(carried) == 5 and not {tuple(p) for p in first.prompts} & {tuple(batch.prompts[g]) for g in carried}
    rows = torch.isin(batch.group_index, torch.tensor(carried))
    assert batch.temperature[rows].tolist() == pytest.approx([0.6] * 10) and (batch.top_k[rows] == 50).all()
    assert batch.temperature[~rows].tolist() == pytest.approx([1.0] * 8) and (batch.top_k[~rows] == 0).all()
    recomputed = token_logprobs(qwen2.hf, batch)
    mask = batch.response_mask.bool()
    assert (recomputed - batch.old_logprobs)[mask].abs().max() < 1e-4  # same weights: float32 rounding only
    model = copy.deepcopy(qwen2.hf).double()
    for row in rows.nonzero().flatten().tolist():
        engine = batch.old_logprobs[row][mask[row]].double()
        as_sampled, as_step_2 = _reference_logprobs(model, batch, row, [cool, hot])
        assert (as_sampled - engine).abs().max() < 1e-4
        assert (as_step_2 - engine).abs().mean() > 0.05  # the settings matter: step 2's are far off


def test_dynamic_sampling_drops_rejected_groups_and_refills(qwen2):
    engine = make_engine(qwen2.path)
    bridge = TrainerBridge(engine)
    seen = []

    def keep(output, prompt) -> bool:  # a stand-in for "rewards not all equal": even first tokens only
        seen.append(prompt)
        return prompt[0] % 2 == 0

    asked = []

    def refill(n: int) -> list:
        asked.append(n)
        return [[60 + 2 * i, 20, 30] for i in range(n)]

    batch = bridge.collect(bridge.submit(PROMPTS, PARAMS), timeout=60, min_groups=6, keep_group=keep, refill=refill)
    _assert_groups(batch, PROMPTS + [[60 + 2 * i, 20, 30] for i in range(8)])
    assert all(p[0] % 2 == 0 for p in batch.prompts) and len(batch.prompts) == 6
    stats = batch.collect_stats
    assert stats["dropped_groups"] == 4  # the 4 odd prompts of PROMPTS
    assert asked == [2] and stats["refill_prompts"] == 2  # 4 even ones passed; 2 more were asked for
    assert len(seen) == 8 + 2


def test_bad_collect_arguments(qwen2):
    engine = make_engine(qwen2.path)
    bridge = TrainerBridge(engine)
    pending = bridge.submit(PROMPTS[:2], PARAMS)
    with pytest.raises(ValueError, match="leftover"):
        bridge.collect(pending, min_groups=1, leftover="later")
    with pytest.raises(ValueError, match="min_groups"):
        bridge.collect(pending, min_groups=0)
    with pytest.raises(ValueError, match="no prompt group passed"):
        bridge.collect(pending, keep_group=lambda out, prompt: False)
