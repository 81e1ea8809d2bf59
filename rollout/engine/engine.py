"""`Engine`: one device's rollout engine. The glue between the scheduler, the
stepper, the workspace and the policy version guard; no Ray here.

A step (`_one_step`) is three calls under the guard: the scheduler plans
(`schedule`), the stepper computes (`launch`), the scheduler applies the
result (`advance`, then `apply`: one step later under `async_scheduling`, see
`rollout.engine.pipeline`). The caller's finished requests are copied under the guard too,
as another thread's step may be finishing them; their outputs are decoded,
and the step's record logged, after the guard is released."""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch

from workspace import DecodeCache, InferenceWorkspace, KVPool, PageAllocator, WorkspaceShape

from ..episodes import Episode, run_episodes, run_episodes_async
from ..kernels.choice import load_kernels
from ..model.config import ModelConfig
from ..model.decoder import Model
from ..model.loader import load_checkpoint
from ..outputs import RolloutOutput
from ..sampling_params import SamplingParams
from ..tokenizer import TextCodec
from .background import BackgroundDriver
from .config import EngineConfig
from .decode_graphs import graph_stats
from .errors import ClosedError
from .kv_manager import KVManager
from .leases import LeaseSlot
from .open_iterators import OpenIterators
from .pipeline import StepPipeline
from .requests import PromptLimits, make_requests
from .routing import RoutingReader, pool_routing
from .scheduler import Scheduler
from .score_requests import run_score
from .sequence import Request
from .session import EngineTurns, Session
from .sleep import SleepAPI
from .step_failures import RequestFailures, StepOutcome
from .step_stats import StepInfo, StepLog
from .stepper import Stepper
from .stop_strings import StopStrings
from .streams import Generation, TokenStream
from .version_guard import PolicyVersionGuard
from .weight_update import WeightUpdater
from .weights_api import WeightsAPI


class Engine(WeightsAPI, SleepAPI):
    """Samples `n` responses per prompt with per-token logprobs and policy versions.

    Arguments (see docs/design.md): `model_path` is a Hugging Face checkpoint
    directory (config.json + safetensors, tokenizer optional). Bad arguments
    raise `ValueError`/`TypeError` naming the field before anything is built.
    Extra keywords: `page_size` (KV tokens per page), `max_step_tokens` (tokens
    computed per step), `debug_decode_cache` (check the fast decode path against
    the host path every step), `decode_graphs` ("auto": "cuda" on a CUDA device,
    else "off"; "cuda": decode steps replayed from CUDA graphs; "eager": the same
    padded steps without capture; see `rollout.engine.decode_graphs`), `kernels`
    ("auto": on the CPU the compiled kernels of `rollout.kernels` when they build,
    on CUDA its Triton kernels, else "torch"; "compiled" or "triton": those kernels
    or an error, "triton" on the CPU only under `TRITON_INTERPRET=1`; "torch": torch
    ops, attention over gathered pages with SDPA), `kv_cache_dtype` (None: the
    model's; "bfloat16" under float32 halves the pool, at a logprob cost),
    `matmul_dtype` (None: the model's; "bfloat16" under float32: projections
    multiply in bfloat16, accumulate in float32), `async_scheduling` ("auto": on
    for CUDA; True: each step applied one step late, `rollout.engine.pipeline`),
    `max_request_tokens` (None: no bound; else a call whose prompts x n x (prompt
    tokens + max_tokens) exceed it raises `ValueError`), `step_callback`.
    """

    def __init__(
        self,
        model_path: str | Path,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype = "float32",
        max_batch_size: int = 256,
        max_seq_len: int | None = None,
        kv_cache_tokens: int | None = None,
        seed: int = 0,
        *,
        page_size: int = 16,
        max_step_tokens: int | None = None,
        debug_decode_cache: bool = False,
        decode_graphs: str = "auto",
        kernels: str = "auto",
        kv_cache_dtype: str | torch.dtype | None = None,
        matmul_dtype: str | torch.dtype | None = None,
        max_request_tokens: int | None = None,
        async_scheduling: bool | str = "auto",
        step_callback: Callable[[StepInfo], None] | None = None,
    ) -> None:
        self.model_config = ModelConfig.from_dir(model_path)
        cfg = EngineConfig.resolve(
            self.model_config,
            device=device,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            kv_cache_tokens=kv_cache_tokens,
            seed=seed,
            page_size=page_size,
            max_step_tokens=max_step_tokens,
            decode_graphs=decode_graphs,
            kernels=kernels,
            kv_cache_dtype=kv_cache_dtype,
            matmul_dtype=matmul_dtype,
            max_request_tokens=max_request_tokens,
            async_scheduling=async_scheduling,
        )
        self.codec = TextCodec.from_dir(model_path, self.model_config.eos_token_ids)
        self._kernels = load_kernels(cfg.kernels, cfg.device)  # compiled at first use; None: torch ops only
        self.config = cfg = dataclasses.replace(cfg, kernels="torch" if self._kernels is None else self._kernels.name)
        self.model = Model(self.model_config, cfg.dtype, cfg.device, cfg.max_seq_len, self._kernels, cfg.matmul_dtype)
        load_checkpoint(self.model, model_path)
        self.model.pack_weights()
        self._build_runtime(debug_decode_cache)
        self._guard = PolicyVersionGuard(0)
        self._failures = RequestFailures()  # requests a failed step was pinned on, until collected
        self._updater = WeightUpdater(self.model)
        self._update_lock = threading.RLock()  # one update prepares or commits at a time
        self._rng = random.Random(cfg.seed)
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()
        # Lock-free (single set operations): a generator's cleanup may run anywhere, even under the guard.
        self._iterators = OpenIterators()
        self._step_callback = step_callback  # called by the thread that stepped, outside the guard
        self._step_log = StepLog()
        self._closed = False
        self._background = BackgroundDriver(self)  # steps session turns nobody's thread steps

    def _build_runtime(self, debug_decode_cache: bool) -> None:
        cfg, mc = self.config, self.model_config
        self.kv_pool = KVPool(
            num_layers=mc.num_layers,
            num_pages=cfg.num_pages + 1,  # the last page is scratch for padded decode rows
            page_size=cfg.page_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=cfg.kv_cache_dtype,
            device=cfg.device,
            routing=pool_routing(mc),  # the experts each token went to, for mixture-of-experts models
        )
        shape = WorkspaceShape(cfg.max_step_tokens, cfg.max_batch_size, -(-cfg.max_seq_len // cfg.page_size))
        self.workspace = InferenceWorkspace(shape, cfg.device)
        self.decode_cache = DecodeCache(self.workspace, debug=debug_decode_cache)
        self.stepper = Stepper(
            self.model,
            self.kv_pool,
            self.workspace,
            self.decode_cache,
            cfg.decode_graphs,
            scratch_page=cfg.num_pages,
            kernels=self._kernels,
        )
        self.scheduler = Scheduler(
            KVManager(PageAllocator(cfg.num_pages, cfg.page_size), RoutingReader.of(self.kv_pool)),
            max_batch_size=cfg.max_batch_size,
            max_step_tokens=cfg.max_step_tokens,
            is_stop_text=StopStrings(self.codec).find if self.codec is not None else None,
        )
        self._pipeline = StepPipeline(self.stepper, self.scheduler, cfg.async_scheduling)

    # -- public API ----------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._guard.version

    @property
    def tokenizer(self) -> TextCodec | None:
        return self.codec

    def generate(self, prompts, params: SamplingParams | None = None) -> list[RolloutOutput]:
        """Sample `params.n` responses for each prompt; one `RolloutOutput` per
        prompt, in prompt order. Prompts are all strings (needs a tokenizer)
        or all token-id sequences (lists, 1-D integer numpy arrays or torch
        tensors). Safe to call from several threads at once: their sequences
        share batches."""
        outputs = dict(self.generate_iter(prompts, params))  # every prompt's, or it raised
        return [outputs[i] for i in range(len(outputs))]

    def generate_iter(self, prompts, params: SamplingParams | None = None) -> Generation:
        """Like `generate`, but yields `(prompt index, output)` as each prompt's
        samples finish, in completion order. Arguments are validated before
        this returns; the requests join the engine at the first `next`, so an
        iterator never advanced holds nothing. Closing the iterator early
        aborts the unfinished prompts and drops them; `abort()` (from any
        thread) ends them at once and the iterator still yields them, with
        `finish_reason="abort"` and the tokens sampled so far."""
        self._check_open()
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        requests = self._requests(prompts, params)
        return Generation(self._drive(requests), lambda: self._abort(requests))

    # `score(sequences, top_logprobs=0, params=None, start=1)`: teacher-forced logprobs by prefill.
    score = run_score

    def stream(self, prompt, params: SamplingParams | None = None) -> TokenStream:
        """Start sampling `params.n` responses to one prompt (token ids, a string
        or chat messages) and return a `TokenStream` of their tokens as they are
        sampled: `SampleDelta`s, then the finished `RolloutOutput`. Made inside
        an event loop it is iterated with `async for`, else with `for`. The
        prompt is checked here; `cancel()` aborts it."""
        self._check_open()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        (request,) = self._requests([prompt], params)
        stream = TokenStream()
        (future,) = self._background.submit([request], streams=[stream.push])
        stream.attach(future)
        return stream

    def session(self, prompt, tools: list[dict] | None = None) -> Session:
        """A multi-turn episode starting from `prompt` (token ids, a string, or
        chat messages rendered with the generation prompt, `tools` passed to the
        template); see `Session`."""
        self._check_open()
        return Session(EngineTurns(self), prompt, PromptLimits.of(self.config, self.model_config), tools)

    def run_episodes(self, envs, params: SamplingParams | None = None, max_turns: int = 8) -> list[Episode]:
        """One multi-turn episode per environment, all at once (see `rollout.episodes`)."""
        return run_episodes(self.session, envs, params, max_turns)

    async def run_episodes_async(self, envs, params: SamplingParams | None = None, max_turns: int = 8):
        """`run_episodes` for asyncio code."""
        return await run_episodes_async(self.session, envs, params, max_turns)

    def stats(self) -> dict[str, int | float]:
        """Counters for monitoring: tokens computed, prefix hits, preemptions, tokens
        recomputed after their KV was dropped, sampled tokens thrown away, KV use."""
        self._check_open()
        st = self.scheduler.stats
        alloc = self.scheduler.kv.allocator
        return {
            "policy_version": self.policy_version,
            "computed_tokens": st.computed_tokens,
            "prompt_tokens": st.prompt_tokens,
            "prefix_hit_tokens": st.prefix_hit_tokens,
            "preemptions": st.preemptions,
            "recomputed_tokens": st.recomputed_tokens,
            "discarded_tokens": st.discarded_tokens,
            "kv_pages_total": alloc.num_pages,
            "kv_pages_used": alloc.num_used,
            "decode_cache_hits": self.decode_cache.hits,
            "decode_cache_misses": self.decode_cache.misses,
            **graph_stats(self.stepper.graphs),
            "packed_weights": self.model.packed.num_current if self.model.packed is not None else 0,
            "session_leases": self.scheduler.kv.leases.num_leases,
            "kv_pages_leased": self.scheduler.kv.leases.num_pages,
        }

    @property
    def num_steps(self) -> int:  # steps completed by any thread, read without the guard: a progress counter
        return self._step_log.count

    def step_log(self, since: float | None = None) -> list[StepInfo]:
        """The most recent steps (up to 8192), oldest first: when each ended, its
        duration, version and sizes; only those ending after `since` (a
        `time.time()` value) when given. Gaps between steps show generation pauses."""
        return self._step_log.since(since)

    def close(self) -> None:
        """Release the KV pool and workspace; later calls raise `ClosedError`.

        Idempotent. Waits for a step or commit under way to end, never for a
        generate or drain: those on other threads end with `ClosedError` at
        their next step (their unfinished requests aborted) or when their
        wait wakes, having installed nothing."""
        with self._guard.ahead_of_steps():  # a generating loop would otherwise keep retaking it
            if self._closed:
                return
            self._closed = True
            self._pipeline.drop()
            del self.kv_pool, self.workspace, self.decode_cache, self.stepper
            self._guard.notify()  # drains and drain-blocked callers wake up to raise

    # -- internals -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("engine is closed; make a new Engine")

    def _session_turn(self, token_ids: list[int], params: SamplingParams, slot: LeaseSlot, pick=None) -> Future:
        """Start one session turn from `token_ids` on the background driver, its
        KV kept in `slot` when it finishes; the future gives `pick(output)` (default: its `Sample`)."""
        self._check_open()
        if threading.current_thread() is self._background.thread:
            raise RuntimeError(
                "a session turn from a step callback would wait on the thread that steps it; "
                "run the turn from another thread"
            )
        (request,) = self._requests([token_ids], params)
        request.lease_slot = slot
        (future,) = self._background.submit([request], pick=pick or (lambda out: out.samples[0]))
        slot.request = request  # what Session.abort ends (one racing this call is replayed by the Session)
        return future

    def _requests(self, prompts, params: SamplingParams) -> list[Request]:
        """Validated requests for `prompts` (see `make_requests`); raises before any exists."""
        self._check_awake()
        counters = dict(rng=self._rng, request_ids=self._request_ids, seq_ids=self._seq_ids)
        return make_requests(prompts, params, self.config, self.model_config, self.codec, **counters)

    def _release_lease(self, slot: LeaseSlot) -> None:
        with self._guard.ahead_of_steps():  # bookkeeping: it waits for one step at most
            if not self._closed:
                self.scheduler.kv.leases.close(slot)

    def _after_step(self, info: StepInfo | None) -> None:
        """What follows a step outside the guard, on the thread that ran it."""
        if info is not None and self._step_callback is not None:
            self._step_callback(info)

    def _abort(self, requests: list[Request]) -> None:
        """End every unfinished sample of `requests` now ("abort"), tokens kept, KV freed, unstarted ones too."""
        with self._guard.ahead_of_steps():
            self._check_open()
            live = set(map(id, self.scheduler.requests))
            self.scheduler.abort([r for r in requests if id(r) in live])
            self.scheduler.abort_unscheduled(requests)
            self._guard.notify()  # a drain may wait on these; a drive blocked on a drain wakes

    def _drive(self, requests: list[Request]) -> Iterator[tuple[int, RolloutOutput]]:
        with self._guard.held():
            self._check_open()
            for r in requests:
                if not r.is_finished:  # aborted before it started
                    self.scheduler.add(r)
        opened = self._iterators.open(requests)
        decode = self.codec.decode if self.codec is not None else None
        pending, seen = dict(enumerate(requests)), -1
        try:
            while pending:
                info, finished, failed, seen = self._one_step(pending, seen=seen)
                if failed:  # this caller's request made a step fail: the call fails with its cause
                    raise failed[0][1]
                for index, result in finished:
                    del pending[index]
                    yield index, result.to_output(decode, index)
                    opened.thread = threading.current_thread()  # whoever resumed the iterator holds it now
                self._after_step(info)
        finally:
            self._iterators.close(opened)
            if pending:  # an error, a close, or the caller stopped iterating
                with self._guard.held():
                    self.scheduler.abort(list(pending.values()))
                    self._failures.forget(pending.values())
                    self._guard.notify()  # a pending drain may be waiting on these

    def _one_step(self, pending: dict[int, Request], observe: Callable | None = None, seen: int = -1) -> StepOutcome:
        """One step of whatever the scheduler plans (other callers' sequences
        included), unless `pending` is all finished: its record (None when no
        step ran), the results of the finished ones among `pending` (walked when
        a sample ended since `seen` or all are), copied under the guard, where `observe()`
        runs too, and the errors of those a failed step was pinned on (see
        `step_failures`). Logged once the guard is released."""
        info, blocked = None, False
        with self._guard.step() as version:
            self._check_open()
            idle = all(r.is_finished for r in pending.values())  # finished by another caller's steps
            if not idle:
                started = time.perf_counter()
                # Scheduling publishes the pages a step will write (prefix cache): if scheduling,
                # the step or the update fails midway, none of what it touched is trusted.
                with self._pipeline.recovering():
                    settled = self._pipeline.settle_for_host()
                    plan = self.scheduler.schedule(version)
                    if not plan.is_empty:  # `run` is False when the step failed on some requests' rows: they ended
                        if self._pipeline.run(plan, self._failures):
                            info = StepInfo.read(started, plan, self.scheduler)
                    elif self._pipeline.inflight is not None:
                        self._pipeline.settle()  # what is left ends with the step in flight
                    elif not settled and not (blocked := self.scheduler.blocked_by_drain()):
                        raise RuntimeError("scheduler made no progress with unfinished requests (engine bug)")
            failed = self._failures.collect(pending)
            ended = {key for key, _ in failed}
            walk = pending.items() if idle or ended or seen != self.scheduler.finishes else ()
            seen = self.scheduler.finishes
            finished = [(i, r.result()) for i, r in walk if r.is_finished and i not in ended]
            if observe is not None:
                observe()
        if blocked:
            # A drain is pending and only new requests remain: wait for its commit (or a close).
            self._guard.wait_for(lambda: self._closed or not self.scheduler.blocked_by_drain(), timeout=1.0)
        if info is not None:
            self._step_log.record(info)
        return StepOutcome(info, finished, failed, seen)
