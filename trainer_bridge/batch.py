"""`RolloutBatch`: one row per sample, padded tensors ready for a training
forward and loss, with the rollout logprobs, per-token versions and the
sampling settings the trainer needs to recompute the same logprobs. Built
from `generate` outputs (one row per sample) or from multi-turn episodes
(one row per episode, the loss mask covering only the sampled tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from rollout import RolloutOutput, Sample, SamplingParams
from rollout.engine.penalties import has_penalties
from rollout.engine.sampler import MODE_CODES
from rollout.episodes import Episode


@dataclass
class RolloutBatch:
    """One row per sample of a rollout call, as padded tensors.

    Prompts are left-padded so every prompt ends at column `P - 1` and the
    logits at `[P - 1, P + R - 1)` predict the response tokens; responses are
    right-padded. `from_outputs` builds it; `token_logprobs` reads it.
    """

    prompt_ids: torch.Tensor  # [B, P] int64, left-padded with pad_token_id
    prompt_mask: torch.Tensor  # [B, P] int64, 1 on real prompt tokens
    response_ids: torch.Tensor  # [B, R] int64, right-padded
    response_mask: torch.Tensor  # [B, R] int64, 1 on generated tokens
    old_logprobs: torch.Tensor  # [B, R] float32 rollout logprobs (0 on padding)
    versions: torch.Tensor  # [B, R] int64 policy version of each token (-1 on padding)
    group_index: torch.Tensor  # [B] int64: which prompt of the call the row answers
    sample_index: torch.Tensor  # [B] int64: which of that prompt's n samples
    temperature: torch.Tensor  # [B] float32 sampling settings of each row
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    logprobs_mode: torch.Tensor  # [B] int64 rollout.engine.sampler.MODE_CODES
    finish_reasons: list[str] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)
    policy_version: int = 0  # the policy version when the batch was assembled
    mismatch: dict[str, float] | None = None  # set by token_logprobs: rollout vs trainer
    rewards: torch.Tensor | None = None  # [B] float32 episode returns (from_episodes), else None
    # [B, R] int64, 1 on every real response token, observations included; None: response_mask
    # (one turn, where every response token is sampled). Attention uses it, the loss response_mask.
    response_attention: torch.Tensor | None = None
    prompts: list = field(default_factory=list)  # per group, the prompt as submitted (TrainerBridge.collect)
    collect_stats: dict = field(default_factory=dict)  # what collect dropped, aborted, carried, refilled
    # [B, P + R, sparse layers, top_k] int64, aligned with input_ids: the experts the engine routed each
    # position to (mixture-of-experts rollouts with return_routed_experts); -1 on padding and on each
    # response's last token, which no forward computed. None when the outputs carry no routing.
    routed_experts: torch.Tensor | None = None
    # On-policy distillation (`distill.teacher_logprobs`): the teacher's logprob of each response token
    # [B, R] (0 on padding), and with top-k its k most likely tokens per position [B, R, k] (-inf padding).
    teacher_logprobs: torch.Tensor | None = None
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_logprobs: torch.Tensor | None = None
    # Penalties and biases (rollout/engine/penalties.py), [B] float32 each; None when no row has any.
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    logit_bias: list = field(default_factory=list)  # per row {token id: bias} or None; empty without penalties

    @classmethod
    def from_outputs(
        cls,
        outputs: list[RolloutOutput],
        params: SamplingParams | list[SamplingParams],
        policy_version: int,
        pad_token_id: int = 0,
    ) -> RolloutBatch:
        """One row per sample. `params`: the settings every output was sampled
        with, or a list giving each output its own (groups carried from an
        earlier step keep theirs); each row's `temperature`, `top_k`, `top_p`,
        `min_p` and `logprobs_mode` come from its output's settings."""
        per_output = _per_output(params, len(outputs))
        rows = [
            (out.index if out.index is not None else g, k, out, s, per_output[g])
            for g, out in enumerate(outputs)
            for k, s in enumerate(out.samples)
        ]
        if not rows:
            raise ValueError("no samples to batch")
        b = len(rows)
        p = max(len(out.prompt_token_ids) for _, _, out, *_ in rows)
        r = max(1, max(len(s.token_ids) for *_, s, _ in rows))
        prompt_ids = torch.full((b, p), pad_token_id, dtype=torch.int64)
        prompt_mask = torch.zeros((b, p), dtype=torch.int64)
        response_ids = torch.full((b, r), pad_token_id, dtype=torch.int64)
        response_mask = torch.zeros((b, r), dtype=torch.int64)
        old_logprobs = torch.zeros((b, r), dtype=torch.float32)
        versions = torch.full((b, r), -1, dtype=torch.int64)
        for i, (_, _, out, s, _) in enumerate(rows):
            n_p, n_r = len(out.prompt_token_ids), len(s.token_ids)
            prompt_ids[i, p - n_p :] = torch.tensor(out.prompt_token_ids)
            prompt_mask[i, p - n_p :] = 1
            if n_r:
                response_ids[i, :n_r] = torch.tensor(s.token_ids)
                response_mask[i, :n_r] = 1
                old_logprobs[i, :n_r] = torch.tensor(s.logprobs)
                versions[i, :n_r] = torch.tensor(s.versions)
        return cls(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            old_logprobs,
            versions,
            group_index=torch.tensor([g for g, *_ in rows]),
            sample_index=torch.tensor([k for _, k, *_ in rows]),
            **_distribution_columns([settings for *_, settings in rows]),
            finish_reasons=[s.finish_reason for *_, s, _ in rows],
            texts=[s.text for *_, s, _ in rows],
            policy_version=policy_version,
            routed_experts=_routed_columns([(out, s) for _, _, out, s, _ in rows], p, r),
        )

    @classmethod
    def from_episodes(
        cls,
        episodes: list[Episode],
        params: SamplingParams | list[SamplingParams],
        policy_version: int,
        group_size: int = 1,
        pad_token_id: int = 0,
    ) -> RolloutBatch:
        """One row per multi-turn episode: the prompt is the episode's first
        prompt, the response everything after it (sampled turns and
        observations), and `response_mask` its loss mask, 1 exactly on the
        sampled tokens. Episodes `[g * group_size, (g + 1) * group_size)` form
        GRPO group g. `rewards` holds each episode's return, `routed_experts`
        each episode's routing when every episode carries it (the positions
        after the last turn's final token, never computed, are -1). `params` are the
        turns' settings as `run_episodes` took them; turns may differ in length
        and stops, not in the distribution a trainer recomputes (temperature,
        top-k, top-p, min-p, logprobs_mode)."""
        if not episodes:
            raise ValueError("no episodes to batch")
        params = _one_distribution(params)
        if has_penalties(params):
            raise ValueError(
                "params has penalties or logit_bias: an episode's later turns count earlier turns as prompt, "
                "which its one row cannot tell apart, so multi-turn batches take none"
            )
        if group_size < 1 or len(episodes) % group_size:
            raise ValueError(f"group_size must divide the {len(episodes)} episodes, got {group_size}")
        outputs = []
        for e in episodes:
            k, routed = e.prompt_len, e.routed_experts
            prompt_routing, routing = (None, None) if routed is None else (routed[:k], routed[k:])
            sample = Sample(e.token_ids[k:], e.logprobs[k:], e.versions[k:], e.finish_reason, routed_experts=routing)
            outputs.append(RolloutOutput(e.token_ids[:k], [sample], prompt_routed_experts=prompt_routing))
        batch = cls.from_outputs(outputs, params, policy_version, pad_token_id)
        mask = torch.zeros_like(batch.response_mask)
        for i, e in enumerate(episodes):
            observed = e.loss_mask[e.prompt_len :]
            if observed:
                mask[i, : len(observed)] = torch.tensor(observed)
        n = len(episodes)
        return replace(
            batch,
            response_mask=mask,
            response_attention=batch.response_mask,
            group_index=torch.arange(n) // group_size,
            sample_index=torch.arange(n) % group_size,
            rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        )

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """[B, P + R] prompt then response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        response = self.response_mask if self.response_attention is None else self.response_attention
        return torch.cat([self.prompt_mask, response], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions counted from each row's first real token (left padding skipped)."""
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    @property
    def staleness(self) -> dict[str, float]:
        """How many versions behind `policy_version` the tokens are: max and mean."""
        lag = (self.policy_version - self.versions)[self.response_mask.bool()]
        if lag.numel() == 0:
            return {"max": 0.0, "mean": 0.0}
        return {"max": float(lag.max()), "mean": float(lag.float().mean())}

    def to(self, device: torch.device | str) -> RolloutBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def select(self, rows: torch.Tensor | list[int]) -> RolloutBatch:
        """The rows `rows`, in that order (lists follow)."""
        idx = torch.as_tensor(rows, dtype=torch.int64)
        picked = {
            f.name: getattr(self, f.name)[idx] for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)
        }
        names = ("finish_reasons", "texts", "logit_bias") if self.logit_bias else ("finish_reasons", "texts")
        lists = {name: [getattr(self, name)[i] for i in idx.tolist()] for name in names}
        return replace(self, **picked, **lists)


DISTRIBUTION = ("temperature", "top_k", "top_p", "min_p", "logprobs_mode")
INT64_MAX = torch.iinfo(torch.int64).max


def _one_distribution(params: SamplingParams | list[SamplingParams]) -> SamplingParams:
    turns = list(params) if isinstance(params, (list, tuple)) else [params]
    if not turns:
        raise ValueError("params is an empty list: give the turns' SamplingParams")
    for i, p in enumerate(turns[1:], 1):
        for name in DISTRIBUTION:
            if getattr(p, name) != getattr(turns[0], name):
                raise ValueError(
                    f"params[{i}].{name} differs from params[0]'s: one row's tokens are recomputed with one "
                    f"distribution, so turns may differ in {DISTRIBUTION} only across batches"
                )
    return turns[0]


def _routed_columns(rows: list[tuple[RolloutOutput, Sample]], p: int, r: int) -> torch.Tensor | None:
    """The rows' routed experts laid out as `input_ids` (see `RolloutBatch.routed_experts`);
    None unless every row has them."""
    if not rows or any(out.prompt_routed_experts is None or s.routed_experts is None for out, s in rows):
        return None
    shape = rows[0][0].prompt_routed_experts.shape[1:]
    routed = torch.full((len(rows), p + r, *shape), -1, dtype=torch.int64)
    for i, (out, s) in enumerate(rows):
        prompt = torch.from_numpy(out.prompt_routed_experts).long()
        routed[i, p - len(prompt) : p] = prompt
        routed[i, p : p + len(s.routed_experts)] = torch.from_numpy(s.routed_experts).long()
    return routed


def _per_output(params: SamplingParams | list[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
    if len(params) != count:
        raise ValueError(f"params must give one SamplingParams per output ({count}), got {len(params)}")
    return list(params)


def _distribution_columns(params: list[SamplingParams]) -> dict[str, torch.Tensor]:
    """Each row's sampling settings, as the `[B]` columns `token_logprobs` reads."""
    return {
        "temperature": torch.tensor([float(p.temperature) for p in params], dtype=torch.float32),
        # A k past the vocabulary keeps every token; past int64 it would not fit the column.
        "top_k": torch.tensor([min(p.top_k, INT64_MAX) for p in params], dtype=torch.int64),
        "top_p": torch.tensor([float(p.top_p) for p in params], dtype=torch.float32),
        "min_p": torch.tensor([float(p.min_p) for p in params], dtype=torch.float32),
        "logprobs_mode": torch.tensor([MODE_CODES[p.logprobs_mode] for p in params], dtype=torch.int64),
        **_penalty_columns(params),
    }


def _penalty_columns(params: list[SamplingParams]) -> dict:
    if not any(has_penalties(p) for p in params):
        return {}
    names = ("frequency_penalty", "presence_penalty", "repetition_penalty")
    columns = {name: torch.tensor([getattr(p, name) for p in params], dtype=torch.float32) for name in names}
    return {**columns, "logit_bias": [p.logit_bias for p in params]}
