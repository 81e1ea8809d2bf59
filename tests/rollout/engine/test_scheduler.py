"""Scheduler tests on hand-made step results, no model: group prefill and
forks, copy-on-write, page-bounded admission, youngest-first preemption,
chunked prefill."""

from __future__ import annotations

import itertools

import pytest

from rollout.engine.kv_manager import KVManager
from rollout.engine.plan import StepResult
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import Request, SeqStatus, Sequence
from rollout.outputs import FINISH_REASONS
from rollout.sampling_params import SamplingParams
from workspace import PageAllocator

_ids = itertools.count()


def make_request(prompt: list[int], n: int = 1, max_tokens: int = 50) -> Request:
    r = Request(
        next(_ids),
        list(prompt),
        SamplingParams(n=n, max_tokens=max_tokens),
        seed=0,
        max_tokens=max_tokens,
        stop_token_ids=frozenset(),
    )
    r.samples = [Sequence(next(_ids), r, k, list(prompt)) for k in range(n)]
    return r


def make_scheduler(num_pages: int, page_size: int = 4, max_batch: int = 16, step_tokens: int = 64) -> Scheduler:
    kv = KVManager(PageAllocator(num_pages, page_size))
    return Scheduler(kv, max_batch_size=max_batch, max_step_tokens=step_tokens)


def run_step(sched: Scheduler, token: int = 7):
    plan = sched.schedule(version=0)
    sched.update(plan, StepResult([token] * len(plan.samplers), [-1.0] * len(plan.samplers), 0))
    return plan


def test_group_prefills_once_then_forks_and_copies_the_partial_page_on_write():
    sched = make_scheduler(num_pages=20)
    req = make_request([1, 2, 3, 4, 5, 6], n=3)  # 6 tokens: one full page + a partial one
    sched.add(req)
    plan = run_step(sched)
    (chunk,) = plan.chunks
    assert chunk.seq is req.samples[0] and (chunk.start, chunk.length) == (0, 6)
    assert chunk.samplers == req.samples  # one prefill row feeds all three samples
    alloc = sched.kv.allocator
    shared = list(req.samples[0].block_table)
    assert all(s.block_table == shared for s in req.samples)
    assert [alloc.refcount(p) for p in shared] == [3, 3]
    plan = run_step(sched)
    assert [c.length for c in plan.chunks] == [1, 1, 1]
    # The two first writers copy the shared partial page; the last one writes it in place.
    assert len(plan.page_copies) == 2 and all(src == shared[1] for src, _ in plan.page_copies)
    assert len({s.block_table[1] for s in req.samples}) == 3
    assert alloc.refcount(shared[0]) == 3 and alloc.refcount(shared[1]) == 1


def test_admission_is_bounded_by_free_pages():
    sched = make_scheduler(num_pages=4, page_size=4)
    first, second = make_request(list(range(1, 12))), make_request(list(range(21, 30)))
    sched.add(first)
    sched.add(second)
    plan = sched.schedule(version=0)
    assert [c.seq for c in plan.chunks] == [first.samples[0]]  # 3 pages used, 1 left: 3 needed
    assert second.samples[0].status is SeqStatus.WAITING


def test_youngest_is_preempted_and_recomputed_from_its_tokens():
    sched = make_scheduler(num_pages=4, page_size=4)
    old, young = make_request([1, 2, 3, 4, 5, 6, 7]), make_request([9, 9, 9])
    sched.add(old)
    sched.add(young)
    run_step(sched)  # old: 2 pages; young: 1 page
    run_step(sched)  # old reaches 8 tokens, young 4
    o, y = old.samples[0], young.samples[0]
    assert (o.num_tokens, y.num_tokens) == (9, 5)
    plan = run_step(sched)  # old needs a 3rd page, young a 2nd: only one is free
    assert sched.stats.preemptions == 1
    assert y.status is SeqStatus.WAITING and y.block_table == [] and y.num_computed_tokens == 0
    assert [c.seq for c in plan.chunks] == [o]
    assert y.num_tokens == 5  # nothing dropped: its tokens stay and are recomputed
    while not old.is_finished and o.num_tokens < 12:
        run_step(sched)
    sched.finish(o, "length")
    plan = run_step(sched)
    (chunk,) = plan.chunks
    # Its full first page was still cached after the preemption, so only the rest is recomputed.
    assert chunk.seq is y and (chunk.start, chunk.length) == (4, 1) and chunk.samplers == [y]
    assert sched.stats.prefix_hit_tokens == 4


def test_long_prompt_is_chunked_and_samples_only_at_its_end():
    sched = make_scheduler(num_pages=32, step_tokens=16)
    req = make_request(list(range(1, 41)), n=2)
    sched.add(req)
    lengths, samplers = [], []
    for _ in range(3):
        plan = run_step(sched)
        lengths.append([c.length for c in plan.chunks])
        samplers.append(len(plan.samplers))
    assert lengths == [[16], [16], [8]] and samplers == [0, 0, 2]
    assert sched.stats.prompt_tokens == 40


def test_batch_size_counts_pending_forks():
    sched = make_scheduler(num_pages=64, max_batch=4)
    a, b = make_request([1, 2], n=3), make_request([3, 4], n=2)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(version=0)
    assert [c.seq for c in plan.chunks] == [a.samples[0]]  # 3 + 2 > 4: b waits


def test_finish_takes_only_the_reasons_a_sample_can_report():
    sched = make_scheduler(num_pages=8)
    req = make_request([1, 2, 3])
    sched.add(req)
    run_step(sched)
    (seq,) = req.samples
    with pytest.raises(ValueError, match="finish reason must be one of"):
        sched.finish(seq, "timeout")
    assert not seq.is_finished and sched.running == [seq]  # refused before anything changed
    sched.finish(seq, "abort")
    assert seq.finish_reason in FINISH_REASONS and req.result().to_output(None).samples[0].finish_reason == "abort"


def _decode_distinct(sched: Scheduler, steps: int, version: int = 0) -> None:
    """Steps in which sampler row i draws token 100 + i: a group's samples diverge."""
    for _ in range(steps):
        plan = sched.schedule(version)
        rows = len(plan.samplers)
        sched.update(plan, StepResult([100 + i for i in range(rows)], [-1.0] * rows, version))


def test_recompute_commit_recomputes_a_groups_prompt_once():
    sched = make_scheduler(num_pages=40, page_size=4)
    req = make_request(list(range(1, 11)), n=3)  # 10 tokens: two full pages and a partial one
    sched.add(req)
    _decode_distinct(sched, 4)  # the prefill samples 1 token per sample, 3 decodes add 3 more
    assert [s.num_computed_tokens for s in req.samples] == [13, 13, 13]
    computed = sched.stats.computed_tokens
    sched.on_weights_committed("recompute")
    plan = sched.schedule(version=1)
    # The first sample recomputes everything and publishes its full pages as it is
    # scheduled; the others, admitted in the same step, share the prompt's two.
    assert [(c.seq, c.start, c.length) for c in plan.chunks] == [
        (req.samples[0], 0, 14),
        (req.samples[1], 8, 6),
        (req.samples[2], 8, 6),
    ]
    shared = req.samples[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in req.samples)
    sched.update(plan, StepResult([7, 7, 7], [-1.0] * 3, 1))
    assert sched.stats.computed_tokens - computed == 14 + 6 + 6
    assert sched.stats.recomputed_tokens == 13 + 5 + 5  # positions whose KV existed before the commit
    assert sched.stats.discarded_tokens == 0


def test_restart_commit_counts_discarded_outputs_and_the_recomputed_prompt():
    sched = make_scheduler(num_pages=40, page_size=4)
    req = make_request(list(range(1, 11)), n=3)
    sched.add(req)
    _decode_distinct(sched, 4)
    sched.on_weights_committed("restart")
    assert sched.stats.discarded_tokens == 3 * 4
    _decode_distinct(sched, 1, version=1)
    assert sched.stats.recomputed_tokens == 10  # the prompt once, for the whole group
    assert [s.num_output_tokens for s in req.samples] == [1, 1, 1]
