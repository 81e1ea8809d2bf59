"""Continuous batching: which sequences compute which tokens in the next step.

Every step, running sequences continue (a decode token, or the next chunk of
a prefill) oldest first, then waiting ones are admitted while the token
budget, the batch size and free KV pages allow. When pages run out, the
youngest running sequences are preempted: their pages are freed and they
are recomputed later from their tokens, never dropped. Only the scheduler
changes request state; the stepper takes a plan and returns tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import repeat

from ..outputs import FINISH_REASONS
from .kv_manager import KVManager
from .plan import ScheduledChunk, SchedulerStats, StepPlan, StepResult
from .sequence import Request, SeqStatus, Sequence


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        *,
        max_batch_size: int,
        max_step_tokens: int,
        is_stop_text: Callable[[Sequence], int | None] | None = None,
    ) -> None:
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self._stop_text = is_stop_text  # index where a stop string starts in the output text, or None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: list[Request] = []  # unfinished, in arrival order
        self.draining = False  # admit no new request until in-flight ones finish
        self.stats = SchedulerStats()
        self.finishes = 0  # samples ended, ever: a caller lists its finished requests only when it moved
        self._admissions = 0

    # -- queue ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.group(request.samples)
        self.requests.append(request)
        self.waiting.append(request.leader)

    @property
    def has_inflight(self) -> bool:
        return any(r.started for r in self.requests)

    @property
    def num_slots_used(self) -> int:
        return len(self.running) + sum(len(s.request.pending_forks) for s in self.running if s.request.leader is s)

    def blocked_by_drain(self) -> bool:
        return self.draining and not self.running and bool(self.waiting)

    # -- schedule ------------------------------------------------------------------------
    def schedule(self, version: int) -> StepPlan:
        plan = StepPlan.decode(version)  # mixed once a row is not a decode of its own (`StepPlan.add`)
        budget = self.max_step_tokens
        preempted = False
        ps, refcounts = self.kv.page_size, self.kv.allocator.refcounts
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed, pending, request = seq.num_computed_tokens, seq.pending, seq.request
            left = len(seq.token_ids) + pending - computed
            if left == 0 or pending and seq.num_output_tokens + pending >= request.max_tokens:
                # Its last step is in flight (a scored prompt, or a token that reaches `max_tokens`):
                # it ends when that step is applied. (A stop token or string is seen only then,
                # so a sample that stops computes one more token, dropped; see `apply`.)
                i += 1
                continue
            n = left if left < budget else budget
            # A decode inside a page of its own needs no reservation: most rows of most steps.
            mid_page = n == 1 and computed % ps and refcounts[seq.block_table[computed // ps]] == 1
            if not (mid_page or self._reserve_or_preempt(seq, n, plan)):
                preempted = True
                continue
            i += 1
            budget -= n
            if n == left == 1 and plan.decodes is not None and not request.pending_forks and not request.score_only:
                if seq.cacheable and (computed + 1) // ps > len(seq.page_keys):  # its page fills up
                    self.kv.register(seq, version, computed + 1)
                plan.decodes.append(seq)  # `_chunk`'s decode, inlined
                plan.starts.append(computed)
            else:
                plan.add(self._chunk(seq, n, version, n == left))
        if not preempted and self.waiting:
            self._admit(plan, budget, version)
        if not plan.pure_decode and any(c.length > 1 for c in plan.chunks):
            plan.chunks.sort(key=lambda c: c.length == 1)  # prefills first: the layout attention expects
        return plan

    def _reserve_or_preempt(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        while not self.kv.reserve(seq, n, plan.page_copies):
            if self.kv.leases.release_oldest():
                continue  # idle sessions' KV goes before any running sequence is preempted
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, plan: StepPlan, budget: int, version: int) -> None:
        used = self.num_slots_used  # counted once; each admission below adds its own slots
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            request = seq.request
            if self.draining and not request.started or seq.pending:
                break  # a sequence preempted with a token in flight is admitted once it is applied
            forks = len(request.pending_forks) if request.leader is seq else 0
            if used + 1 + forks > self.max_batch_size:
                break
            slot = request.lease_slot
            adopted = slot is not None and self.kv.leases.adopt(seq, slot) > 0
            hit = seq.num_computed_tokens if adopted else (self._match_prefix(seq, version) if seq.cacheable else 0)
            n = min(seq.num_uncomputed_tokens, budget)
            need = self.kv.pages_for(seq.num_computed_tokens + n) - len(seq.block_table) + forks
            while need > self.kv.allocator.num_free and self.kv.leases.release_oldest():
                pass  # idle sessions' KV goes before a new sequence waits
            if need > self.kv.allocator.num_free or not self.kv.reserve(seq, n, plan.page_copies):
                if adopted:  # the session keeps its KV for when there is room
                    self.kv.leases.keep(seq, slot)
                    seq.cacheable = True
                else:
                    self.kv.free(seq)
                break
            self.waiting.popleft()
            self.stats.prefix_hit_tokens += hit
            seq.status = SeqStatus.RUNNING
            seq.admitted_at = self._admissions
            self._admissions += 1
            request.started = True
            used += 1 + forks
            self.running.append(seq)
            plan.add(self._chunk(seq, n, version, n == seq.num_uncomputed_tokens))
            budget -= n

    def _match_prefix(self, seq: Sequence, version: int) -> int:
        scores = seq.request.prompt_scores  # positions whose logits it needs are computed, never cached
        limit = seq.num_tokens - 1 if scores is None else scores.cache_limit(seq.num_tokens)
        return self.kv.match_prefix(seq, version, limit)

    def _chunk(self, seq: Sequence, n: int, version: int, last: bool) -> ScheduledChunk:
        """`n` tokens of `seq` from its first uncomputed one; `last`: they are all it has
        left, so the chunk samples (for its group's pending members too, from their leader)."""
        start = seq.num_computed_tokens
        if seq.cacheable and (start + n) // self.kv.page_size > len(seq.page_keys):  # a page fills up
            self.kv.register(seq, version, start + n)
        request = seq.request
        if not last or request.score_only:
            return ScheduledChunk(seq, start, n, [])
        if request.leader is seq:
            return ScheduledChunk(seq, start, n, [seq, *request.pending_forks])
        return ScheduledChunk(seq, start, n, [seq])

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s pages and queue it (first) for recompute from its tokens."""
        self._requeue(seq)
        self.stats.preemptions += 1

    # -- update --------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Apply a step that ran to its end: `advance`, then `apply`."""
        self.advance(plan)
        self.apply(plan, result)

    def advance(self, plan: StepPlan) -> None:
        """What a launched step computes, before its tokens are known: the chunks'
        positions count as computed, the group members it samples for fork from
        their leader, and each sampled sequence has one token pending."""
        stats = self.stats
        if plan.pure_decode:  # the steady decode: one position and one pending token per row
            prompt = recomputed = 0
            for seq, start in zip(plan.decodes, plan.starts, strict=True):
                seq.num_computed_tokens = start + 1
                seq.pending += 1
                if start < len(seq.request.prompt_token_ids):
                    prompt += 1
                if start < seq.kv_high_water:
                    recomputed += 1
                else:
                    seq.kv_high_water = start + 1
            stats.computed_tokens += len(plan.decodes)
            stats.prompt_tokens += prompt
            stats.recomputed_tokens += recomputed
            return
        computed = prompt = recomputed = 0
        for chunk in plan.chunks:
            seq, start, length = chunk.seq, chunk.start, chunk.length
            end = start + length
            seq.num_computed_tokens = end
            computed += length
            if start < seq.num_prompt_tokens:
                prompt += min(seq.num_prompt_tokens - start, length)
            high = seq.kv_high_water
            if start < high:
                recomputed += min(end, high) - start
            if end > high:
                seq.kv_high_water = end
            if len(chunk.samplers) > 1:  # a group's leader and the members that fork from it
                for s in chunk.samplers:
                    if s is not seq:
                        self._fork(seq, s)
        stats.computed_tokens += computed
        stats.prompt_tokens += prompt
        stats.recomputed_tokens += recomputed
        for s in plan.samplers:
            s.pending += 1

    def apply(self, plan: StepPlan, result: StepResult) -> None:
        """The tokens of an advanced step: appended, and the samples they end finished.
        A sample that ended while the step was in flight (a stop seen one step late,
        an abort) drops its token: it is never returned."""
        for scores in result.scores or ():
            scores.seq.request.prompt_scores.record(scores, result.version)
        finished = []
        if plan.pure_decode:
            rows = zip(plan.decodes, plan.starts, strict=True)
        else:
            rows = ((c.seq, c.start + c.length - 1) for c in plan.chunks)
        for seq, last in rows:  # the position each row computed last
            request = seq.request
            scores = request.prompt_scores
            if scores is not None and last >= seq.num_prompt_tokens - 1 and not scores.done:
                scores.finish(result.version)
                if request.score_only and not seq.is_finished:
                    finished.append((seq, "stop"))
        version, tokens, finished_ = result.version, result.tokens, SeqStatus.FINISHED
        tops = repeat(None, len(tokens)) if result.top is None else result.top
        # Stop checks inlined: most rows go on.
        for s, token, logprob, top in zip(plan.samplers, tokens, result.logprobs, tops, strict=True):
            s.pending -= 1
            if s.status is finished_:
                continue
            s.append(token, logprob, version, top)
            request = s.request
            if (
                token in request.stop_token_ids
                or request.longest_stop
                or (len(s.token_ids) - len(request.prompt_token_ids) >= request.max_tokens)
            ):
                reason = self._finish_reason(s, token)
                if reason is not None:
                    finished.append((s, reason))
        for s, reason in finished:
            self.finish(s, reason)

    def _fork(self, leader: Sequence, child: Sequence) -> None:
        request = leader.request
        request.pending_forks.remove(child)
        if not request.pending_forks:
            request.leader = None
        self.kv.fork(leader, child)
        child.status = SeqStatus.RUNNING
        child.admitted_at = self._admissions
        self._admissions += 1
        self.running.append(child)

    def _finish_reason(self, s: Sequence, token: int) -> str | None:
        request = s.request
        if token in request.stop_token_ids:
            return "stop"
        if request.params.stop and self._stop_text is not None:
            cut = self._stop_text(s)
            if cut is not None:
                s.stop_text_end = cut
                return "stop"
        if s.num_output_tokens >= request.max_tokens:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` for `reason`, one of FINISH_REASONS (what `Sample.finish_reason` promises)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.FORK_PENDING:
            seq.request.pending_forks.remove(seq)
        if seq.pending and seq.num_computed_tokens >= seq.num_tokens:
            # The step in flight feeds its last token: keep the KV a synchronous step would
            # have (the last token's is computed with the next turn), its extra page freed.
            self.kv.trim(seq, seq.num_tokens - 1)
            seq.kv_high_water = min(seq.kv_high_water, seq.num_tokens - 1)
        slot = seq.request.lease_slot
        if slot is not None and reason != "abort":
            self.kv.save_routing(seq)
            self.kv.leases.keep(seq, slot)  # the session's next turn starts from it
        else:
            # An aborted turn never reaches its session's trajectory: its KV must not either.
            if slot is not None:
                self.kv.leases.release(slot)
            self.kv.free(seq)
        seq.mark_finished(reason)
        self.finishes += 1
        request = seq.request
        if request.leader is seq and request.pending_forks:
            # The leader is gone before its prompt was shared: the next pending sample leads.
            request.group(request.pending_forks)
            self.waiting.appendleft(request.leader)
            request.leader.status = SeqStatus.WAITING
        if request.is_finished:
            self.requests.remove(request)

    # -- weight commits ------------------------------------------------------------------
    def on_weights_committed(self, inflight: str) -> None:
        """Apply an in-flight mode to the sequences a weight commit finds.

        keep:      running sequences go on with their KV; it mixes versions now,
                   so their pages are never published to the prefix cache.
        recompute: running sequences drop their KV and are recomputed from their
                   tokens under the new weights, then continue.
        restart:   every in-flight sample drops its outputs and starts over.
        drain:     nothing is in flight by the time the commit runs.
        """
        self.kv.clear_prefix_cache()
        self.kv.leases.on_weights_committed(inflight)
        if inflight == "keep":
            for s in reversed(list(self.running)):
                s.cacheable = False
                if s.request.prompt_scores is not None and not s.request.prompt_scores.done:
                    self._requeue(s)  # its prompt logprobs are all computed under one version
        elif inflight == "recompute":
            for s in reversed(list(self.running)):
                self._requeue(s)
        elif inflight == "restart":
            for request in reversed([r for r in self.requests if r.started]):
                self._restart(request)

    def _requeue(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.cacheable = True
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _restart(self, request: Request) -> None:
        members = [s for s in request.samples if not s.is_finished]
        for s in members:
            self.stats.discarded_tokens += s.num_output_tokens
            if s.status is SeqStatus.RUNNING:
                self.running.remove(s)
            elif s.status is SeqStatus.WAITING:
                self.waiting.remove(s)
            self.kv.free(s)
            s.cacheable = True
            s.reset_outputs()
        if request.prompt_scores is not None:
            request.prompt_scores.reset()
        request.group(members)
        request.leader.status = SeqStatus.WAITING
        self.waiting.appendleft(request.leader)

    def recover(self) -> None:
        """After a step failed midway: KV written by that step (and pages it
        copied on write) cannot be trusted, so every running sequence drops
        its KV and is recomputed from its tokens."""
        self.kv.clear_prefix_cache()
        for request in self.requests:  # the tokens of the steps in flight are lost: sampled again
            for s in request.samples:
                s.pending = 0
        for s in reversed(list(self.running)):
            self._requeue(s)

    def abort(self, requests: list[Request]) -> None:
        """Finish every unfinished sample of `requests` with reason "abort"."""
        for request in requests:
            for s in request.samples:
                if not s.is_finished:
                    self.finish(s, "abort")

    def abort_unscheduled(self, requests: list[Request]) -> None:
        """Mark "abort" the unfinished samples of `requests` the scheduler does not hold
        (not added yet, or the rest of an `abort`): nothing of theirs is queued or holds KV."""
        for request in requests:
            for s in request.samples:
                if not s.is_finished:
                    s.mark_finished("abort")
                    self.finishes += 1
