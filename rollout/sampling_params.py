"""`SamplingParams`: how to sample the responses of one prompt."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import as_token_ids, check_int, check_number
from .structured import StructuredOutputs

LOGPROBS_MODES = ("processed", "raw", "scaled")
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # as OpenAI's API and vLLM's default bound
# Stop strings are searched after every token of every sample: their count and
# length bound that work (and the text a stream holds back), so both are capped.
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256  # characters per stop string
# Below this, logits / temperature can overflow float32 (a subnormal temperature makes every
# logprob NaN); a caller after near-greedy sampling wants temperature 0.
MIN_TEMPERATURE = 1e-6
# The step holds temperature, top_p and min_p as float32: past these bounds the cast makes a
# valid-looking value inf (temperature) or 0 (top_p), which the step cannot sample with.
MAX_TEMPERATURE = float(np.finfo(np.float32).max)
MIN_TOP_P = float(np.finfo(np.float32).smallest_subnormal)


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings shared by the `n` samples of each prompt.

    Filters apply in the order temperature, top-k, top-p, min-p, each
    renormalising the distribution. Every field is validated on
    construction: a bad value raises `ValueError`/`TypeError` naming it.
    Numpy scalars, and 1-D integer numpy arrays or torch tensors as
    `stop_token_ids`, are accepted and stored as plain Python values.
    """

    n: int = 1  # samples per prompt (a GRPO group)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set reaching this mass (crossing token included)
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max
    max_tokens: int = 256  # per sample; capped by the context length, never an error
    stop_token_ids: list[int] | None = None  # plus the tokenizer's eos unless ignore_eos
    stop: list[str] | str | None = None  # stop strings (need a tokenizer); see MAX_STOP_STRINGS, MAX_STOP_LENGTH
    ignore_eos: bool = False
    seed: int | None = None  # per-request seed: same tokens whatever else is batched
    logprobs_mode: str = "processed"  # "processed" | "raw" | "scaled" (see `LOGPROBS_MODES`)
    top_logprobs: int = 0  # per token, this many most likely alternatives and their logprobs; 0 = off
    # Mixture-of-experts models: the experts each position was routed to, per sparse layer
    # (`RolloutOutput.prompt_routed_experts`, `Sample.routed_experts`); a dense model refuses it.
    return_routed_experts: bool = False
    # The prompt tokens' logprobs under these settings' distribution (as vLLM's field): None = off,
    # 0 = each prompt token's own, k > 0 = also the k most likely alternatives per position.
    prompt_logprobs: int | None = None
    # Penalties and biases as vLLM defines them (rollout/engine/penalties.py), before temperature:
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times the token's count in the output so far
    presence_penalty: float = 0.0  # in [-2, 2]: minus this for a token already in the output
    repetition_penalty: float = 1.0  # in (0, 2]: a token in the prompt or output has its logit divided (>0) or times
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, each in [-100, 100]
    # The text constrained to a JSON schema, a regex, ... (rollout/engine/grammar.py); None: free text.
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        self.n = check_int("n", self.n, 1)
        self._check_distribution()
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        self.stop_token_ids = _token_list(self.stop_token_ids)
        self.stop = _stop_strings(self.stop)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, 0, f"and <= {MAX_SEED}, or None")
            if self.seed > MAX_SEED:
                raise ValueError(f"seed must be in [0, {MAX_SEED}] or None, got {self.seed}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        self.top_logprobs = check_int("top_logprobs", self.top_logprobs, 0, f"and <= {MAX_TOP_LOGPROBS} (0 = off)")
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not isinstance(self.return_routed_experts, bool):
            raise TypeError(f"return_routed_experts must be a bool, got {type(self.return_routed_experts).__name__}")
        if self.prompt_logprobs is not None:
            allowed = f"and <= {MAX_TOP_LOGPROBS}, or None (off)"
            self.prompt_logprobs = check_int("prompt_logprobs", self.prompt_logprobs, 0, allowed)
            if self.prompt_logprobs > MAX_TOP_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}] or None, got {self.prompt_logprobs}"
                )
        self._check_penalties()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise TypeError(
                "structured_outputs must be a StructuredOutputs (json=, json_object=, regex=, choice= or "
                f"structural_tag=) or None, got {type(self.structured_outputs).__name__}"
            )

    def _check_penalties(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = check_number(name, getattr(self, name), "in [-2, 2]")
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, float(value))
        r = check_number("repetition_penalty", self.repetition_penalty, "in (0, 2]")
        if not 0 < r <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1 = off), got {r!r}")
        self.repetition_penalty = float(r)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias or None, got {self.logit_bias!r}")
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
                b = check_number(f"logit_bias[{token}]", value, "in [-100, 100]")
                if not -100 <= b <= 100:
                    raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {b!r}")
                bias[int(token)] = float(b)
            self.logit_bias = bias or None

    def _check_distribution(self) -> None:
        """temperature, top_k, top_p and min_p, each in a range the step's buffers hold
        (float32, int64) without turning it into a value the step rejects. The bounds
        compare the values as given (a huge int or a NaN never reaches float());
        the floats are then stored as plain Python floats."""
        t = check_number("temperature", self.temperature, ">= 0")
        if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} and <= {MAX_TEMPERATURE} "
                f"(the largest float32), got {t!r}"
            )
        # Any k >= 0 is a valid request; the step caps it at the vocabulary, where k keeps every token, as 0 does.
        self.top_k = check_int("top_k", self.top_k, 0, "(0 = off)")
        top_p = check_number("top_p", self.top_p, "in (0, 1]")
        if not (MIN_TOP_P <= top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] and >= {MIN_TOP_P} (the least float32 above 0), got {top_p!r}")
        min_p = check_number("min_p", self.min_p, "in [0, 1]")
        if not (0 <= min_p <= 1):  # float32 rounding keeps [0, 1] in [0, 1]; below its range it is 0, off
            raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
        self.temperature, self.top_p, self.min_p = float(t), float(top_p), float(min_p)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def _token_list(ids: object) -> list[int] | None:
    if ids is None:
        return None
    out = as_token_ids("stop_token_ids", ids)
    for t in out:
        if t < 0:
            raise ValueError(f"stop_token_ids must hold token ids >= 0, got {t}")
    return out


def _stop_strings(stop: object) -> list[str] | None:
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"stop must be a string, a list of strings or None, got {type(stop).__name__}")
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"stop must hold strings, got {s!r} ({type(s).__name__})")
        if not 1 <= len(s) <= MAX_STOP_LENGTH:
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_LENGTH} characters, stop[{i}] has {len(s)}")
    return list(items) or None
