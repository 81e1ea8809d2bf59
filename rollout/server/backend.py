"""What the server generates with: one in-process `Engine` or a `RolloutCluster`.

Both give `stream(prompt, params)`, a `TokenStream` made inside the server's
event loop (deltas, then the finished `RolloutOutput`; `cancel()` frees the
KV). Everything else the server asks of them is here, so routes never touch
an engine or a cluster directly. Calls that may block (a cluster's health
is a Ray round trip; rendering and tokenizing a prompt) are plain methods
the app runs in a thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..chat import is_chat
from ..engine.grammar import grammars_for
from ..engine.requests import PromptLimits, prompt_token_ids, render_chat
from ..engine.streams import TokenStream
from ..sampling_params import SamplingParams
from ..tokenizer import TextCodec

if TYPE_CHECKING:
    from ..cluster.cluster import RolloutCluster
    from ..engine.engine import Engine

# Counters `counters()` reports, each summed over actors on a cluster.
COUNTERS = ("kv_pages_used", "kv_pages_total", "computed_tokens", "prefix_hit_tokens")
# Per actor position of a cluster, the faults `counters()` reports (as `RolloutCluster.health()` counts them).
FAULTS = ("replacements", "hangs", "stalls", "failed_starts")


class Backend(Protocol):
    """The generation side of a server."""

    codec: TextCodec | None  # the checkpoint's tokenizer and chat template; None: token ids only
    max_seq_len: int  # prompt plus output tokens of one sequence
    max_batch_size: int  # sequences one engine steps at once

    def stream(self, prompt, params: SamplingParams) -> TokenStream:
        """Start one prompt (text, token ids or chat messages); raises `ValueError`/`TypeError` on bad input."""
        ...

    def prompt_ids(self, prompt, field: str, tools: list | None = None) -> list[int]:
        """`prompt_ids` below with this backend's limits (may block: run it in a thread)."""
        ...

    def policy_version(self) -> int: ...

    def counters(self) -> tuple[dict[str, int], list[dict[str, int]]]:
        """`COUNTERS` that the backend reports, and per actor position (by
        index) its `FAULTS`: none in process (may block: run it in a thread)."""
        ...

    def close(self) -> None: ...


def prompt_ids(prompt, field: str, tools: list | None, limits: PromptLimits, codec: TextCodec | None) -> list[int]:
    """One prompt's token ids, checked against `limits`: text tokenized, chat
    messages rendered by the checkpoint's template (`tools` passed to it) and
    tokenized. Raises `ValueError`/`TypeError`; template errors name `field`.
    A long prompt or a slow template takes a while, so the app runs this in a
    thread, and tokenizes with `encode_unlocked` so its event loop runs meanwhile."""
    if is_chat(prompt):
        text = render_chat(field, prompt, codec, tools)  # raises without a template (or a codec)
        prompt = codec.encode_unlocked(text, add_special_tokens=False)  # the rendering holds them
    elif isinstance(prompt, str) and codec is not None:
        prompt = codec.encode_unlocked(prompt)
    return prompt_token_ids(prompt, limits, codec)


class EngineBackend:
    """One in-process `Engine`; `close()` closes it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.codec = engine.tokenizer
        self.max_seq_len = engine.config.max_seq_len
        self.max_batch_size = engine.config.max_batch_size

    def stream(self, prompt, params: SamplingParams) -> TokenStream:
        return self.engine.stream(prompt, params)

    def prompt_ids(self, prompt, field: str, tools: list | None = None) -> list[int]:
        limits = PromptLimits.of(self.engine.config, self.engine.model_config)
        return prompt_ids(prompt, field, tools, limits, self.codec)

    def warm_grammar(self, params: SamplingParams) -> None:
        """Compile `params`' constraint in the calling thread (a worker's), so that the
        engine's compile as the request starts, on the event loop, finds it cached;
        `ValueError` naming the field for a bad one."""
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop.update(self.codec.eos_token_ids if self.codec is not None else self.engine.model_config.eos_token_ids)
        grammars = grammars_for(self.codec, self.engine.model_config.vocab_size)
        grammars.compile(params.structured_outputs, frozenset(stop))

    def policy_version(self) -> int:
        return self.engine.policy_version

    def counters(self) -> tuple[dict[str, int], list[dict[str, int]]]:
        stats = self.engine.stats()
        return {k: int(stats[k]) for k in COUNTERS}, []

    def close(self) -> None:
        self.engine.close()


class ClusterBackend:
    """A `RolloutCluster`; each stream goes to its least loaded live actor.
    `close()` shuts the cluster down only when the server started it."""

    def __init__(self, cluster: RolloutCluster, owned: bool = False) -> None:
        self.cluster = cluster
        self.owned = owned
        self.codec = cluster.tokenizer
        limits = cluster.limits
        self.max_seq_len = limits.max_seq_len
        self.max_batch_size = limits.max_batch_size

    def stream(self, prompt, params: SamplingParams) -> TokenStream:
        return self.cluster.stream(prompt, params)

    def prompt_ids(self, prompt, field: str, tools: list | None = None) -> list[int]:
        return prompt_ids(prompt, field, tools, self.cluster.limits, self.codec)

    def policy_version(self) -> int:
        return self.cluster.policy_version()

    def counters(self) -> tuple[dict[str, int], list[dict[str, int]]]:
        totals, faults = dict.fromkeys(COUNTERS, 0), []
        for actor in self.cluster.health():  # one round trip: each actor's own counters and its position's faults
            for k in COUNTERS:
                totals[k] += int(actor.get(k, 0))
            faults.append({"index": actor["index"], **{k: int(actor.get(k, 0)) for k in FAULTS}})
        return totals, faults

    def close(self) -> None:
        if self.owned:
            self.cluster.shutdown()
