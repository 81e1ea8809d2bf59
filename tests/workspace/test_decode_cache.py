"""Property-based test of the decode cache: random admissions, finishes, slot
reuse, reorders, mixed steps and policy changes; the fast path must always
leave exactly the inputs the host path would build."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workspace import DecodeCache, DecodeCacheMismatch, DecodeRows, InferenceWorkspace, TaskSignature, WorkspaceShape
from workspace.decode_cache import ADVANCED, REUSED

MAX_ROWS = 8


class Seq:
    def __init__(self, seq_id: int, rng) -> None:
        self.seq_id = seq_id
        self.last_token = rng.randint(0, 999)
        self.position = rng.randint(0, 50)
        self.rng_pos = rng.randint(0, 20)
        self.params = dict(
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.1]),
            seed=rng.randint(0, 2**40),
            sample_index=rng.randint(0, 7),
            mode=rng.randint(0, 2),
        )


def host_rows(batch: list[Seq]) -> DecodeRows:
    rows = list(range(len(batch)))
    sampling = {k: [s.params[k] for s in batch] for k in batch[0].params}
    return DecodeRows(
        input_ids=[s.last_token for s in batch],
        positions=[s.position for s in batch],
        context_lens=[s.position + 1 for s in batch],
        rng_pos=[s.rng_pos for s in batch],
        sampling={**sampling, "logit_rows": rows, "sample_rows": rows},
    )


def assert_inputs_equal(ws: InferenceWorkspace, rows: DecodeRows) -> None:
    for name, values in rows.values().items():
        got = ws.view(name, len(values))
        assert torch.equal(got, torch.tensor(values, dtype=got.dtype)), name


ACTIONS = st.sampled_from(["steady", "steady", "steady", "finish", "admit", "reuse_slot", "swap", "mixed", "version"])


@settings(max_examples=150, deadline=None)
@given(actions=st.lists(ACTIONS, min_size=1, max_size=40), seed=st.integers(0, 2**32 - 1))
def test_fast_path_always_produces_host_inputs(actions, seed):
    import random

    rng = random.Random(seed)
    ws = InferenceWorkspace(WorkspaceShape(64, MAX_ROWS, 4), "cpu")
    cache = DecodeCache(ws)
    next_id = iter(range(10**6))
    batch = [Seq(next(next_id), rng) for _ in range(rng.randint(1, MAX_ROWS))]
    version = 0
    for action in actions:
        if action == "finish" and len(batch) > 1:
            batch.pop(rng.randrange(len(batch)))
        elif action == "admit" and len(batch) < MAX_ROWS:
            batch.insert(rng.randrange(len(batch) + 1), Seq(next(next_id), rng))
        elif action == "reuse_slot":
            # A new sequence lands in a finished one's row: same batch shape, new id.
            batch[rng.randrange(len(batch))] = Seq(next(next_id), rng)
        elif action == "swap" and len(batch) > 1:
            i, j = rng.sample(range(len(batch)), 2)
            batch[i], batch[j] = batch[j], batch[i]
        elif action == "version":
            version += 1
        elif action == "mixed":
            # A prefill step overwrote the buffers with other rows.
            for name in (*REUSED, *ADVANCED, "input_ids"):
                ws.buffer(name).fill_(7)
            cache.invalidate()
        signature = TaskSignature(version, tuple(s.seq_id for s in batch))
        cache.prepare(signature, lambda: host_rows(batch))
        assert_inputs_equal(ws, host_rows(batch))
        # The sampler writes this step's tokens; the host records them.
        sampled = [rng.randint(0, 999) for _ in batch]
        ws.view("out_tokens", len(batch)).copy_(torch.tensor(sampled))
        for s, token in zip(batch, sampled, strict=True):
            s.last_token, s.position, s.rng_pos = token, s.position + 1, s.rng_pos + 1
        cache.remember(signature)


def test_steady_state_hits_and_membership_change_misses():
    import random

    rng = random.Random(0)
    ws = InferenceWorkspace(WorkspaceShape(16, 4, 2), "cpu")
    cache = DecodeCache(ws)
    batch = [Seq(i, rng) for i in range(3)]
    signature = TaskSignature(0, (0, 1, 2))
    assert not cache.prepare(signature, lambda: host_rows(batch))
    cache.remember(signature)
    assert cache.prepare(TaskSignature(0, (0, 1, 2)), lambda: pytest.fail("host path built on a hit"))
    cache.remember(signature)
    assert not cache.prepare(TaskSignature(0, (0, 1, 3)), lambda: host_rows(batch))
    cache.remember(signature)
    assert not cache.prepare(TaskSignature(1, (0, 1, 2)), lambda: host_rows(batch))  # a new policy version
    assert (cache.hits, cache.misses) == (1, 3)


def test_debug_switch_catches_a_divergent_fast_path():
    import random

    rng = random.Random(1)
    ws = InferenceWorkspace(WorkspaceShape(16, 4, 2), "cpu")
    cache = DecodeCache(ws, debug=True)
    batch = [Seq(i, rng) for i in range(2)]
    signature = TaskSignature(0, (0, 1))
    cache.prepare(signature, lambda: host_rows(batch))
    ws.view("out_tokens", 2).copy_(torch.tensor([5, 6]))
    cache.remember(signature)
    for s, token in zip(batch, [5, 6], strict=True):
        s.last_token, s.position, s.rng_pos = token, s.position + 1, s.rng_pos + 1
    cache.prepare(signature, lambda: host_rows(batch))  # agrees: no error
    ws.view("out_tokens", 2).copy_(torch.tensor([8, 9]))
    cache.remember(signature)
    batch[1].last_token = 10  # the host saw another token than the device sampled
    with pytest.raises(DecodeCacheMismatch, match="input_ids"):
        cache.prepare(signature, lambda: host_rows(batch))
