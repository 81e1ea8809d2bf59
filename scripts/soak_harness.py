"""A soak run of a rollout cluster: concurrent callers with random prompts
and sampling settings while weights are pushed on a timer, cycling through
every in-flight mode. Checks every sample, that nothing hangs, that the last
push serves exactly afterwards, and that resident memory stays flat."""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch

from rollout import INFLIGHT_MODES, Engine
from rollout.cluster.actor import resident_bytes
from rollout.cluster.cluster import RolloutCluster
from rollout.outputs import RolloutOutput
from rollout.sampling_params import LOGPROBS_MODES, SamplingParams


@dataclass(slots=True)
class SoakReport:
    seconds: float = 0.0
    calls: int = 0  # generate calls completed
    samples: int = 0
    tokens: int = 0
    pushes: int = 0
    pushes_by_mode: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)  # anything wrong, as text
    driver_rss_growth: float = 0.0  # last-quarter mean / first-quarter mean - 1
    actor_rss_growth: float = 0.0  # the worst actor's
    final_exact: bool = False  # the last push serves exactly as a fresh engine with those weights
    rss_series: dict = field(default_factory=dict)  # "driver" and actor pids -> resident bytes, every 0.5 s
    watchdog_faults: dict = field(default_factory=dict)  # actor index -> replacements, hangs, stalls at the end

    @property
    def ok(self) -> bool:
        return not self.errors and self.final_exact and self.driver_rss_growth < 0.1 and self.actor_rss_growth < 0.1


# A small cluster the soak harness and its test both run: 2 CPU actors, short sequences.
SOAK_CLUSTER = dict(
    num_actors=2,
    num_cpus_per_actor=1,
    max_seq_len=128,
    kv_cache_tokens=2048,
    max_batch_size=64,
    timeout_s=120,
    stall_timeout_s=120,
)


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        n=rng.randint(1, 4),
        temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
        top_k=rng.choice([0, 0, 5, 20]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        max_tokens=rng.randint(1, 48),
        stop_token_ids=rng.sample(range(vocab), rng.randint(0, 3)),
        seed=rng.choice([None, rng.randrange(2**31)]),
        logprobs_mode=rng.choice(LOGPROBS_MODES),
        ignore_eos=rng.random() < 0.5,
    )


def check_output(out: RolloutOutput, params: SamplingParams, vocab: int, max_version: int) -> list[str]:
    """Everything malformed about one prompt's output, as messages."""
    problems = []
    if len(out.samples) != params.n:
        problems.append(f"prompt {out.index}: {len(out.samples)} samples, expected {params.n}")
    for k, s in enumerate(out.samples):
        where = f"prompt {out.index} sample {k}"
        if not (len(s.token_ids) == len(s.logprobs) == len(s.versions)) or not s.token_ids:
            problems.append(f"{where}: lengths {len(s.token_ids)}/{len(s.logprobs)}/{len(s.versions)}")
            continue
        if s.finish_reason not in ("stop", "length") or len(s.token_ids) > params.max_tokens:
            problems.append(f"{where}: finish {s.finish_reason} with {len(s.token_ids)} tokens")
        if s.finish_reason == "length" and len(s.token_ids) != params.max_tokens:
            problems.append(f"{where}: 'length' after {len(s.token_ids)} of {params.max_tokens} tokens")
        if s.versions != sorted(s.versions) or s.versions[-1] > max_version:
            problems.append(f"{where}: versions {s.versions[:3]}..{s.versions[-3:]}")
        if not all(math.isfinite(lp) and lp <= 1e-6 for lp in s.logprobs):
            problems.append(f"{where}: bad logprobs")
        if not all(0 <= t < vocab for t in s.token_ids):
            problems.append(f"{where}: token outside the vocabulary")
    return problems


def soak(
    cluster: RolloutCluster,
    states: list[dict[str, torch.Tensor]],
    seconds: float,
    callers: int = 4,
    push_every: float = 0.5,
    seed: int = 0,
) -> SoakReport:
    """Run the load for `seconds`; `states` are the weights pushed in turn (the last one last)."""
    load = _Load(cluster, states, push_every, seed)
    threads = [
        threading.Thread(target=load.caller, args=(i,), name=f"soak-caller-{i}", daemon=True) for i in range(callers)
    ]
    threads += [
        threading.Thread(target=load.pusher, name="soak-pusher", daemon=True),
        threading.Thread(target=load.sampler, name="soak-memory", daemon=True),
    ]
    start = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    load.stop.set()
    report = load.report
    for t in threads:
        t.join(180)
        if t.is_alive():
            report.errors.append(f"{t.name} did not stop within 180 s (hang)")
    report.seconds = time.monotonic() - start
    report.rss_series = {"driver": load.driver_rss, **{str(k): v for k, v in load.actor_rss.items()}}
    report.driver_rss_growth = growth(load.driver_rss)
    report.actor_rss_growth = max(
        (growth(v) for k, v in load.actor_rss.items() if isinstance(k, int) and len(v) >= 4), default=0.0
    )
    report.final_exact = final_push_serves_exactly(cluster, states[-1])
    # Nothing hangs in a soak: any actor the watchdog replaced is a false detection.
    report.watchdog_faults = {
        h["index"]: {k: h.get(k, 0) for k in ("replacements", "hangs", "stalls")} for h in cluster.health()
    }
    for index, faults in report.watchdog_faults.items():
        if any(faults.values()):
            report.errors.append(f"actor {index} was replaced with nothing wrong: {faults}")
    return report


class _Load:
    """The soak's threads: callers, the pusher and the memory sampler, sharing one report."""

    def __init__(self, cluster: RolloutCluster, states, push_every: float, seed: int) -> None:
        self.cluster, self.states, self.push_every, self.seed = cluster, states, push_every, seed
        self.report = SoakReport()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.vocab = cluster._limits.vocab_size
        self.driver_rss: list[int] = []
        self.actor_rss: dict = {}  # pid -> all resident bytes; "pid-private"/"pid-shared" -> the split

    def caller(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while not self.stop.is_set():
            prompts = [[rng.randrange(self.vocab) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 6))]
            params = random_params(rng, self.vocab)
            try:
                outs = self.cluster.generate(prompts, params, timeout=120)
                # While a push commits, actors that committed already serve its version.
                newest = self.cluster.policy_version() + 1
                problems = [p for out in outs for p in check_output(out, params, self.vocab, newest)]
            except Exception as e:  # recorded, and the soak fails
                problems, outs = [f"caller {index}: {type(e).__name__}: {e}"], []
            with self.lock:
                self.report.calls += 1
                self.report.samples += sum(len(o.samples) for o in outs)
                self.report.tokens += sum(len(s.token_ids) for o in outs for s in o.samples)
                self.report.errors.extend(problems)

    def pusher(self) -> None:
        k = 0
        while not self.stop.wait(self.push_every):
            mode = INFLIGHT_MODES[k % len(INFLIGHT_MODES)]
            try:
                self.cluster.push_weights(self.states[k % (len(self.states) - 1)], inflight=mode)
            except Exception as e:  # recorded, and the soak fails
                with self.lock:
                    self.report.errors.append(f"push {k} ({mode}): {type(e).__name__}: {e}")
            with self.lock:
                self.report.pushes += 1
                self.report.pushes_by_mode[mode] = self.report.pushes_by_mode.get(mode, 0) + 1
            k += 1

    def sampler(self) -> None:
        while not self.stop.wait(0.5):
            self.driver_rss.append(resident_bytes())
            for h in self.cluster.health():
                if h.get("rss_bytes"):
                    self.actor_rss.setdefault(h["pid"], []).append(h["rss_bytes"])
                    self.actor_rss.setdefault(f"{h['pid']}-private", []).append(h["rss_private_bytes"])
                    self.actor_rss.setdefault(f"{h['pid']}-shared", []).append(h["rss_shared_bytes"])


def growth(samples: list[int]) -> float:
    """Mean of the last quarter over the mean of the first quarter, minus one."""
    if len(samples) < 4:
        return 0.0
    q = len(samples) // 4
    return statistics.mean(samples[-q:]) / statistics.mean(samples[:q]) - 1


def final_push_serves_exactly(cluster: RolloutCluster, state: dict[str, torch.Tensor]) -> bool:
    """Push `state`, then compare greedy rollouts with a fresh in-process engine given the same weights."""
    version = cluster.push_weights(state)
    prompts = [[3, 4, 5], [7] * 12, list(range(1, 30))]
    params = SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True)
    served = cluster.generate(prompts, params, timeout=120)
    engine = Engine(cluster.model_path, **cluster._engine_kwargs)
    engine.update_weights(state, version=version)
    expected = engine.generate(prompts, params)
    for a, b in zip(served, expected, strict=True):
        for sa, sb in zip(a.samples, b.samples, strict=True):
            if sa.token_ids != sb.token_ids or sa.versions != [version] * len(sa.token_ids):
                return False
            if max(abs(x - y) for x, y in zip(sa.logprobs, sb.logprobs, strict=True)) > 1e-5:
                return False
    return True
