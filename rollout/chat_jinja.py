"""The jinja2 side of chat templates (`rollout/chat.py`): a sandboxed
environment configured as transformers configures its own
(`transformers/utils/chat_template_utils.py`): `trim_blocks`, `lstrip_blocks`,
loop controls, its `tojson` filter, `raise_exception`, `strftime_now`, a
`namespace` that refuses underscore names, and the `{% generation %}` tag.
Imported on the first rendering, so `import rollout` does not load jinja2.

A template is code from the checkpoint, so its rendering is bounded
(`render_bounded`): a deadline is checked on every call, attribute and item
lookup, loop iteration and rendered chunk, and the operators that build a
large value in one step (`*` on sequences, `**`) are capped as jinja's
sandbox caps `range` (MAX_RANGE). Whatever goes wrong while compiling or
rendering is a `ChatTemplateError` naming the template."""

from __future__ import annotations

import json
import time
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

# When the rendering under way on this thread must stop (time.monotonic() seconds).
_DEADLINE: ContextVar[float] = ContextVar("chat_template_deadline", default=float("inf"))
# The global each loop body calls: the call itself goes through the deadline check.
_TICK = "rollout_template_tick"
_MAX_EXPONENT_BITS = 1 << 16  # `**` on ints may build results of at most this many bits


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """A chat template failed to compile or render (a syntax error, an undefined
    value, `raise_exception`, its time limit, any error of its own code); a
    `ValueError` too, so callers that refuse bad input refuse this as well."""


def render_bounded(source: str, name: str, time_limit_s: float, variables: dict[str, Any]) -> str:
    """`source` rendered with `variables`, stopped after `time_limit_s` seconds;
    raises `ChatTemplateError` naming the template `name` for any failure."""
    try:
        template = compile_template(source)
    except Exception as e:  # noqa: BLE001 (the checkpoint's template: every failure is the same refusal)
        raise ChatTemplateError(f"the chat template {name!r} cannot be compiled: {e}") from None
    token = _DEADLINE.set(time.monotonic() + time_limit_s)
    try:
        chunks = []
        for chunk in template.generate(**variables):
            _check_deadline()
            chunks.append(chunk)
        return "".join(chunks)
    except _TimeLimit:
        raise ChatTemplateError(f"the chat template {name!r} ran past its time limit of {time_limit_s:g} s") from None
    except Exception as e:  # noqa: BLE001 (as above)
        message = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
        raise ChatTemplateError(f"the chat template {name!r} failed: {message}") from None
    finally:
        _DEADLINE.reset(token)


class _TimeLimit(Exception):
    """Raised inside a rendering past its deadline (caught by `render_bounded`)."""


def _check_deadline() -> None:
    if time.monotonic() > _DEADLINE.get():
        raise _TimeLimit


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the deadline checked in its hooks and `*`, `**` capped."""

    intercepted_binops = frozenset({"*", "**"})  # also keeps jinja from folding them at compile time

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "*":
            _check_repeat(left, right)
            _check_repeat(right, left)
        elif _is_int(left) and _is_int(right) and abs(left) > 1 and right * abs(left).bit_length() > _MAX_EXPONENT_BITS:
            raise jinja2.exceptions.SecurityError(f"{left} ** {right} is too large for a chat template")
        return super().call_binop(context, operator, left, right)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_repeat(seq: Any, times: Any) -> None:
    if isinstance(seq, (str, list, tuple)) and _is_int(times) and len(seq) * times > MAX_RANGE:
        raise jinja2.exceptions.SecurityError(f"repeating a sequence to more than {MAX_RANGE} items is not allowed")


def _tick_every_loop(tree: nodes.Template) -> nodes.Template:
    """Make every loop iteration call `_TICK`, so a loop that calls, looks up
    and outputs nothing still meets the deadline check in `call`."""
    for loop in tree.find_all(nodes.For):
        loop.body.insert(0, nodes.ExprStmt(nodes.Call(nodes.Name(_TICK, "load"), [], [], None, None)))
    return tree


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers uses for
    assistant-token masks; here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore names as transformers' does:
    templates are code from the checkpoint and must not reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]  # jinja's signature trick, so `namespace(self=...)` works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes, got {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # transformers' filter: unlike jinja's, it does not escape HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the sandbox (cached: a few sources serve every rendering)."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    env.globals[_TICK] = lambda: ""
    return env.from_string(_tick_every_loop(env.parse(source)))
