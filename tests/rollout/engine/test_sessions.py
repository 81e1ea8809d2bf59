"""Multi-turn sessions on the engine: the trajectory is exactly the prompt,
the sampled tokens and the observations; sampled logprobs equal a
teacher-forced transformers forward of the whole trajectory; a turn computes
only what was added since the last; weight pushes between turns; sessions
from threads and asyncio batch together and give the seeded results of
sessions run one by one; bad input changes nothing."""

from __future__ import annotations

import asyncio
import copy
import random
import threading

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import Checkpoint, make_engine
from tests.factories import _randomize, fail_launch, make_checkpoint

VOCAB = 96


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory) -> Checkpoint:
    """A tiny qwen2 with room for 50 turns."""
    path = tmp_path_factory.mktemp("ckpt_sessions")
    return Checkpoint(path, make_checkpoint(path, "qwen2", seed=5, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def hf_b(long_ckpt):
    model = copy.deepcopy(long_ckpt.hf)
    _randomize(model, seed=123)
    return model


def teacher_forced(hf, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 under `hf` (float64), index i - 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def assert_matches_reference(sess, refs: dict[int, torch.nn.Module]) -> None:
    """Every sampled token's logprob equals the teacher-forced forward of the
    whole trajectory under the model of its version."""
    ids = sess.token_ids
    forced = {v: teacher_forced(hf, ids) for v, hf in refs.items()}
    sampled = 0
    for i, (m, lp, v) in enumerate(zip(sess.loss_mask, sess.logprobs, sess.versions, strict=True)):
        if m:
            assert i > 0 and abs(lp - forced[v][i - 1].item()) < 1e-4, f"token {i} (version {v})"
            sampled += 1
        else:
            assert lp == 0.0 and v == -1
    assert sampled == sum(len(s.token_ids) for s in sess.samples)


def params(max_tokens: int, seed: int | None = 7) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, logprobs_mode="raw")


def test_fifty_turns_are_token_exact_and_match_transformers(long_ckpt):
    engine = make_engine(long_ckpt.path, max_seq_len=1024)
    rng = random.Random(0)
    prompt = [rng.randrange(3, VOCAB) for _ in range(7)]
    expected_ids, expected_mask = list(prompt), [0] * len(prompt)
    with engine.session(prompt) as sess:
        for turn in range(50):
            s = sess.generate(params(rng.randint(1, 6), seed=turn))
            assert len(s.token_ids) == len(s.logprobs) == len(s.versions) >= 1
            expected_ids += s.token_ids
            expected_mask += [1] * len(s.token_ids)
            obs = [rng.randrange(0, VOCAB) for _ in range(rng.randint(1, 6))]
            assert sess.append(obs) == obs
            expected_ids += obs
            expected_mask += [0] * len(obs)
        assert sess.token_ids == expected_ids and sess.loss_mask == expected_mask
        assert len(sess.logprobs) == len(sess.versions) == len(expected_ids)
        assert sess.num_turns == 50 and set(sess.versions) == {-1, 0}
        assert_matches_reference(sess, {0: long_ckpt.hf})


def test_a_turn_computes_only_what_was_added_since_the_last(long_ckpt):
    engine = make_engine(long_ckpt.path, max_seq_len=1024)
    sess = engine.session(list(range(3, 43)))  # 40 tokens: its last page is partly filled
    s1 = sess.generate(params(5))
    computed = engine.stats()["computed_tokens"]
    assert engine.stats()["session_leases"] == 1
    sess.append([9, 10, 11])
    s2 = sess.generate(params(4))
    # The last sampled token of turn 1 (never computed) and the 3 observed ones
    # as one chunk, then one per decode step after the first sampled token.
    assert engine.stats()["computed_tokens"] - computed == 1 + 3 + (len(s2.token_ids) - 1)
    assert len(s1.token_ids) == 5 and len(s2.token_ids) == 4
    assert_matches_reference(sess, {0: long_ckpt.hf})
    pages = engine.stats()["kv_pages_leased"]
    assert pages == -(-(len(sess.token_ids) - 1) // 16)
    sess.close()
    assert engine.stats()["kv_pages_leased"] == 0 and engine.stats()["session_leases"] == 0
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("inflight", ["recompute", "keep"])
def test_weight_push_between_turns(long_ckpt, hf_b, inflight):
    engine = make_engine(long_ckpt.path, max_seq_len=1024)
    sess = engine.session(list(range(3, 30)))
    sess.generate(params(6))
    sess.append([4, 5])
    engine.update_weights(hf_b.state_dict(), inflight=inflight)
    computed = engine.stats()["computed_tokens"]
    s = sess.generate(params(5))
    assert s.versions == [1] * 5
    added = engine.stats()["computed_tokens"] - computed
    if inflight == "recompute":
        # Old-version KV is never reused: the whole context is computed again.
        assert added == len(sess.token_ids) - 1
        ids = sess.token_ids
        forced = teacher_forced(hf_b, ids)
        tail = range(len(ids) - 5, len(ids))
        assert all(abs(sess.logprobs[i] - forced[i - 1].item()) < 1e-4 for i in tail)
        assert_matches_reference(_first_turn(sess), {0: long_ckpt.hf})
    else:
        # "keep": the session goes on with its KV; only the new tokens are computed.
        assert added == 1 + 2 + 4
    sess.close()


def _first_turn(sess):
    """A view of `sess` whose later turns are masked out (checked elsewhere)."""
    first = len(sess.token_ids) - len(sess.samples[-1].token_ids)

    class View:
        token_ids = sess.token_ids
        loss_mask = sess.loss_mask[:first] + [0] * (len(sess.token_ids) - first)
        logprobs = sess.logprobs[:first] + [0.0] * (len(sess.token_ids) - first)
        versions = sess.versions[:first] + [-1] * (len(sess.token_ids) - first)
        samples = sess.samples[:-1]

    return View


def _episode(engine, k: int) -> list[int]:
    rng = random.Random(k)
    with engine.session([rng.randrange(3, VOCAB) for _ in range(5 + k)]) as sess:
        for turn in range(4):
            sess.generate(SamplingParams(max_tokens=3 + turn, ignore_eos=True, seed=100 * k + turn))
            sess.append([rng.randrange(0, VOCAB) for _ in range(2)])
        return sess.token_ids, sess.logprobs


def test_sessions_in_threads_and_asyncio_match_sessions_run_one_by_one(long_ckpt):
    engine = make_engine(long_ckpt.path, max_seq_len=1024)
    alone = [_episode(engine, k) for k in range(8)]

    results: dict[int, tuple] = {}
    barrier = threading.Barrier(8, timeout=60)

    def worker(k: int) -> None:
        barrier.wait()
        results[k] = _episode(engine, k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[k][0] for k in range(8)] == [a[0] for a in alone]
    for k in range(8):
        assert torch.allclose(torch.tensor(results[k][1]), torch.tensor(alone[k][1]), atol=1e-5)

    async def episode_async(k: int):
        rng = random.Random(k)
        with engine.session([rng.randrange(3, VOCAB) for _ in range(5 + k)]) as sess:
            for turn in range(4):
                await sess.generate_async(SamplingParams(max_tokens=3 + turn, ignore_eos=True, seed=100 * k + turn))
                sess.append([rng.randrange(0, VOCAB) for _ in range(2)])
            return sess.token_ids, sess.logprobs

    async def main():
        return await asyncio.gather(*(episode_async(k) for k in range(8)))

    concurrent = asyncio.run(main())
    assert [c[0] for c in concurrent] == [a[0] for a in alone]
    assert engine.stats()["kv_pages_used"] == 0


def test_idle_sessions_give_way_under_kv_pressure(long_ckpt):
    engine = make_engine(long_ckpt.path, max_seq_len=1024, kv_cache_tokens=256, max_batch_size=4)
    sessions = [engine.session(list(range(3 + k, 60 + k))) for k in range(4)]
    for sess in sessions:
        sess.generate(params(3))
    assert engine.stats()["kv_pages_leased"] == 4 * 4  # 59 tokens of KV each: 4 pages of 16
    # A request that needs most of the pool runs: the leases are released, oldest first.
    (out,) = engine.generate([[3 + i % 90 for i in range(195)]], params(20))
    assert len(out.samples[0].token_ids) == 20
    recomputed = engine.stats()["recomputed_tokens"]
    for sess in sessions:  # and every session still continues exactly, recomputing what it lost
        sess.append([7])
        sess.generate(params(2))
        assert_matches_reference(sess, {0: long_ckpt.hf})
        sess.close()
    assert engine.stats()["kv_pages_used"] == 0
    # What the released leases held and the prefix cache no longer did is counted as recomputed.
    assert 0 < engine.stats()["recomputed_tokens"] - recomputed <= 4 * 59


def test_bad_session_input_is_refused_and_changes_nothing(long_ckpt):
    engine = make_engine(long_ckpt.path, max_seq_len=64)
    with pytest.raises(TypeError, match="prompt"):
        engine.session(3.5)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.session(list(range(3, 67)))
    sess = engine.session([3, 4, 5])
    sess.generate(params(2))
    before = (sess.token_ids, sess.loss_mask, sess.logprobs, sess.versions)
    with pytest.raises(ValueError, match="n must be 1"):
        sess.generate(SamplingParams(n=2))
    with pytest.raises(ValueError, match="prompt_logprobs is not supported on a session turn"):
        sess.generate(SamplingParams(prompt_logprobs=0))
    with pytest.raises(TypeError, match="params"):
        sess.generate({"max_tokens": 3})
    with pytest.raises(ValueError, match="vocabulary"):
        sess.append([5, VOCAB])
    with pytest.raises(TypeError, match="observation"):
        sess.append(4.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        sess.append(list(range(3, 63)))
    with pytest.raises(ValueError, match="tokenizer"):
        sess.append("text needs a tokenizer")
    assert (sess.token_ids, sess.loss_mask, sess.logprobs, sess.versions) == before
    sess.close()
    with pytest.raises(ValueError, match="closed"):
        sess.generate(params(2))
    with pytest.raises(ValueError, match="closed"):
        sess.append([3])
    assert sess.token_ids == before[0]


def test_weight_push_during_a_turn_follows_recompute(long_ckpt, hf_b):
    """A push in the middle of a turn: the turn's tokens switch version, and each
    matches the teacher-forced forward of the whole trajectory under its own
    version's weights (recompute: the new version's tokens see new-version KV)."""
    state = {"armed": False, "steps": 0}

    def push_mid_turn(info):  # runs on the stepping thread, between steps
        if state["armed"]:
            state["steps"] += 1
            if state["steps"] == 3:
                engine.update_weights(hf_b.state_dict(), inflight="recompute")

    engine = make_engine(long_ckpt.path, max_seq_len=1024, step_callback=push_mid_turn)
    with engine.session(list(range(3, 40))) as sess:
        sess.generate(params(4))
        sess.append([5, 6, 7])
        state["armed"] = True
        turn = sess.generate(params(8))
        assert turn.versions == [0, 0, 0] + [1] * 5
        assert_matches_reference(sess, {0: long_ckpt.hf, 1: hf_b})


class StepWatch:
    """A step callback that sets `stepped` after a step once armed."""

    def __init__(self) -> None:
        self.armed, self.stepped = False, threading.Event()

    def __call__(self, info) -> None:
        if self.armed:
            self.stepped.set()


def test_a_cancelled_turn_leaves_the_session_as_it_was(long_ckpt):
    watch = StepWatch()
    engine = make_engine(long_ckpt.path, max_seq_len=1024, step_callback=watch)
    sess = engine.session(list(range(3, 30)))
    sess.generate(params(3))
    before = sess.token_ids

    async def cancel_mid_turn():
        watch.armed = True
        task = asyncio.ensure_future(sess.generate_async(params(400)))
        assert await asyncio.get_running_loop().run_in_executor(None, watch.stepped.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_mid_turn())
    watch.armed = False
    assert sess.token_ids == before and sess.num_turns == 1
    sess.append([4, 5])
    sess.generate(params(3))  # continues from its own tokens, not the cancelled turn's
    assert_matches_reference(sess, {0: long_ckpt.hf})
    sess.close()
    assert engine.stats()["kv_pages_used"] == 0 and engine.stats()["session_leases"] == 0


def test_a_failed_step_fails_the_turn_and_the_session_goes_on(long_ckpt, monkeypatch):
    engine = make_engine(long_ckpt.path, max_seq_len=1024)
    sess = engine.session(list(range(3, 40)))
    sess.generate(params(3))
    fail_launch(engine, monkeypatch, at=3)
    before = sess.token_ids
    with pytest.raises(RuntimeError, match="device fell over"):
        sess.generate(params(6))
    assert sess.token_ids == before
    sess.generate(params(4))
    assert_matches_reference(sess, {0: long_ckpt.hf})
    sess.close()
    assert engine.stats()["kv_pages_used"] == 0


def test_close_never_waits_for_a_turn_under_way(long_ckpt):
    watch = StepWatch()
    engine = make_engine(long_ckpt.path, max_seq_len=1024, step_callback=watch)
    sess = engine.session(list(range(3, 30)))
    result: dict = {}
    watch.armed = True
    worker = threading.Thread(target=lambda: result.setdefault("turn", sess.generate(params(400))))
    worker.start()
    assert watch.stepped.wait(30)
    sess.close()  # returns while the 400-token turn still runs
    assert worker.is_alive()
    worker.join(120)
    assert len(result["turn"].token_ids) == 400
    assert engine.stats()["kv_pages_used"] == 0  # the closed session's turn gave its pages back
    with pytest.raises(ValueError, match="closed"):
        sess.generate(params(2))
