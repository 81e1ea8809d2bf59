"""`TrainerBridge`: what a trainer holds. It pushes the training model's
weights, turns rollouts into padded training batches, and enforces the
staleness bound, over an in-process `Engine` or a `RolloutCluster`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import torch
from torch import nn

from rollout import Engine, RolloutCluster, RolloutOutput, SamplingParams, generation_pause
from rollout.checks import check_int
from rollout.engine.weight_delta import PushCost
from rollout.episodes import Episode, check_episode_args

from .alarm import MismatchAlarm
from .batch import RolloutBatch
from .carry import Carry
from .corrections import correction_weights
from .distill import teacher_logprobs
from .group_collector import EngineRun, GroupCollector, GroupSource
from .logprobs import token_logprobs
from .pushing import WeightPusher, push_metrics, state_to_push
from .staleness import StalenessPolicy


class PendingRollout:
    """Rollouts started by `TrainerBridge.submit`; hand it to `collect`."""

    def __init__(self, prompts, params: SamplingParams, source, started: float) -> None:
        self.prompts = prompts
        self.params = params
        self.source = source  # a GenerationHandle or an EngineRun: outputs as they finish, abort
        self._wait = source.result  # timeout -> list[RolloutOutput]
        self.started = started

    def result(self, timeout: float | None = None) -> list[RolloutOutput]:
        return self._wait(timeout)


LEFTOVERS = ("abort", "keep")


class PendingEpisodes:
    """Episodes started by `TrainerBridge.submit_episodes`; hand it to `collect`."""

    def __init__(self, envs, params: SamplingParams, wait, started: float, group_size: int) -> None:
        self.envs = envs
        self.params = params
        self._wait = wait  # timeout -> list[Episode]
        self.started = started
        self.group_size = group_size

    def result(self, timeout: float | None = None) -> list[Episode]:
        return self._wait(timeout)


class TrainerBridge:
    """Connects a trainer to rollout engines.

    `target`: a `RolloutCluster` (or the one `rollout.init` returned) or an
    in-process `Engine`. `max_staleness=k`: samples with a token older than
    `policy_version - k` are regenerated (`stale="regenerate"`) or their
    group dropped (`stale="drop"`). `teacher` (an `Engine` or a cluster of a
    teacher checkpoint with the same tokenizer): every collected batch is
    scored by it (`batch.teacher_logprobs`, with `teacher_top_logprobs`
    alternatives; `distill.py`) for on-policy distillation.
    """

    def __init__(
        self,
        target: RolloutCluster | Engine,
        max_staleness: int | None = None,
        stale: str = "regenerate",
        pad_token_id: int = 0,
        metrics=None,
        alarm: MismatchAlarm | None = None,
        teacher: RolloutCluster | Engine | None = None,
        teacher_top_logprobs: int = 0,
    ) -> None:
        if not isinstance(target, (RolloutCluster, Engine)):
            raise TypeError(f"target must be a RolloutCluster or an Engine, got {type(target).__name__}")
        if teacher is not None and not isinstance(teacher, (RolloutCluster, Engine)):
            raise TypeError(f"teacher must be a RolloutCluster, an Engine or None, got {type(teacher).__name__}")
        self.teacher, self.teacher_top_logprobs = teacher, check_int("teacher_top_logprobs", teacher_top_logprobs, 0)
        self.target = target
        self.policy = StalenessPolicy(max_staleness, stale)
        self.pad_token_id = pad_token_id
        self.metrics = metrics
        self.alarm = MismatchAlarm() if alarm is None else alarm
        self.last_push_seconds: float | None = None
        self.last_push_pause: float | None = None  # longest step gap across the last push (with metrics)
        self._carry = Carry()  # what the last group collect left to the next one
        self._pusher = WeightPusher(target)

    @property
    def dtype(self) -> torch.dtype:
        return self.target.config.dtype if isinstance(self.target, Engine) else self.target.engine_dtype

    @property
    def policy_version(self) -> int:
        t = self.target
        return t.policy_version if isinstance(t, Engine) else t.policy_version()

    def push(
        self,
        model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
        version: int | None = None,
        inflight: str = "recompute",
        delta: bool | None = None,
    ) -> int:
        """Push the model's weights (wrapper prefixes stripped, cast to the
        engine's dtype); returns the new policy version. With `delta=True`
        only the elements whose cast value changed since the last push
        travel, in the smallest encoding per tensor; a copy of the pushed
        weights is kept for that (docs/weight_sync.md). `None` (the default)
        chooses deltas when some actor runs on another node than this
        process (the bytes cross a network) and whole pushes otherwise. A PEFT LoRA
        model pushes its adapters only; the engines merge them over the base
        weights they keep. `last_push` says what the push cost."""
        state = state_to_push(model_or_state_dict, self.dtype, self._pusher.weights_discarded)
        start, wall = time.perf_counter(), time.time()
        v = self._pusher.push(state, version, inflight, delta)
        self.last_push_seconds = time.perf_counter() - start
        if self.metrics is not None:  # the pause needs every engine's step log: an RPC per actor
            self.last_push_pause = generation_pause(self._step_logs(wall - 60.0), wall, time.time())
            self._log(
                {
                    "push/seconds": self.last_push_seconds,
                    "push/version": v,
                    "push/generation_pause_s": self.last_push_pause,
                    **push_metrics(self.last_push),
                }
            )
        return v

    @property
    def last_push(self) -> PushCost | None:
        """`.bytes_sent`, `.bytes_full`, `.seconds`, `.encoding` of the last push."""
        return self._pusher.last_push

    @property
    def reference_bytes(self) -> int:
        """Bytes of the copy of the pushed weights kept for delta pushes (0 before the first)."""
        return self._pusher.reference_bytes

    def _step_logs(self, since: float) -> list[list]:
        if isinstance(self.target, Engine):
            return [self.target.step_log(since)]
        return self.target.step_logs(since)

    def kv_usage(self) -> float:
        """Fraction of KV pages in use, over all engines."""
        if isinstance(self.target, Engine):
            stats = [self.target.stats()]
        else:
            stats = [h for h in self.target.health() if "kv_pages_total" in h]
        total = sum(s["kv_pages_total"] for s in stats)
        return sum(s["kv_pages_used"] for s in stats) / total if total else 0.0

    def generate(self, prompts, params: SamplingParams | None = None, timeout: float | None = None) -> RolloutBatch:
        """Rollouts as a training batch (staleness bound enforced)."""
        return self.collect(self.submit(prompts, params), timeout)

    def submit(self, prompts, params: SamplingParams | None = None) -> PendingRollout:
        """Start rollouts now and return at once (generation one step ahead of training)."""
        params = SamplingParams() if params is None else params
        started = time.perf_counter()
        if isinstance(self.target, RolloutCluster):
            return PendingRollout(prompts, params, self.target.submit(prompts, params), started)
        return PendingRollout(prompts, params, EngineRun(self.target, prompts, params), started)

    def submit_episodes(
        self, envs, params: SamplingParams | None = None, max_turns: int = 8, group_size: int = 1
    ) -> PendingEpisodes:
        """Start one multi-turn episode per environment (`run_episodes` on the
        engine or cluster) and return at once; `collect` batches them, one row
        per episode, episodes `[g * group_size, (g + 1) * group_size)` forming
        GRPO group g."""
        params = SamplingParams() if params is None else params
        check_episode_args(envs, params, max_turns)
        group_size = check_int("group_size", group_size, 1)
        if len(envs) % group_size:
            raise ValueError(f"group_size must divide the {len(envs)} environments, got {group_size}")
        wait = _in_thread(self.target.run_episodes, envs, params, max_turns)
        return PendingEpisodes(envs, params, wait, time.perf_counter(), group_size)

    def collect(
        self,
        pending: PendingRollout | PendingEpisodes,
        timeout: float | None = None,
        *,
        min_groups: int | None = None,
        leftover: str = "abort",
        keep_group: Callable[[RolloutOutput, object], bool] | None = None,
        refill: Callable[[int], list] | None = None,
        max_refills: int = 8,
    ) -> RolloutBatch:
        """Wait for `pending`, apply the staleness policy, and batch the result.

        Over-sampling: with `min_groups=k` the batch is the first k prompt
        groups to finish; the rest are aborted (`leftover="abort"`, their KV
        freed) or keep running into the next `collect` (`"keep"`), within the
        staleness bound. Dynamic sampling: `keep_group(output, prompt)` drops
        the groups it rejects (e.g. all-equal rewards); `refill(n)` gives more
        prompts when the submitted ones run out before k groups pass. The
        batch's `prompts` names each group's prompt, `collect_stats` what was
        dropped, aborted, carried and refilled. Every row keeps the settings
        its group was sampled with: a group carried from an earlier step keeps
        that step's `SamplingParams`, a refill takes `pending`'s.

        A group collect that raises (`TimeoutError` past `timeout`) loses
        nothing: the groups it had read wait, finished, for the next collect
        (retry with the same `pending`), which reads them first (staleness and
        `keep_group` checked again), and carried sources run on. Groups it
        found stale or rejected stay dropped. A source whose generation fails
        is the exception: the collect that reads its error raises it, and the
        source is aborted and never read again (not carried, not by a retry
        with the same `pending`); the groups already read from it and every
        other source are carried as after a timeout, and the groups it never
        delivered are lost with it (`rollout/lost_groups` in the metrics).
        """
        if isinstance(pending, PendingEpisodes):
            return self._teach(self._collect_episodes(pending, timeout))
        if min_groups is not None or keep_group is not None:
            batch = self._collect_groups(pending, timeout, min_groups, leftover, keep_group, refill, max_refills)
            return self._teach(batch)
        outputs = pending.result(timeout)
        self._carry.forget(pending.source)  # a timed-out group collect left it for a retry: delivered here
        submitted = len(outputs)
        for _ in range(self.policy.max_regenerations + 1):
            current = self.policy_version
            stale = self.policy.stale_groups(outputs, current)
            if not stale:
                break
            if self.policy.action == "drop":
                outputs = [o for i, o in enumerate(outputs) if i not in set(stale)]
                break
            outputs = self._regenerate(outputs, stale, pending.params)
        else:
            raise RuntimeError(
                f"rollouts still staler than max_staleness={self.policy.max_staleness} after "
                f"{self.policy.max_regenerations} regenerations; the policy moves faster than it samples"
            )
        if not outputs:
            raise ValueError(
                f"every prompt group was staler than max_staleness={self.policy.max_staleness} and was dropped"
            )
        batch = RolloutBatch.from_outputs(outputs, pending.params, current, self.pad_token_id)
        if self.metrics is not None:  # kv_usage asks every actor: only when someone listens
            self._log_batch(batch, pending, submitted - len(outputs))
        return self._teach(batch)

    def _teach(self, batch: RolloutBatch) -> RolloutBatch:
        """The teacher's logprobs of the batch's responses, when there is a teacher."""
        if self.teacher is None:
            return batch
        batch = teacher_logprobs(self.teacher, batch, self.teacher_top_logprobs)
        m = batch.response_mask.float()
        self._log({"distill/reverse_kl": float(((batch.old_logprobs - batch.teacher_logprobs) * m).sum() / m.sum())})
        return batch

    def _collect_groups(self, pending, timeout, min_groups, leftover, keep_group, refill, max_refills) -> RolloutBatch:
        if leftover not in LEFTOVERS:
            raise ValueError(f"leftover must be one of {LEFTOVERS}, got {leftover!r}")
        k = check_int("min_groups", len(pending.prompts) if min_groups is None else min_groups, 1)
        max_refills = check_int("max_refills", max_refills, 0)
        current, bound = self.policy_version, self.policy.max_staleness

        def is_stale(out: RolloutOutput) -> bool:
            return bound is not None and any(current - v > bound for s in out.samples for v in s.versions)

        def more(want: int) -> GroupSource:
            prompts = list(refill(want))
            return GroupSource(self.submit(prompts, pending.params).source, prompts, pending.params)

        collector = GroupCollector(k, keep_group, is_stale, more if refill is not None else None, max_refills)
        mine = GroupSource(pending.source, list(pending.prompts), pending.params)
        try:
            groups = collector.collect(self._carry.ready, self._carry.sources_with(mine), timeout)
        except BaseException:  # a retry finds everything where this collect found it
            self._carry.keep_all(collector)
            self._log_collect(collector.stats)  # what it dropped stays dropped
            raise
        waiting = self._carry.settle(collector, leftover)
        collector.stats["aborted_groups"] = waiting if leftover == "abort" else 0
        collector.stats["carried_groups"] = waiting if leftover == "keep" else 0
        self._log_collect(collector.stats)
        if not groups:
            raise ValueError(f"no prompt group passed after {collector.stats}; loosen keep_group or give refill")
        for g in groups:
            g.output.index = None  # groups are numbered in batch order
        outputs = [g.output for g in groups]
        batch = RolloutBatch.from_outputs(outputs, [g.params for g in groups], current, self.pad_token_id)
        batch.prompts, batch.collect_stats = [g.prompt for g in groups], dict(collector.stats)
        if self.metrics is not None:
            self._log_batch(batch, pending, collector.stats["dropped_groups"] + collector.stats["stale_groups"])
        return batch

    def abort_carried(self) -> int:
        """Abort every source a group collect left running for the next one
        (`leftover="keep"` or a timeout) and drop the finished groups it left
        unread, e.g. when training ends; returns how many groups that drops."""
        return self._carry.abort()

    def _log_collect(self, stats: dict) -> None:
        if self.metrics is not None:  # every collect's drops, one that raised included
            self._log({f"rollout/{name}": value for name, value in stats.items()})

    def _collect_episodes(self, pending: PendingEpisodes, timeout: float | None) -> RolloutBatch:
        """Episodes cannot be regenerated (their environments moved on): a group
        with a token staler than the bound is dropped, whatever `stale` says."""
        episodes = pending.result(timeout)
        current, k = self.policy_version, pending.group_size
        groups = [episodes[g : g + k] for g in range(0, len(episodes), k)]
        bound = self.policy.max_staleness
        kept = [
            g for g in groups if bound is None or all(current - v <= bound for e in g for v in e.versions if v >= 0)
        ]
        if not kept:
            raise ValueError(f"every episode group was staler than max_staleness={bound} and was dropped")
        batch = RolloutBatch.from_episodes([e for g in kept for e in g], pending.params, current, k, self.pad_token_id)
        if self.metrics is not None:
            self._log_batch(batch, pending, len(groups) - len(kept))
        return batch

    def token_logprobs(self, model: nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """`token_logprobs(model, batch)` (the trainer's recompute, differentiable),
        then the checks that catch sync bugs: the mismatch against the rollout
        logprobs and the k1/k2/k3 KL estimates are logged, and the alarm
        (`MismatchAlarm`) warns once or raises when the mismatch jumps."""
        trainer = token_logprobs(model, batch)
        _, stats = correction_weights(trainer.detach(), batch.old_logprobs.to(trainer.device), batch.response_mask)
        self._log(
            {
                "mismatch/mean_abs": batch.mismatch["mean_abs"],
                "mismatch/max_abs": batch.mismatch["max_abs"],
                **{name: stats[name] for name in ("kl/k1", "kl/k2", "kl/k3", "is/ratio_mean", "is/ratio_max")},
            }
        )
        self.alarm.check(batch.mismatch)
        return trainer

    def _log_batch(self, batch: RolloutBatch, pending: PendingRollout | PendingEpisodes, dropped: int) -> None:
        tokens = int(batch.response_mask.sum())
        elapsed = time.perf_counter() - pending.started
        lags = (batch.policy_version - batch.versions)[batch.response_mask.bool()]
        self._log(
            {
                "rollout/tokens": tokens,
                "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
                "rollout/staleness_max": batch.staleness["max"],
                "rollout/staleness_mean": batch.staleness["mean"],
                # Staleness histogram: the share of tokens k versions behind.
                **{f"rollout/staleness_{k}": float((lags == k).float().mean()) for k in lags.unique().tolist()},
                "rollout/dropped_groups": dropped,
                "rollout/kv_usage": self.kv_usage(),
            }
        )

    def _regenerate(self, outputs, stale: list[int], params: SamplingParams) -> list[RolloutOutput]:
        fresh = self.target.generate([outputs[i].prompt_token_ids for i in stale], params)
        outputs = list(outputs)
        for i, out in zip(stale, fresh, strict=True):
            out.index, out.prompt = outputs[i].index, outputs[i].prompt
            outputs[i] = out
        return outputs

    def _log(self, values: dict) -> None:
        if self.metrics is not None:
            self.metrics.log(values)


def _in_thread(fn, *args):
    """Run `fn(*args)` in a thread; returns `wait(timeout)` giving its result or raising its error."""
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the waiter
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="rollout-bridge-generate", daemon=True).start()

    def wait(timeout):
        if not done.wait(timeout):
            raise TimeoutError(f"rollouts not finished after {timeout} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    return wait
