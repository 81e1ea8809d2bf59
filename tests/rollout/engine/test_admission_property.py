"""The KV page rule of prompt validation, against the scheduler itself.

Every `generate` call over small page budgets either raises `ValueError` up
front or completes. Both directions are checked: a refused prompt, forced
past validation, cannot complete alone either, so the rule refuses nothing
that would have finished. `max_step_tokens` stays at its default, above every
prompt here, so a prefill is one chunk and the prefix cache cannot change what
admission needs: there the rule is exact.
"""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from rollout import SamplingParams
from rollout.engine import requests as requests_module
from tests.conftest import make_engine

_ENGINES = {}


def _engine(path, pages: int, page_size: int, max_batch_size: int, max_seq_len: int):
    # Engines are reused across examples: a warm prefix cache is part of what
    # the rule must hold under, and building one per example is the slow part.
    key = (str(path), pages, page_size, max_batch_size, max_seq_len)
    if key not in _ENGINES:
        _ENGINES[key] = make_engine(
            path,
            kv_cache_tokens=pages * page_size,
            page_size=page_size,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
        )
    return _ENGINES[key]


def _fits_alone(prompt_len: int, n: int, max_tokens: int, page_size: int, pages: int, max_seq_len: int) -> bool:
    """The rule read for one request: admitting its group takes the prompt's
    pages plus one per further sample; its longest sample computes KV for
    all its tokens but the last."""
    outputs = min(max_tokens, max_seq_len - prompt_len)
    admit = -(-prompt_len // page_size) + n - 1
    longest = -(-(prompt_len + outputs - 1) // page_size)
    return admit <= pages and longest <= pages


def _prompt(length: int, start: int) -> list[int]:
    return [3 + (start + j) % 90 for j in range(length)]


@st.composite
def _cases(draw):
    page_size = draw(st.sampled_from([1, 4, 16]), "page_size")
    pages = draw(st.integers(1, 5), "pages")
    max_batch_size = draw(st.sampled_from([2, 4]), "max_batch_size")
    max_seq_len = draw(st.sampled_from([32, 256]), "max_seq_len")
    longest_prompt = min(max_seq_len - 1, (pages + 1) * page_size)
    lengths = draw(st.lists(st.integers(1, longest_prompt), min_size=1, max_size=3), "prompt lengths")
    # Two possible starts, so prompts repeat and hit the prefix cache.
    starts = draw(st.lists(st.integers(0, 1), min_size=len(lengths), max_size=len(lengths)), "starts")
    # Half the draws land next to a limit of the first prompt, where an off-by-one would show.
    prompt_pages = -(-lengths[0] // page_size)
    near_admit = st.integers(-1, 1).map(lambda d: min(max(pages - prompt_pages + 1 + d, 1), max_batch_size))
    n = draw(st.one_of(st.integers(1, max_batch_size), near_admit), "n")
    near_longest = st.integers(-2, 2).map(lambda d: max(pages * page_size - lengths[0] + 1 + d, 1))
    max_tokens = draw(st.one_of(st.integers(1, (pages + 1) * page_size), near_longest), "max_tokens")
    return page_size, pages, max_batch_size, max_seq_len, lengths, starts, n, max_tokens


@settings(max_examples=50, deadline=None)
@given(case=_cases())
@example(case=(16, 4, 4, 256, [40], [0], 4, 8))  # 40 prompt tokens, n=4, max_tokens=8 in 4 pages of 16
def test_generate_refuses_up_front_or_completes(qwen2, case):
    page_size, pages, max_batch_size, max_seq_len, lengths, starts, n, max_tokens = case
    engine = _engine(qwen2.path, pages, page_size, max_batch_size, max_seq_len)
    prompts = [_prompt(length, start) for length, start in zip(lengths, starts, strict=True)]
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=1)
    fits = [_fits_alone(len(p), n, max_tokens, page_size, pages, max_seq_len) for p in prompts]

    event("refused" if not all(fits) else "completed")
    if not all(fits):
        with pytest.raises(ValueError, match=r"n=.*max_tokens=.*kv_cache_tokens"):
            engine.generate(prompts, params)
        # Forced past validation, each refused prompt gets stuck on its own.
        with mock.patch.object(requests_module, "_check_fits", lambda *args: None):
            for p, ok in zip(prompts, fits, strict=True):
                if not ok:
                    with pytest.raises(RuntimeError, match="no progress"):
                        engine.generate([p], params)
    else:
        outs = engine.generate(prompts, params)
        for p, out in zip(prompts, outs, strict=True):
            assert len(out.samples) == n
            for s in out.samples:
                assert len(s.token_ids) == min(max_tokens, max_seq_len - len(p))
                assert s.finish_reason == "length"
    assert engine.stats()["kv_pages_used"] == 0 and not engine.scheduler.requests
