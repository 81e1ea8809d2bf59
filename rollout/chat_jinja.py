"""The jinja2 side of chat templates (`rollout/chat.py`): a sandboxed
environment configured as transformers configures its own
(`transformers/utils/chat_template_utils.py`): `trim_blocks`, `lstrip_blocks`,
loop controls, its `tojson` filter, `raise_exception`, `strftime_now`, a
`namespace` that refuses underscore names, and the `{% generation %}` tag.
Imported on the first rendering, so `import rollout` does not load jinja2.

A template is code from the checkpoint, so its rendering is bounded
(`render_bounded`): a deadline is checked on every call, attribute and item
lookup, loop iteration and rendered chunk, and each step that could build a
large value between two checks is measured before it builds it: `*` on
sequences and `**` as jinja's sandbox caps `range` (MAX_RANGE), every other
step whose result can outgrow its inputs by an amount the template picks at
`MAX_TEXT` characters or items (`chat_sizes.py` lists them). Whatever goes
wrong while compiling or rendering is a `ChatTemplateError` naming the
template."""

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
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_sizes import (
    FILTER_CHECKS,
    MAX_TEXT,
    CheckEveryConcat,
    check_percent,
    check_repeat,
    check_size,
    check_str_method,
    checked_filter,
    concat,
    finalize,
    join_filter,
    join_output,
    lipsum,
    sum_filter,
)
from .checks import is_int

__all__ = ["MAX_TEXT", "ChatTemplateError", "compile_template", "render_bounded"]

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
        chunks, size = [], 0
        for chunk in template.generate(**variables):
            _check_deadline()
            size += len(chunk)
            check_size(size, "the rendered prompt")  # each chunk is capped, not how many a loop prints
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
    """The sandbox with the deadline checked in its hooks and the steps that
    build large values capped (`*`, `**`, `+`, `%`, string methods; `~` and the
    filters are in `compile_template`)."""

    # Also keeps jinja from folding them at compile time, where nothing checks them.
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        _check_deadline()
        args = check_str_method(__obj, args, kwargs)
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
            check_repeat(left, right)
            check_repeat(right, left)
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                check_size(len(left) + len(right), "the + operator")
        elif operator == "%":
            if isinstance(left, str):
                check_percent(left, right, "the % operator")
        elif is_int(left) and is_int(right) and abs(left) > 1 and right * abs(left).bit_length() > _MAX_EXPONENT_BITS:
            raise jinja2.exceptions.SecurityError(f"{left} ** {right} is too large for a chat template")
        return super().call_binop(context, operator, left, right)


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
    # transformers' filter: unlike jinja's, it does not escape HTML characters. As
    # `json.dumps` (whose output it is), but built piece by piece and refused past
    # MAX_TEXT characters: a piece is a value's JSON, a separator, or a newline with
    # `indent` once for each level of nesting, so `indent` times the depth is checked
    # first.
    if isinstance(x, str):
        check_size(len(x), "the tojson filter")
        return json.dumps(x, ensure_ascii=ensure_ascii)  # at most 6 characters each, as one piece
    if indent is not None:
        check_size((len(indent) if isinstance(indent, str) else indent) * _depth(x), "the tojson filter")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(x):
        size += len(piece)
        check_size(size, "the tojson filter")
        pieces.append(piece)
    return "".join(pieces)


def _depth(x: Any) -> int:
    """How deep lists, tuples and dicts nest in `x` (1 for none), refused past MAX_TEXT of them."""
    depth, seen, stack = 1, 0, [(x, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            seen += len(item) + 1
            check_size(seen, "the tojson filter")
            depth = max(depth, level + 1)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return depth


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the sandbox (cached: a few sources serve every rendering)."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    env.globals[_TICK] = lambda: ""
    env.checked_concat = concat  # what `~` calls (`CheckEveryConcat`)
    for name, check in FILTER_CHECKS.items():
        env.filters[name] = checked_filter(env.filters[name], check, name)
    env.filters["join"] = join_filter
    env.filters["sum"] = sum_filter
    env.finalize = finalize
    env.concat = join_output
    env.globals["lipsum"] = lipsum
    return env.from_string(CheckEveryConcat(env).visit(_tick_every_loop(env.parse(source))))
