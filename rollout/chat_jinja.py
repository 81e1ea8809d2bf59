"""The jinja2 side of chat templates (`rollout/chat.py`): a sandboxed
environment configured as transformers configures its own
(`transformers/utils/chat_template_utils.py`): `trim_blocks`, `lstrip_blocks`,
loop controls, its `tojson` filter, `raise_exception`, `strftime_now`, a
`namespace` that refuses underscore names, and the `{% generation %}` tag.
Imported on the first rendering, so `import rollout` does not load jinja2.

A template is code from the checkpoint, so its rendering is bounded
(`render_bounded`): a deadline is checked on every call, attribute and item
lookup, loop iteration and rendered chunk, and each step that could build a
large value between two checks is capped before it builds it: `*` on
sequences and `**` as jinja's sandbox caps `range` (MAX_RANGE), and every
other step whose result can outgrow its inputs by an amount the template
chooses at `MAX_TEXT` characters (or items): `~` (routed through a checking
function by an AST transform), `+` on strings, lists and tuples, `%`
formatting (its widths, precisions and values), the filters `center`,
`indent`, `wordwrap`, `format`, `replace`, `join`, `urlize`, `tojson` (its
`indent` too), `batch`, `slice` and `sum`, `lipsum`, the string methods
`center`, `ljust`, `rjust`, `zfill`, `expandtabs`, `replace`, `translate`,
`join`, `format` and `format_map`, what a macro, block or `{% set %}` block
renders, and the text of a value that is not a string (a list of one
long string many times over) wherever it is built: printed, joined, formatted,
or given to a filter that makes text of it. Whatever goes wrong while
compiling or rendering is a `ChatTemplateError` naming the template."""

from __future__ import annotations

import json
import re
import string
import time
from collections import Counter
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.filters import make_attrgetter
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

# When the rendering under way on this thread must stop (time.monotonic() seconds).
_DEADLINE: ContextVar[float] = ContextVar("chat_template_deadline", default=float("inf"))
# The global each loop body calls: the call itself goes through the deadline check.
_TICK = "rollout_template_tick"
_MAX_EXPONENT_BITS = 1 << 16  # `**` on ints may build results of at most this many bits
# The most characters (or list items) one step of a template may build. A real
# rendering is the conversation with a few markers around each message, so no
# step builds more than the whole prompt: a request body is at most 1 MiB by
# default (`--max-body-bytes`), and 4 Mi characters is about a million tokens,
# past any context the engine serves. It keeps one step under 16 MB (4 bytes a
# character at most), where a width or a doubling would otherwise build GBs.
MAX_TEXT = 1 << 22


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
    """The sandbox with the deadline checked in its hooks and the steps that
    build large values capped (`*`, `**`, `+`, `%`, string methods; `~` and the
    filters are in `compile_template`)."""

    # Also keeps jinja from folding them at compile time, where nothing checks them.
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        _check_deadline()
        args = _check_str_method(__obj, args, kwargs)
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
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_size(len(left) + len(right), "the + operator")
        elif operator == "%":
            if isinstance(left, str):
                _check_percent(left, right, "the % operator")
        elif _is_int(left) and _is_int(right) and abs(left) > 1 and right * abs(left).bit_length() > _MAX_EXPONENT_BITS:
            raise jinja2.exceptions.SecurityError(f"{left} ** {right} is too large for a chat template")
        return super().call_binop(context, operator, left, right)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_repeat(seq: Any, times: Any) -> None:
    if isinstance(seq, (str, list, tuple)) and _is_int(times) and len(seq) * times > MAX_RANGE:
        raise jinja2.exceptions.SecurityError(f"repeating a sequence to more than {MAX_RANGE} items is not allowed")


def _check_size(size: int, step: str) -> None:
    """Refuse a step (`step` names it) whose result would hold `size` characters or items."""
    if size > MAX_TEXT:
        raise SecurityError(f"{step} would build more than {MAX_TEXT} characters or items")


_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def _text_size(value: Any) -> int:
    """len(str(value)) without building it where that could be large: exact for
    strings, numbers and what prints small; for lists, tuples, sets, dicts and
    namespaces a lower bound (each item's size plus one separator), counted only
    until it passes MAX_TEXT, since the items may all be one long string."""
    total, stack = 0, [value]
    while stack and total <= MAX_TEXT:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, jinja2.utils.Namespace):
            stack.append(object.__getattribute__(x, "_Namespace__attrs"))
        elif isinstance(x, dict):
            total += 2 * len(x) + 2
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset, *_DICT_VIEWS)):
            total += len(x) + 2
            stack.extend(x)
        else:
            total += len(str(x))
    return total


# A %-conversion after its `%` (and mapping key): flags, width, precision, length modifier.
_PERCENT_SPEC = re.compile(r"[-+ #0]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?")


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 10 else MAX_TEXT + 1  # no int() of a thousand digits


def _check_percent(fmt: str, args: Any, step: str) -> None:
    """Refuse `fmt % args` if it would build more than MAX_TEXT characters: its
    text plus, for each conversion, its width, its precision (a `*` one taken
    from `args`, as Python takes it) and its value's text."""
    positional = args if isinstance(args, tuple) else (args,)
    size, used, i = len(fmt), 0, fmt.find("%")
    while i != -1 and size <= MAX_TEXT:
        i += 1
        if fmt.startswith("%", i):  # `%%`
            i = fmt.find("%", i + 1)
            continue
        value, keyed = "", fmt.startswith("(", i)
        if keyed:  # a mapping key, whose parentheses nest as Python reads them
            depth, start = 0, i + 1
            while i < len(fmt):
                depth += {"(": 1, ")": -1}.get(fmt[i], 0)
                i += 1
                if depth == 0:
                    break
            if isinstance(args, dict):
                value = args.get(fmt[start : i - 1], "")
        spec = _PERCENT_SPEC.match(fmt, i)
        for field in spec.groups():
            if field == "*":
                star = positional[used] if used < len(positional) else 0
                used += 1
                size += abs(star) if _is_int(star) else 0
            elif field:
                size += _number(field)
        if not keyed:
            value = positional[used] if used < len(positional) else ""
            used += 1
        size += _text_size(value)
        i = fmt.find("%", spec.end() + 1)
    _check_size(size, step)


def _check_format(fmt: str, args: Any, kwargs: Any, step: str) -> None:
    """Refuse `fmt.format(*args, **kwargs)` if it could build more than MAX_TEXT
    characters: its text plus, for each field, the numbers in its spec (a
    nested field in the spec counts as the largest int argument) and the
    largest argument's text."""
    values = [*args, *kwargs.values()]
    largest = max((_text_size(v) for v in values), default=0)
    widest = max((abs(v) for v in values if _is_int(v)), default=0)
    size, specs = len(fmt), [fmt]
    while specs and size <= MAX_TEXT:
        for _, field, spec, _ in string.Formatter().parse(specs.pop()):
            if field is not None:
                size += largest + sum(_number(n) for n in re.findall(r"\d+", spec or ""))
                if spec and "{" in spec:
                    size += widest
                    specs.append(spec)
    _check_size(size, step)


def _check_replace(s: Any, old: Any, new: Any, count: Any, step: str) -> None:
    s, old, new = str(s), str(old), str(new)
    times = s.count(old) if old else len(s) + 1
    if _is_int(count) and count >= 0:
        times = min(times, count)
    _check_size(len(s) + times * (len(new) - len(old)), step)


def _check_join(sep: Any, items: list, step: str) -> None:
    _check_size(sum(map(_text_size, items)) + len(str(sep)) * max(len(items) - 1, 0), step)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _check_str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
    """Refuse a call of a string's method that would build more than MAX_TEXT
    characters; the arguments to call it with (an iterable to `join` is read
    into a list first, so it can be measured)."""
    wrapped = getattr(method, "__wrapped__", None)  # jinja wraps `str.format` and `str.format_map`
    if isinstance(getattr(wrapped, "__self__", None), str) and wrapped.__name__ in ("format", "format_map"):
        step = f"str.{wrapped.__name__}"
        if wrapped.__name__ == "format":
            _check_format(wrapped.__self__, args, kwargs, step)
        elif len(args) == 1 and isinstance(args[0], dict):
            _check_format(wrapped.__self__, (), args[0], step)
        return args
    s = getattr(method, "__self__", None)
    if not isinstance(s, str):
        return args
    name, step = getattr(method, "__name__", ""), f"str.{getattr(method, '__name__', '')}"
    if name in ("center", "ljust", "rjust", "zfill"):
        width = _arg(args, kwargs, 0, "width", 0)
        _check_size(width if _is_int(width) else 0, step)
    elif name == "expandtabs":
        tabsize = _arg(args, kwargs, 0, "tabsize", 8)
        _check_size(len(s) + s.count("\t") * (tabsize if _is_int(tabsize) else 0), step)
    elif name == "replace" and len(args) >= 2:
        _check_replace(s, args[0], args[1], _arg(args, kwargs, 2, "count", -1), step)
    elif name == "translate" and len(args) == 1 and isinstance(args[0], dict):
        table = args[0]
        grown = (n * len(table[ord(c)]) for c, n in Counter(s).items() if isinstance(table.get(ord(c)), str))
        _check_size(len(s) + sum(grown), step)
    elif name == "join" and len(args) == 1:
        args = (list(args[0]),)
        _check_join(s, args[0], step)
    return args


def _checked(filter_: Any, check: Any, name: str) -> Any:
    """`filter_` calling `check` with its arguments first, after refusing a value
    that is not a string but whose text (which the filter builds) would pass
    MAX_TEXT characters, such as a long list of one long string.

    A filter whose result can outgrow its value by an amount its arguments pick
    (any `check` but `_no_check`) takes the context, as jinja's `pass_context`
    filters do, so jinja never calls it while compiling, where it folds a filter
    of constants and nothing bounds how many; it hands `filter_` the context,
    eval context or environment its `pass_*` mark asks for. The others keep
    `filter_`'s mark, so jinja folds them as it did (a few times the source)."""
    pass_arg = getattr(getattr(filter_, "jinja_pass_arg", None), "name", None)

    def run(first: Any, args: tuple, kwargs: dict) -> Any:
        if args and not isinstance(args[0], str):
            _check_size(_text_size(args[0]), f"the {name} filter")
        check(*args, **kwargs)
        return filter_(*args, **kwargs) if first is None else filter_(first, *args, **kwargs)

    if check is _no_check:

        @wraps(filter_)
        def checked(*args: Any, **kwargs: Any) -> Any:
            return run(args[0], args[1:], kwargs) if pass_arg else run(None, args, kwargs)

        return checked

    @jinja2.pass_context
    @wraps(filter_)
    def checked_at_run_time(context: Any, *args: Any, **kwargs: Any) -> Any:
        first = {"context": context, "eval_context": context.eval_ctx, "environment": context.environment}.get(pass_arg)
        return run(first, args, kwargs)

    return checked_at_run_time


def _center(value: Any, width: Any = 80) -> None:
    _check_size(max(_text_size(value), width if _is_int(width) else 0), "the center filter")


def _indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> None:
    indent = len(width) if isinstance(width, str) else width if _is_int(width) else 0
    s = str(s)
    _check_size(len(s) + 1 + (s.count("\n") + 1) * indent, "the indent filter")


def _wordwrap(
    s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None, break_on_hyphens: Any = True
) -> None:
    # Every wrapped line holds a character at least, so there are at most len(s) joins
    # (of the environment's newline, "\n", by default).
    joiner = "\n" if wrapstring is None else str(wrapstring)
    _check_size(len(str(s)) * (1 + len(joiner)), "the wordwrap filter")


def _no_check(*args: Any, **kwargs: Any) -> None:
    """For the filters that build no more text than their value's (checked in `_checked`)."""


def _urlize(
    value: Any,
    trim_url_limit: Any = None,
    nofollow: Any = False,
    target: Any = None,
    rel: Any = None,
    extra_schemes: Any = None,
) -> None:
    # Each word may become a link, with both attributes and the word (escaped, 5
    # characters a character at most) twice.
    s, extra = str(value), len(str(target or "")) + len(str(rel or "")) + 64
    _check_size(10 * len(s) + len(s.split()) * extra, "the urlize filter")


def _batch(value: Any, linecount: Any, fill_with: Any = None) -> None:
    if fill_with is not None and _is_int(linecount):
        _check_size(linecount, "the batch filter")  # the last row is filled to linecount items


def _slice(value: Any, slices: Any, fill_with: Any = None) -> None:
    _check_size(slices if _is_int(slices) else 0, "the slice filter")


def _format(value: Any, *args: Any, **kwargs: Any) -> None:
    _check_percent(str(value), kwargs or args, "the format filter")


def _replace(s: Any, old: Any, new: Any, count: Any = None) -> None:
    _check_replace(s, old, new, -1 if count is None else count, "the replace filter")


@jinja2.pass_context  # not folded at compile time (see `_checked`)
def _join(context: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
    """jinja's `join`, its items read into a list and measured first."""
    eval_ctx = context.eval_ctx
    items = list(value) if attribute is None else list(map(make_attrgetter(eval_ctx.environment, attribute), value))
    _check_join(d, items, "the join filter")
    return jinja2.filters.sync_do_join(eval_ctx, items, d)


@jinja2.pass_context  # as `_join`
def _sum(context: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """jinja's `sum`, its items read into a list and, when it adds lists or
    tuples, their total length refused past MAX_TEXT items first."""
    getter = make_attrgetter(context.environment, attribute) if attribute is not None else None
    items = list(iterable) if getter is None else list(map(getter, iterable))
    if isinstance(start, (list, tuple)):
        _check_size(len(start) + sum(len(i) for i in items if isinstance(i, (list, tuple))), "the sum filter")
    return sum(items, start)


# The filters that build text from their value (all refuse a value whose text
# would pass MAX_TEXT) and the check of what each adds.
_FILTER_CHECKS = {
    **dict.fromkeys(
        ("capitalize", "e", "escape", "forceescape", "lower", "pprint", "safe", "string", "striptags", "title"),
        _no_check,
    ),
    **dict.fromkeys(("trim", "truncate", "upper", "urlencode", "wordcount", "xmlattr"), _no_check),
    "center": _center,
    "indent": _indent,
    "wordwrap": _wordwrap,
    "format": _format,
    "replace": _replace,
    "urlize": _urlize,
    "batch": _batch,
    "slice": _slice,
}


def _join_output(chunks: Any) -> str:
    """How jinja joins what a macro, call block, filter block, block or
    `{% set %}` block rendered (`environment.concat`), refused past MAX_TEXT
    characters: each chunk is capped, but a body may print a value twice."""
    chunks = list(chunks)
    _check_size(sum(map(len, chunks)), "joining a block's output")
    return "".join(chunks)


def _finalize(value: Any) -> Any:
    """What `{{ value }}` prints, refused if it is not a string and its text would pass MAX_TEXT."""
    if not isinstance(value, str):
        _check_size(_text_size(value), "printing a value")
    return value


def _lipsum(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> str:  # noqa: A002 (jinja's names)
    """jinja's `lipsum`, refused past MAX_TEXT characters (words of 12 at most, and a space)."""
    if _is_int(n) and _is_int(max):
        _check_size(n * max * 13, "lipsum")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _concat(use_markup: bool, *values: Any) -> str:
    """`a ~ b ~ ...` as jinja compiles it (`markup_join` where the template
    autoescapes, else `str_join`), refused if it would build more than MAX_TEXT
    characters."""
    _check_size(sum(map(_text_size, values)), "the ~ operator")
    return (markup_join if use_markup else str_join)(values)


class _CheckEveryConcat(NodeTransformer):
    """Route every `~` (a `nodes.Concat`) through `_concat`, as the sandbox
    routes `*` through `call_binop`. The compiler picks `markup_join` where its
    eval context autoescapes and is not volatile (an `{% autoescape %}` of a
    value known only at run time), else `str_join`, and folds a constant `~` at
    compile time; this tracks the same context, so the output is identical."""

    def __init__(self, environment: jinja2.Environment) -> None:
        self.environment = environment
        self.eval_ctx = nodes.EvalContext(environment)

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        if not self.eval_ctx.volatile:
            try:  # a constant, which jinja folds at compile time, if it is small enough
                if sum(_text_size(n.as_const(self.eval_ctx)) for n in node.nodes) <= MAX_TEXT:
                    return node
            except nodes.Impossible:
                pass
        use_markup = nodes.Const(bool(self.eval_ctx.autoescape) and not self.eval_ctx.volatile)
        # An environment attribute, not a global: a template cannot shadow it.
        func = nodes.EnvironmentAttribute("checked_concat")
        return nodes.Call(func, [use_markup, *node.nodes], [], None, None).set_lineno(node.lineno)

    def visit_ScopedEvalContextModifier(self, node: nodes.ScopedEvalContextModifier) -> nodes.Node:
        saved = self.eval_ctx.save()
        for keyword in node.options:
            try:
                setattr(self.eval_ctx, keyword.key, keyword.value.as_const(self.eval_ctx))
            except nodes.Impossible:
                self.eval_ctx.volatile = True
        self.generic_visit(node)
        self.eval_ctx.revert(saved)
        return node

    def visit_Block(self, node: nodes.Block) -> nodes.Node:
        # jinja compiles blocks after the body, in the template's initial context.
        saved, self.eval_ctx = self.eval_ctx, nodes.EvalContext(self.environment)
        self.generic_visit(node)
        self.eval_ctx = saved
        return node


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
        _check_size(len(x), "the tojson filter")
        return json.dumps(x, ensure_ascii=ensure_ascii)  # at most 6 characters each, as one piece
    if indent is not None:
        _check_size((len(indent) if isinstance(indent, str) else indent) * _depth(x), "the tojson filter")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(x):
        size += len(piece)
        _check_size(size, "the tojson filter")
        pieces.append(piece)
    return "".join(pieces)


def _depth(x: Any) -> int:
    """How deep lists, tuples and dicts nest in `x` (1 for none), refused past MAX_TEXT of them."""
    depth, seen, stack = 1, 0, [(x, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            seen += len(item) + 1
            _check_size(seen, "the tojson filter")
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
    env.checked_concat = _concat  # what `~` calls (`_CheckEveryConcat`)
    for name, check in _FILTER_CHECKS.items():
        env.filters[name] = _checked(env.filters[name], check, name)
    env.filters["join"] = _join
    env.filters["sum"] = _sum
    env.finalize = _finalize
    env.concat = _join_output
    env.globals["lipsum"] = _lipsum
    return env.from_string(_CheckEveryConcat(env).visit(_tick_every_loop(env.parse(source))))
