"""`Engine.run_episodes`: environments (plain and async) drive multi-turn
sessions concurrently; episodes equal the same seeded turns run by hand;
finish reasons; environment errors end the run with every session closed;
bad arguments raise before anything runs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout import SamplingParams
from rollout.episodes import Episode
from tests.conftest import make_engine

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, seed=3, logprobs_mode="raw")


class CountingEnv:
    """Answers each turn with `[k, turn]`; reward = number of sampled tokens
    that are even; done after `turns` turns."""

    def __init__(self, k: int, turns: int = 3, barrier: threading.Barrier | None = None) -> None:
        self.k, self.turns, self.turn, self.barrier = k, turns, 0, barrier

    def reset(self):
        return [3 + self.k, 4, 5, 6]

    def step(self, sample):
        if self.barrier is not None:
            self.barrier.wait()  # every episode's step runs at once, or this times out
        self.turn += 1
        reward = sum(t % 2 == 0 for t in sample.token_ids)
        return [self.k % 90, self.turn], reward, self.turn >= self.turns


class AsyncEnv(CountingEnv):
    def __init__(self, k: int, gate: dict) -> None:
        super().__init__(k)
        self.gate = gate

    async def reset(self):
        return super().reset()

    async def step(self, sample):
        self.gate["waiting"] += 1
        if self.gate["waiting"] == self.gate["n"]:
            self.gate["all_in"].set()
        await asyncio.wait_for(self.gate["all_in"].wait(), 30)  # every episode's step is in flight at once
        return super().step(sample)


def by_hand(engine, k: int, turns: int = 3) -> tuple[list[int], list[float]]:
    env = CountingEnv(k, turns)
    rewards = []
    with engine.session(env.reset()) as sess:
        while True:
            obs, reward, done = env.step(sess.generate(PARAMS))
            rewards.append(reward)
            if done:
                return sess, rewards
            sess.append(obs)


def test_episodes_equal_the_same_turns_run_by_hand_and_run_concurrently(qwen2):
    engine = make_engine(qwen2.path)
    barrier = threading.Barrier(6, timeout=60)
    episodes = engine.run_episodes([CountingEnv(k, barrier=barrier) for k in range(6)], PARAMS, max_turns=5)
    assert all(isinstance(e, Episode) for e in episodes)
    for k, ep in enumerate(episodes):
        sess, rewards = by_hand(engine, k)
        assert ep.token_ids == sess.token_ids and ep.loss_mask == sess.loss_mask
        assert ep.logprobs == pytest.approx(sess.logprobs, abs=1e-5) and ep.versions == sess.versions
        assert ep.rewards == rewards and ep.reward == sum(rewards)
        assert ep.num_turns == 3 and ep.finish_reason == "done" and ep.prompt_len == 4
        assert ep.token_ids[:4] == [3 + k, 4, 5, 6]
    assert engine.stats()["kv_pages_used"] == 0  # every session closed


def test_async_environments(qwen2):
    engine = make_engine(qwen2.path)

    async def main():
        gate = {"waiting": 0, "n": 4, "all_in": asyncio.Event()}
        return await engine.run_episodes_async([AsyncEnv(k, gate) for k in range(4)], PARAMS, max_turns=5)

    episodes = asyncio.run(main())
    for k, ep in enumerate(episodes):
        sess, rewards = by_hand(engine, k)
        assert ep.token_ids == sess.token_ids and ep.rewards == rewards


def test_params_per_turn_the_last_repeating(qwen2):
    engine = make_engine(qwen2.path)
    turns = [SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)]
    (ep,) = engine.run_episodes([CountingEnv(0, turns=4)], turns, max_turns=4)
    assert [len(s.token_ids) for s in ep.samples] == [1, 3, 3, 3]


def test_max_turns_and_a_full_context_end_episodes(qwen2):
    engine = make_engine(qwen2.path, max_seq_len=24)
    (ep,) = engine.run_episodes([CountingEnv(0, turns=100)], PARAMS, max_turns=2)
    assert ep.finish_reason == "max_turns" and ep.num_turns == 2
    (ep,) = engine.run_episodes([CountingEnv(0, turns=100)], PARAMS, max_turns=50)
    assert ep.finish_reason == "length" and len(ep.token_ids) <= 24
    assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs) == len(ep.versions)


class FailingEnv(CountingEnv):
    def step(self, sample):
        if self.k == 2:
            raise RuntimeError("tool crashed")
        return super().step(sample)


def test_an_environment_error_ends_the_run_and_closes_every_session(qwen2):
    engine = make_engine(qwen2.path)
    with pytest.raises(RuntimeError, match="tool crashed"):
        engine.run_episodes([FailingEnv(k) for k in range(4)], PARAMS, max_turns=5)
    deadline = threading.Event()
    for _ in range(100):  # cancelled episodes close their sessions as their turns end
        if engine.stats()["kv_pages_used"] == 0:
            break
        deadline.wait(0.1)
    assert engine.stats()["kv_pages_used"] == 0


class BadStepEnv(CountingEnv):
    def step(self, sample):
        return [1], 0.0  # two values, not three


def test_bad_arguments_raise_before_anything_runs(qwen2):
    engine = make_engine(qwen2.path)
    with pytest.raises(ValueError, match="n must be 1"):
        engine.run_episodes([CountingEnv(0)], SamplingParams(n=2))
    with pytest.raises(ValueError, match=r"params\[1\].n must be 1"):
        engine.run_episodes([CountingEnv(0)], [PARAMS, SamplingParams(n=2)])
    with pytest.raises(TypeError, match=r"params\[0\] must be a SamplingParams"):
        engine.run_episodes([CountingEnv(0)], [{"max_tokens": 3}])
    with pytest.raises(ValueError, match="max_turns"):
        engine.run_episodes([CountingEnv(0)], PARAMS, max_turns=0)
    with pytest.raises(TypeError, match=r"envs\[1\] has no reset"):
        engine.run_episodes([CountingEnv(0), object()], PARAMS)
    with pytest.raises(TypeError, match="envs must be a list"):
        engine.run_episodes(CountingEnv(0), PARAMS)
    with pytest.raises(TypeError, match="observation | None, reward, done"):
        engine.run_episodes([BadStepEnv(0)], PARAMS)
    assert engine.stats()["computed_tokens"] > 0 and engine.stats()["kv_pages_used"] == 0
