"""`StructuredOutputs`: what a sample's text must match (a JSON schema, any
JSON object, a regular expression, one of some strings, or a structural
tag), as `SamplingParams.structured_outputs` carries it. The engine compiles
it for its tokenizer and masks the logits by it (`rollout.engine.grammar`)."""

from __future__ import annotations

from dataclasses import dataclass

_KINDS = ("json", "json_object", "regex", "choice", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One constraint (exactly one field set), as vLLM's `StructuredOutputsParams` names them."""

    json: dict | str | None = None  # a JSON schema (an object, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    structural_tag: dict | str | None = None  # xgrammar's structural tag (the tool-call constraints use it)

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}, got {set_ or 'none'}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (dict, str)):
                raise TypeError(
                    f"structured_outputs.{name} must be a dict or a JSON string, got {type(value).__name__}"
                )
        if self.regex is not None and not isinstance(self.regex, str):
            raise TypeError(f"structured_outputs.regex must be a string, got {type(self.regex).__name__}")
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) for c in choice)
        ):
            raise TypeError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))
