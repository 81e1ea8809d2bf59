"""Generation on the cluster: prompt groups dispatched to actors, balanced by
outstanding work; outputs collected as they finish; the groups of an actor
that dies re-dispatched to live ones, each delivered exactly once."""

from __future__ import annotations

import threading
import time

from ..engine.requests import validate_prompts
from ..outputs import RolloutOutput
from ..sampling_params import SamplingParams
from .actor_slots import ActorSlot, unwrap
from .handles import GenerationHandle
from .ray_runtime import GENERATE, ray_module


class GenerationDispatch:
    """The generation half of `RolloutCluster` (a mixin over its actor state)."""

    def generate(
        self, prompts, params: SamplingParams | None = None, timeout: float | None = None
    ) -> list[RolloutOutput]:
        """Outputs in prompt order, as `Engine.generate` returns them."""
        return self.submit(prompts, params).result(timeout)

    def submit(self, prompts, params: SamplingParams | None = None) -> GenerationHandle:
        """Start generating and return at once; the handle gives `result()` and
        `as_completed()`. Prompts are validated here, before any is dispatched."""
        self._check_open()
        params = SamplingParams() if params is None else params
        token_lists, texts = validate_prompts(prompts, params, self._limits, self._codec)
        handle = GenerationHandle(texts)
        if token_lists:
            self._dispatch(handle, token_lists, params, list(range(len(token_lists))))
        return handle

    def _dispatch(self, handle: GenerationHandle, prompts, params: SamplingParams, indices: list[int]) -> None:
        cost = params.n * params.max_tokens
        with self._cond:
            live = self._wait_for_live()
            shares: dict[int, list[int]] = {s.index: [] for s in live}
            loads = {s.index: s.load for s in live}
            for i in sorted(indices, key=lambda i: -len(prompts[i])):
                target = min(live, key=lambda s: loads[s.index])
                shares[target.index].append(i)
                loads[target.index] += cost
            for slot in live:
                slot.load += cost * len(shares[slot.index])
            work = [(slot, slot.generation, slot.handle, sorted(shares[slot.index])) for slot in live]
        for slot, generation, actor, share in work:
            if share:
                handle._assign(share, slot.label)
                stream = actor.generate_stream.options(concurrency_group=GENERATE).remote(
                    share, [prompts[i] for i in share], params
                )
                threading.Thread(
                    target=self._consume,
                    args=(handle, prompts, params, slot, generation, share, stream),
                    name=f"rollout-stream-{slot.index}",
                    daemon=True,
                ).start()

    def _consume(self, handle, prompts, params, slot: ActorSlot, generation: int, share, stream) -> None:
        ray = ray_module()
        remaining, cost = set(share), params.n * params.max_tokens
        try:
            while remaining:
                ready, _ = ray.wait([stream], timeout=self.stall_timeout_s)
                if not ready:
                    raise TimeoutError(
                        f"{slot.label} produced no output for {self.stall_timeout_s} s while generating "
                        f"prompts {sorted(remaining)[:8]}"
                    )
                out = ray.get(next(stream))
                remaining.discard(out.index)
                handle._deliver(out)
                self._unload(slot, generation, cost)
        except ray.exceptions.RayActorError:
            self._unload(slot, generation, cost * len(remaining))
            self._actor_died(slot, generation, "died while generating")
            lost = handle._missing(sorted(remaining))
            if lost:
                try:
                    self._dispatch(handle, prompts, params, lost)
                except BaseException as e:
                    handle._fail(e)
        except BaseException as e:
            self._unload(slot, generation, cost * len(remaining))
            handle._fail(unwrap(e))

    def _unload(self, slot: ActorSlot, generation: int, amount: int) -> None:
        with self._cond:
            if slot.generation == generation:
                slot.load = max(0, slot.load - amount)

    def _wait_for_live(self) -> list[ActorSlot]:
        """Alive actors (waits for a replacement when none is); call holding `_cond`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._check_open()
            live = [s for s in self._slots if s.state == "alive"]
            if live:
                return live
            if all(s.state == "dead" for s in self._slots):
                raise RuntimeError(
                    "no rollout actor is alive: " + "; ".join(f"{s.label}: {s.error}" for s in self._slots)
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no rollout actor came back within {self.timeout_s} s")
            self._cond.wait(left)
