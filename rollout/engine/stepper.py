"""The Stepper: the one primitive that advances a planned set of sequences by
one step. It binds KV pages, runs prefill chunks and decodes through the
model, samples, and returns tokens, logprobs and the policy version. It never
changes request state: the scheduler does, from the returned result.

A step is three named parts: `_prepare` (page copies, the inputs in the
workspace, attention metadata), `_run` (a decode graph's replay, or the model
and sampler) and `_finish` (read the tokens and logprobs back, remember a
pure decode's signature for the next step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from workspace import DecodeCache, DecodeRows, InferenceWorkspace, KVPool, TaskSignature

from ..kernels.layer_ops import LayerOps
from ..model.attention import AttentionMetadata, PrefillSpan
from ..model.decoder import Model
from .decode_graphs import DecodeGraphs, GraphKey
from .penalties import StepPenalties, has_penalties
from .plan import ScheduledChunk, StepPlan, StepResult, TopLogprobs
from .sampler import MODE_CODES, SAMPLING_FIELDS, SamplerFlags, SamplingBatch, sample, top_logprobs
from .scoring import ScoreSpan, SpanScores, compute_scores, score_spans
from .sequence import Sequence


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
        self._sampled: SampledRows | None = None  # the last forward's logits, for `_resample_uncovered`
        self._graph_sampled: dict[GraphKey, SampledRows] = {}  # the same, per decode graph (its static tensors)
        self._flags = SamplerFlags(False, False, False)  # of the batch whose inputs the workspace holds
        self._penalized: list[Sequence] | None = None  # this step's rows when some have penalties
        self._reported: torch.Tensor | None = None  # with penalties: the logits each row's logprobs are reported in
        self._top: list[int] | None = None  # its rows' top_logprobs counts, when some row asks
        self.graphs = None
        if decode_graphs != "off":
            if scratch_page is None:
                raise ValueError("decode graphs need a scratch KV page for their padding rows")
            fixed_width = kernels is not None and kernels.tables_in_place  # one table width serves every step
            self.graphs = DecodeGraphs(
                decode_graphs, workspace, self._padded_decode, scratch_page, kv.page_size, fixed_width=fixed_width
            )

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepResult:
        """One step of `plan`: a token and its logprob per sampler row, in plan order."""
        prepared = self._prepare(plan)
        top, scores = self._run(plan, prepared)
        return self._finish(plan, prepared, top, scores)

    def _prepare(self, plan: StepPlan) -> PreparedStep:
        """Copy-on-write page copies, then the step's inputs into the workspace
        (a pure decode of the last step's sequences reuses them on the device)
        and its attention metadata."""
        self._copy_pages(plan.page_copies)
        samplers = plan.samplers
        num_rows = len(samplers)
        signature, spans = None, []
        if _is_pure_decode(plan.chunks):
            signature = TaskSignature(plan.version, tuple(s.seq_id for s in samplers))
            if not self.cache.prepare(signature, lambda: self._decode_rows(plan.chunks)):
                self._read_batch(samplers)  # a hit keeps the last batch's facts
            num_logits = num_rows
        else:
            num_logits = self._upload_general(plan.chunks)
            self._read_batch(samplers)
            spans = score_spans(plan.chunks)
        meta = self._attention_metadata(plan.chunks)
        self._penalized = samplers if any(has_penalties(s.request.params) for s in samplers) else None
        graph = None  # a graph keeps no logits, nor penalties (their histories change every step)
        if self.graphs is not None and signature is not None and self._top is None and self._penalized is None:
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

    def _run(self, plan: StepPlan, prepared: PreparedStep) -> RowExtras:
        """The model and sampler: tokens and logprobs land in the workspace's out buffers;
        the top logprobs of the rows that ask for them, and prompt logprobs, are returned."""
        self._reported = None  # set again by a forward with penalised rows; a graph never has any
        if prepared.graph is not None:
            self.graphs.run(prepared.num_rows, prepared.graph)
            self._sampled = self._graph_sampled.get(prepared.graph)
            return RowExtras(None, None)
        if self.graphs is not None:
            self.graphs.invalidate()  # this step's uploads may have overwritten the padding rows
        p = prepared
        return self._forward(plan.num_tokens, p.meta, p.num_logits, p.num_rows, p.flags, p.top, p.spans)

    def _finish(
        self, plan: StepPlan, prepared: PreparedStep, top: TopLogprobs | None, scores: list[SpanScores] | None
    ) -> StepResult:
        """Read the sampled rows back; a pure decode's signature lets the next step reuse its inputs."""
        n = prepared.num_rows
        if self.device_sample is not None and prepared.flags.any_filter:
            self._resample_uncovered(n)
        if self._reported is not None:  # rows reporting "raw" logprobs: the model's, unpenalised
            self._fix_raw(n)
        result = StepResult(
            self.ws.view("out_tokens", n).tolist(), self.ws.view("out_logprobs", n).tolist(), plan.version, top, scores
        )
        if prepared.signature is not None:
            self.cache.remember(prepared.signature)
        else:
            self.cache.invalidate()
        return result

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
            dev = self.kv.k.device
            self.kv.copy_pages(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))

    def _forward(
        self,
        num_tokens: int,
        meta: AttentionMetadata,
        num_logits: int,
        num_rows: int,
        flags: SamplerFlags,
        top: list[int] | None = None,
        spans: list[ScoreSpan] | None = None,
    ) -> RowExtras:
        """Model and sampler over the workspace's first rows; tokens and logprobs land in its
        out buffers. With `top` (per row, how many), the rows that ask get their top logprobs;
        with `spans`, their rows' logits score the prompt tokens that follow them."""
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
        if self.device_sample is not None:
            self.device_sample(logits, batch, tokens, logprobs, ws.view("out_covered", num_rows))
            self._sampled = SampledRows(logits, batch)
        else:
            sample(logits, batch, tokens, logprobs, self.sample_kernel)
        if top is None:
            return RowExtras(None, scores)
        rows = [r for r, k in enumerate(top) if k]
        index = torch.tensor(rows, device=logits.device)
        reported = logits if self._reported is None else self._reported
        ids, values = top_logprobs(reported.index_select(0, index), batch.rows(index), max(top))
        out: TopLogprobs = [None] * num_rows
        for r, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
            out[r] = tuple(zip(row_ids[: top[r]], row_values[: top[r]], strict=True))
        return RowExtras(out, scores)

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
        self._forward(n, meta, n, n, key.flags)
        if self._sampled is not None:  # under capture: the graph's own tensors, which each replay refills
            self._graph_sampled[key] = self._sampled

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
    def _decode_rows(self, chunks: list[ScheduledChunk]) -> DecodeRows:
        seqs = [c.seq for c in chunks]
        positions = [c.start for c in chunks]
        rows = list(range(len(seqs)))
        return DecodeRows(
            input_ids=[s.token_ids[-1] for s in seqs],
            positions=positions,
            context_lens=[p + 1 for p in positions],
            rng_pos=[s.num_output_tokens for s in seqs],
            sampling={**_sampling_values(seqs), "logit_rows": rows, "sample_rows": rows},
        )

    def _upload_general(self, chunks: list[ScheduledChunk]) -> int:
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        sample_rows: list[int] = []
        context_lens: list[int] = []
        for c in chunks:
            ids.extend(c.seq.token_ids[c.start : c.start + c.length])
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
        self.ws.upload("rng_pos", [s.num_output_tokens for s in samplers])
        for name, values in _sampling_values(samplers).items():
            self.ws.upload(name, values)
        return len(logit_rows)

    def _attention_metadata(self, chunks: list[ScheduledChunk]) -> AttentionMetadata:
        ps = self.page_size
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        device = self.ws.device
        for c in chunks:
            table = c.seq.block_table
            if c.length == 1:  # most rows of most steps
                page, offset = divmod(c.start, ps)
                slots.append(table[page] * ps + offset)
                decode_tables.append(table[: page + 1])
                continue
            slots.extend(table[p // ps] * ps + p % ps for p in range(c.start, c.start + c.length))
            block = torch.tensor(table[: -(-(c.start + c.length) // ps)], dtype=torch.int64, device=device)
            prefills.append(PrefillSpan(len(slots) - c.length, c.length, c.start + c.length, block))
        num_decodes = len(decode_tables)
        width = max((len(t) for t in decode_tables), default=0)
        return AttentionMetadata(
            slot_mapping=self.ws.upload("slot_mapping", slots),
            prefills=prefills,
            num_prefill_tokens=len(slots) - num_decodes,
            num_decodes=num_decodes,
            decode_block_tables=self.ws.upload_block_tables(decode_tables, width) if num_decodes else None,
            decode_context_lens=self.ws.view("context_lens", num_decodes) if num_decodes else None,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
        )

    def _sampling_batch(self, n: int, flags: SamplerFlags) -> SamplingBatch:
        return SamplingBatch(**{name: self.ws.view(name, n) for name in SAMPLING_FIELDS}, flags=flags)


def _is_pure_decode(chunks: list[ScheduledChunk]) -> bool:
    return all(c.length == 1 and len(c.samplers) == 1 and c.samplers[0] is c.seq for c in chunks)


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
