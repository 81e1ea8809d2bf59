"""The Stepper: the one primitive that advances a planned set of sequences by
one step. It binds KV pages, runs prefill chunks and decodes through the
model, samples, and returns tokens, logprobs and the policy version. It never
changes request state: the scheduler does, from the returned result.

A step is launched, then collected. `launch` runs `_prepare` (page copies,
the inputs in the workspace, attention metadata), `_run` (a decode graph's
replay, or the model and sampler) and `_finish` (the sampler's fix-ups, a
pure decode's signature remembered for the next step, and, when the result is
to be collected later, a copy of the tokens and logprobs to a staging buffer:
pinned host memory and an event on CUDA). `collect` reads them back.

Between the two, the next step may be launched (overlapped scheduling, see
`rollout.engine.pipeline`): a sequence whose last token is still on the
device is fed that token from the last step's sampled tokens, on the device
(all of them on a decode-cache hit, else gathered row by row).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

import torch

from workspace import DecodeCache, DecodeRows, InferenceWorkspace, KVPool, TaskSignature

from ..kernels.layer_ops import LayerOps
from ..model.attention import AttentionMetadata
from ..model.decoder import Model
from .decode_graphs import DecodeGraphs, GraphKey
from .grammar import GrammarMasks
from .inflight_io import Launched, Staging, feed_in_flight, to_device
from .penalties import StepPenalties, has_penalties
from .plan import ScheduledChunk, StepPlan, StepResult, TopLogprobs
from .sampler import MODE_CODES, SAMPLING_FIELDS, SamplerFlags, SamplingBatch, sample, top_logprobs
from .scoring import ScoreSpan, SpanScores, compute_scores, score_spans
from .sequence import Sequence
from .step_metadata import attention_metadata

_seq_id = attrgetter("seq_id")


class RowExtras(NamedTuple):
    """What a forward returns besides the sampled tokens (which land in the workspace)."""

    top: TopLogprobs | None  # per sampler row; None: no row asked
    scores: list[SpanScores] | None  # per score span; None: the step had none


class SampledRows(NamedTuple):
    """The logits a step sampled from and their sampling rows (workspace views)."""

    logits: torch.Tensor  # [rows, vocab] float32
    batch: SamplingBatch


@dataclass(slots=True)
class PreparedStep:
    """What `_prepare` left for `_run` and `_finish`; the inputs themselves are in the workspace."""

    meta: AttentionMetadata  # where the step's KV goes and what each row attends to
    num_rows: int  # sampled rows: one token and logprob each
    num_logits: int  # rows of logits the model computes (samples of one prompt share a row)
    flags: SamplerFlags  # the sampler's branches for these rows
    signature: TaskSignature | None  # a pure decode's signature; None for a step with prefill chunks
    graph: GraphKey | None  # the decode graph that serves the step; None: the eager forward
    top: list[int] | None  # per row, how many top logprobs it asks for; None: no row asks
    spans: list[ScoreSpan]  # rows whose logits score prompt tokens (see `scoring`); [] for most steps


class Stepper:
    """`decode_graphs` ("off", "eager" or "cuda", see `rollout.engine.decode_graphs`)
    serves pure-decode steps from graphs; padding rows then write to
    `scratch_page`, a KV page no sequence owns. `kernels` (see
    `rollout.kernels.layer_ops`; None: torch ops) gives the attention kernels
    that read pages in place instead of gathering them, and a sampler that
    samples a batch in one op (CPU) or without sorting the vocabulary (device)."""

    def __init__(
        self,
        model: Model,
        kv: KVPool,
        workspace: InferenceWorkspace,
        decode_cache: DecodeCache,
        decode_graphs: str = "off",
        scratch_page: int | None = None,
        kernels: LayerOps | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.ws = workspace
        self.cache = decode_cache
        self.page_size = kv.page_size
        self.decode_kernel = kernels.paged_decode if kernels is not None else None
        self.prefill_kernel = kernels.paged_prefill if kernels is not None else None
        self.sample_kernel = kernels.sample_rows if kernels is not None else None
        self.score_kernel = kernels.score_block if kernels is not None else None
        self.device_sample = kernels.device_sample if kernels is not None else None
        self._sampled: SampledRows | None = None  # the last forward's logits: `_resample_uncovered`, a graph's top rows
        self._graph_sampled: dict[GraphKey, SampledRows] = {}  # the same, per decode graph (its static tensors)
        self._flags = SamplerFlags(False, False, False)  # of the batch whose inputs the workspace holds
        self._penalized: list[Sequence] | None = None  # this step's rows when some have penalties
        self._constrained: list[Sequence] | None = None  # this step's rows when some have grammars
        self._masks = GrammarMasks()  # their bitmask, kept between steps
        self._reported: torch.Tensor | None = None  # with penalties: the logits each row's logprobs are reported in
        self._top: list[int] | None = None  # its rows' top_logprobs counts, when some row asks
        self._last_samplers: list[Sequence] = []  # the rows of the last launched step's out buffers
        self._staging = Staging(workspace)  # launched steps' tokens, and the fence on the host's inputs
        self.graphs = None
        if decode_graphs != "off":
            if scratch_page is None:
                raise ValueError("decode graphs need a scratch KV page for their padding rows")
            fixed_width = kernels is not None and kernels.tables_in_place  # one table width serves every step
            self.graphs = DecodeGraphs(
                decode_graphs, workspace, self._padded_decode, scratch_page, kv.page_size, fixed_width=fixed_width
            )

    def step(self, plan: StepPlan) -> StepResult:
        """One step of `plan`: a token and its logprob per sampler row, in plan order."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, staged: bool = False) -> Launched:
        """Start the step of `plan`; with `staged`, its tokens are copied aside so the
        next step may be launched before they are collected."""
        prepared = self._prepare(plan)
        extras = self._run(plan, prepared)
        return self._finish(plan, prepared, extras, staged)

    def collect(self, launched: Launched) -> StepResult:
        """The tokens and logprobs of a launched step, per sampler row in plan order
        (waiting for the device where the step still runs)."""
        n = launched.num_rows
        if launched.ready is not None:
            launched.ready.synchronize()
        top, scores = launched.extras
        return StepResult(launched.tokens[:n].tolist(), launched.logprobs[:n].tolist(), launched.version, top, scores)

    def _prepare(self, plan: StepPlan) -> PreparedStep:
        """Copy-on-write page copies, then the step's inputs into the workspace
        (a pure decode of the last step's sequences reuses them on the device)
        and its attention metadata."""
        self._staging.wait_for_uploads()  # the last step's copies out of the pinned input buffers ran
        self._copy_pages(plan.page_copies)
        samplers = plan.samplers
        num_rows = len(samplers)
        signature, spans = None, []
        if plan.pure_decode or _is_pure_decode(plan.chunks):
            signature = TaskSignature(plan.version, tuple(map(_seq_id, samplers)))
            if not self.cache.prepare(signature, lambda: self._decode_rows(plan)):
                self._read_batch(samplers)  # a hit keeps the last batch's facts, and its fed tokens
                feed_in_flight(self.ws, plan.spans(), self._last_samplers)
            num_logits = num_rows
        else:
            num_logits = self._upload_general(plan.chunks)
            feed_in_flight(self.ws, plan.spans(), self._last_samplers)
            self._read_batch(samplers)
            spans = score_spans(plan.chunks)
        meta = self._attention_metadata(plan)
        self._staging.uploaded()
        graph = None  # a graph takes no penalties or grammars (they change every step)
        eager = self._penalized is not None or self._constrained is not None
        if self.graphs is not None and signature is not None and not eager:
            graph = self.graphs.key(num_rows, meta.decode_block_tables.shape[1], self._flags)
        return PreparedStep(meta, num_rows, num_logits, self._flags, signature, graph, self._top, spans)

    def _read_batch(self, samplers: list[Sequence]) -> None:
        """The host-known facts of the batch whose inputs the workspace now holds:
        the sampler's flags, and how many top logprobs each row asks for (None
        when none does)."""
        params = [s.request.params for s in samplers]
        self._flags = SamplerFlags.of(params)
        top = [p.top_logprobs for p in params]
        self._top = top if any(top) else None
        self._penalized = samplers if any(map(has_penalties, params)) else None
        self._constrained = samplers if any(s.grammar is not None for s in samplers) else None

    def _run(self, plan: StepPlan, prepared: PreparedStep) -> RowExtras:
        """The model and sampler: tokens and logprobs land in the workspace's out buffers;
        the top logprobs of the rows that ask for them, and prompt logprobs, are returned."""
        self._reported = None  # set again by a forward with penalised rows; a graph never has any
        if prepared.graph is not None:
            self.graphs.run(prepared.num_rows, prepared.graph)
            self._sampled = sampled = self._graph_sampled.get(prepared.graph, self._sampled)
            plan.graph = True
            top = prepared.top  # from the graph's logits, after the replay
            return RowExtras(None if top is None else self._top_rows(sampled.logits, sampled.batch, top), None)
        if self.graphs is not None:
            self.graphs.ran_eagerly(decode=prepared.signature is not None)
        p = prepared
        return self._forward(plan.num_tokens, p.meta, p.num_logits, p.num_rows, p.flags, p.top, p.spans)

    def _finish(self, plan: StepPlan, prepared: PreparedStep, extras: RowExtras, staged: bool) -> Launched:
        """The sampler's fix-ups; a pure decode's signature lets the next step reuse its inputs;
        with `staged`, the tokens and logprobs copied aside (the next step overwrites the workspace's)."""
        n = prepared.num_rows
        if self.device_sample is not None and prepared.flags.any_filter:
            self._resample_uncovered(n)
        if self._reported is not None:  # rows reporting "raw" logprobs: the model's, unpenalised
            self._fix_raw(n)
        if prepared.signature is not None:
            self.cache.remember(prepared.signature)
        else:
            self.cache.invalidate()
        self._last_samplers = plan.samplers
        tokens, logprobs, ready = self.ws.view("out_tokens", n), self.ws.view("out_logprobs", n), None
        if staged:
            tokens, logprobs, ready = self._staging.stage(tokens, logprobs)
        needs_host = self._penalized is not None or self._constrained is not None or extras.scores is not None
        return Launched(n, tokens, logprobs, ready, plan.version, extras, needs_host)

    def invalidate(self) -> None:
        """Forget device-side state carried between steps (after a failed step)."""
        self.cache.invalidate()
        if self.graphs is not None:
            self.graphs.invalidate()

    def release_graphs(self) -> None:
        """Drop the decode graphs and every tensor of theirs this stepper holds (a sleep frees
        their memory pool); the next decode captures them again."""
        self.invalidate()
        if self.graphs is not None:
            self.graphs.release()
        self._graph_sampled.clear()
        self._sampled = None

    def _copy_pages(self, page_copies: list[tuple[int, int]]) -> None:
        if page_copies:
            src, dst = zip(*page_copies, strict=True)
            self.kv.copy_pages(to_device(src, self.ws.device), to_device(dst, self.ws.device))

    def _forward(
        self,
        num_tokens: int,
        meta: AttentionMetadata,
        num_logits: int,
        num_rows: int,
        flags: SamplerFlags,
        top: list[int] | None = None,
        spans: list[ScoreSpan] | None = None,
        keep: bool = False,
    ) -> RowExtras:
        """Model and sampler over the workspace's first rows; tokens and logprobs land in its
        out buffers. With `top` (per row, how many), the rows that ask get their top logprobs;
        with `spans`, their rows' logits score the prompt tokens that follow them. With `keep`
        (a graph's step), the logits and sampling rows stay in `_sampled`."""
        ws = self.ws
        ids, positions = ws.view("input_ids", num_tokens), ws.view("positions", num_tokens)
        scores = None
        if spans:
            hidden = self.model.hidden(ids, positions, meta, self.kv)
            logits = self.model.logits(hidden.index_select(0, ws.view("logit_rows", num_logits)))
            scores = compute_scores(self.model, hidden, spans, self.score_kernel)
        else:
            logits = self.model(ids, positions, meta, self.kv, ws.view("logit_rows", num_logits))
        if num_logits != num_rows:
            logits = logits.index_select(0, ws.view("sample_rows", num_rows))
        batch = self._sampling_batch(num_rows, flags)
        tokens, logprobs = ws.view("out_tokens", num_rows), ws.view("out_logprobs", num_rows)
        self._reported = None
        if self._penalized is not None:  # never under a graph's capture (see `_prepare`)
            penalties = StepPenalties.of(self._penalized, logits.shape[-1], logits.device)
            logits, self._reported = penalties.apply(logits)
        if self._constrained is not None:  # likewise: each constrained row's grammar masks it
            logits, self._reported = self._masks.apply(self._constrained, logits, self._reported)
        if self.device_sample is not None:
            self.device_sample(logits, batch, tokens, logprobs, ws.view("out_covered", num_rows))
        else:
            sample(logits, batch, tokens, logprobs, self.sample_kernel)
        if self.device_sample is not None or keep:
            self._sampled = SampledRows(logits, batch)
        if top is None:
            return RowExtras(None, scores)
        return RowExtras(self._top_rows(logits if self._reported is None else self._reported, batch, top), scores)

    def _top_rows(self, logits: torch.Tensor, batch: SamplingBatch, top: list[int]) -> TopLogprobs:
        """Per row of `top` (how many it asks for), its top logprobs from `logits`' first rows."""
        rows = [r for r, k in enumerate(top) if k]
        index = torch.tensor(rows, device=logits.device)
        ids, values = top_logprobs(logits.index_select(0, index), batch.rows(index), max(top))
        out: TopLogprobs = [None] * len(top)
        for r, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
            out[r] = tuple(zip(row_ids[: top[r]], row_values[: top[r]], strict=True))
        return out

    def _padded_decode(self, key: GraphKey) -> None:
        """One decode step over the first `key.rows` workspace rows, as captured in a graph."""
        n = key.rows
        meta = AttentionMetadata(
            slot_mapping=self.ws.view("slot_mapping", n),
            prefills=[],
            num_prefill_tokens=0,
            num_decodes=n,
            decode_block_tables=self.ws.buffer("block_tables")[:n, : key.pages],
            decode_context_lens=self.ws.view("context_lens", n),
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
        )
        self._forward(n, meta, n, n, key.flags, keep=True)
        if self.graphs.mode == "cuda":  # under capture: the graph's own tensors, which each replay refills
            self._graph_sampled[key] = self._sampled  # ("eager" keeps only the last step's, in `_sampled`)

    def _resample_uncovered(self, n: int) -> None:
        """Rows whose kept set the device sampler's candidates may not cover are
        sampled again by the reference sampler (a full sort), from the same logits
        and uniforms; the other rows keep the device sampler's tokens."""
        uncovered = (~self.ws.view("out_covered", n)).nonzero().squeeze(1)
        if uncovered.numel() == 0:
            return
        logits, batch = self._sampled.logits, self._sampled.batch
        tokens, logprobs = self.ws.view("out_tokens", n), self.ws.view("out_logprobs", n)
        sub_tokens, sub_logprobs = tokens[uncovered], logprobs[uncovered]
        sample(logits.index_select(0, uncovered), batch.rows(uncovered), sub_tokens, sub_logprobs)
        tokens.index_copy_(0, uncovered, sub_tokens)
        logprobs.index_copy_(0, uncovered, sub_logprobs)

    def _fix_raw(self, n: int) -> None:
        tokens, logprobs = self.ws.view("out_tokens", n), self.ws.view("out_logprobs", n)
        raw = self.ws.view("mode", n) == MODE_CODES["raw"]
        lp = torch.log_softmax(self._reported, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        logprobs.copy_(torch.where(raw, lp, logprobs))

    # -- host-built inputs ---------------------------------------------------------------
    def _decode_rows(self, plan: StepPlan) -> DecodeRows:
        """The host truth of a pure decode's inputs (its rows read without making its chunks)."""
        if plan.pure_decode:
            seqs, positions = plan.decodes, plan.starts
        else:  # a plan made of chunks that are all decodes (`_is_pure_decode`)
            seqs, positions = [c.seq for c in plan.chunks], [c.start for c in plan.chunks]
        rows = list(range(len(seqs)))
        in_flight = [r for r, s in enumerate(seqs) if s.pending]  # fed on the device, see `feed_in_flight`
        return DecodeRows(
            input_ids=[s.token_ids[-1] if not s.pending else 0 for s in seqs],
            positions=positions,
            context_lens=[p + 1 for p in positions],
            rng_pos=[s.next_rng_pos for s in seqs],
            sampling={**_sampling_values(seqs), "logit_rows": rows, "sample_rows": rows},
            in_flight=in_flight,
        )

    def _upload_general(self, chunks: list[ScheduledChunk]) -> int:
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        sample_rows: list[int] = []
        context_lens: list[int] = []
        for c in chunks:
            ids.extend(c.seq.token_ids[c.start : c.start + c.length])
            if len(ids) < len(positions) + c.length:  # its last token is still on the device: fed there
                ids.append(0)
            positions.extend(range(c.start, c.start + c.length))
            if c.length == 1:
                context_lens.append(c.start + 1)
            if c.samplers:
                logit_rows.append(len(ids) - 1)
                sample_rows.extend([len(logit_rows) - 1] * len(c.samplers))
        samplers = [s for c in chunks for s in c.samplers]
        self.ws.upload("input_ids", ids)
        self.ws.upload("positions", positions)
        self.ws.upload("context_lens", context_lens)
        self.ws.upload("logit_rows", logit_rows)
        self.ws.upload("sample_rows", sample_rows)
        self.ws.upload("rng_pos", [s.next_rng_pos for s in samplers])
        for name, values in _sampling_values(samplers).items():
            self.ws.upload(name, values)
        return len(logit_rows)

    def _attention_metadata(self, plan: StepPlan) -> AttentionMetadata:
        """Slots and decode block tables on the device (see `step_metadata`); checked against
        the host-built ones in the decode cache's debug mode."""
        kernels = (self.decode_kernel, self.prefill_kernel)
        return attention_metadata(self.ws, plan, self.page_size, *kernels, check=self.cache.debug)

    def _sampling_batch(self, n: int, flags: SamplerFlags) -> SamplingBatch:
        return SamplingBatch(**{name: self.ws.view(name, n) for name in SAMPLING_FIELDS}, flags=flags)


def _is_pure_decode(chunks: list[ScheduledChunk]) -> bool:
    """Every row decodes one token of its own sequence (a chunk's first sampler is its sequence)."""
    return all(c.length == 1 and len(c.samplers) == 1 for c in chunks)


def _sampling_values(seqs: list[Sequence]) -> dict[str, list]:
    params = [s.request.params for s in seqs]  # top_k capped at the vocabulary by make_requests
    return {
        "temperature": [float(p.temperature) for p in params],
        "top_k": [p.top_k for p in params],
        "top_p": [float(p.top_p) for p in params],
        "min_p": [float(p.min_p) for p in params],
        "seed": [s.request.seed for s in seqs],
        "sample_index": [s.sample_index for s in seqs],
        "mode": [MODE_CODES[p.logprobs_mode] for p in params],
    }
