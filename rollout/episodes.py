"""Environments and episodes: many multi-turn episodes run concurrently over
sessions (`rollout.engine.session`), on an `Engine` or a `RolloutCluster`.

An environment is shaped after gymnasium's, with text in and text out:

    class Env:
        def reset(self) -> prompt                       # token ids, a string or chat messages
        def step(self, sample) -> (observation | None, reward, done)

`reset` and `step` may be plain or `async` methods. `step` gets the turn's
`Sample` (token ids, logprobs, versions, finish_reason, text) and answers
with what the model sees next (appended as `Session.append` takes it: token
ids, a string, or chat messages), the turn's reward, and whether the episode
is over. Episodes run as asyncio tasks: while one waits on a slow tool, the
others' turns keep the engine's batch full. A plain `reset` or `step` runs on
a thread of its own (one per episode, up to MAX_ENV_THREADS), so a blocking
environment never stalls the others.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .checks import check_int, is_number
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from .engine.session import Session

EPISODE_ENDS = ("done", "max_turns", "length")
MAX_ENV_THREADS = 1024  # threads for plain (blocking) environment methods, per run


@dataclass(slots=True)
class Episode:
    """One finished episode: the session's trajectory and the environment's rewards."""

    token_ids: list[int]  # prompt, sampled turns and observations
    loss_mask: list[int]  # 1 exactly where the model sampled
    logprobs: list[float]  # sampled tokens' logprobs, 0.0 elsewhere
    versions: list[int]  # policy version per sampled token, -1 elsewhere
    rewards: list[float]  # one per turn, as `step` returned them
    num_turns: int
    finish_reason: str  # EPISODE_ENDS: the environment said done, max_turns ran out, or the context is full
    prompt_len: int = 0  # tokens of the first prompt
    samples: list = field(default_factory=list)  # every turn's Sample
    # Mixture-of-experts turns with return_routed_experts: `Session.routed_experts` at the end, the
    # experts of every position up to the last turn's final token; None when the last turn did not ask.
    routed_experts: np.ndarray | None = None

    @property
    def reward(self) -> float:
        """The episode's return: the sum of its turns' rewards."""
        return float(sum(self.rewards))


def run_episodes(
    open_session: Callable[[object], Session],
    envs: Sequence,
    params: SamplingParams | list[SamplingParams] | None,
    max_turns: int,
) -> list[Episode]:
    """Run one episode per environment, all at once; episodes in `envs` order.
    `params`: the turns' sampling settings, or a list of them, one per turn
    (the last one repeats).
    From inside a running event loop, await `run_episodes_async` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_episodes_async(open_session, envs, params, max_turns))
    raise RuntimeError("run_episodes called inside a running event loop; await run_episodes_async(...) there")


async def run_episodes_async(
    open_session: Callable[[object], Session],
    envs: Sequence,
    params: SamplingParams | list[SamplingParams] | None,
    max_turns: int,
) -> list[Episode]:
    """`run_episodes` for asyncio code. The first environment error cancels the
    other episodes (their sessions are closed) and is raised."""
    params = check_episode_args(envs, params, max_turns)
    # Plain environment methods run here, one thread per episode at most: a
    # blocking tool call never waits for another episode's to end.
    threads = ThreadPoolExecutor(max(1, min(len(envs), MAX_ENV_THREADS)), "rollout-env")
    call = functools.partial(_call, threads)
    tasks = [asyncio.ensure_future(_episode(open_session, call, env, params, max_turns)) for env in envs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        threads.shutdown(wait=False)


def check_episode_args(envs, params, max_turns: int) -> list[SamplingParams]:
    """Raise `TypeError`/`ValueError` naming the first bad argument; returns the per-turn params."""
    turns = _per_turn(params)
    _check(envs, max_turns)
    return turns


def _per_turn(params) -> list[SamplingParams]:
    """`params` as a non-empty list, one per turn (the last one repeats), each with n == 1."""
    if params is None:
        return [SamplingParams()]
    turns = list(params) if isinstance(params, (list, tuple)) else [params]
    if not turns:
        raise ValueError("params is an empty list: give a SamplingParams, or one per turn")
    for i, p in enumerate(turns):
        name = "params" if len(turns) == 1 and not isinstance(params, (list, tuple)) else f"params[{i}]"
        if not isinstance(p, SamplingParams):
            raise TypeError(f"{name} must be a SamplingParams, got {type(p).__name__}")
        if p.n != 1:
            raise ValueError(f"an episode samples one continuation per turn: {name}.n must be 1, got {p.n}")
    return turns


def _check(envs, max_turns: int) -> None:
    check_int("max_turns", max_turns, 1)
    if isinstance(envs, (str, bytes)) or not isinstance(envs, Sequence):
        raise TypeError(f"envs must be a list of environments, got {type(envs).__name__}")
    for i, env in enumerate(envs):
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(f"envs[{i}] has no {method}() method: an environment needs reset() and step(sample)")


async def _call(threads: ThreadPoolExecutor, fn, *args):
    """Await an async method; run a plain one on a thread, so it never blocks the loop."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.get_running_loop().run_in_executor(threads, fn, *args)
    return await result if inspect.isawaitable(result) else result


async def _episode(open_session, call, env, params: list[SamplingParams], max_turns: int) -> Episode:
    prompt = await call(env.reset)
    sess = open_session(prompt)
    rewards: list[float] = []
    prompt_len = len(sess.token_ids)
    reason = "max_turns"
    try:
        for turn in range(max_turns):
            if len(sess.token_ids) >= sess.max_seq_len:
                reason = "length"
                break
            sample = await sess.generate_async(params[min(turn, len(params) - 1)])
            observation, reward, done = _step_result(await call(env.step, sample))
            rewards.append(reward)
            if done:
                reason = "done"
                break
            if observation is not None and not _appended(sess, observation):
                reason = "length"
                break
    finally:
        sess.close()
    return Episode(
        sess.token_ids,
        sess.loss_mask,
        sess.logprobs,
        sess.versions,
        rewards,
        sess.num_turns,
        reason,
        prompt_len,
        list(sess.samples),
        sess.routed_experts,
    )


def _appended(sess: Session, observation) -> bool:
    """Append the observation; False when it does not fit in the context (the episode ends)."""
    ids = sess.observation_ids(observation)
    if len(sess.token_ids) + len(ids) >= sess.max_seq_len:
        return False
    sess.append(ids)
    return True


def _step_result(result) -> tuple[object, float, bool]:
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"env.step must return (observation | None, reward, done), got {result!r}")
    observation, reward, done = result
    if not is_number(reward):
        raise TypeError(f"env.step returned reward {reward!r}: a number is needed")
    return observation, float(reward), bool(done)
