"""What one step of a chat template may build (`chat_jinja.py` renders them).

Between two deadline checks a single step (`%` with a width, `~` in a
doubling loop, `center`, `replace`, `tojson` with an indent, ...) can build
gigabytes, so every step whose result can outgrow its inputs by an amount the
template picks is measured first and refused past `MAX_TEXT` characters or
items with jinja's `SecurityError`: the binary operators (through the
sandbox's `call_binop`), `~` (`CheckEveryConcat` routes it through `concat`),
the string methods (through the sandbox's `call`), the filters that build text
(`FILTER_CHECKS`, `join_filter`, `sum_filter`), what blocks render
(`join_output`) and what is printed (`finalize`)."""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import wraps
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.filters import make_attrgetter
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import MAX_RANGE
from jinja2.visitor import NodeTransformer

from .checks import is_int

# The most characters (or list items) one step of a template may build. A real
# rendering is the conversation with a few markers around each message, so no
# step builds more than the whole prompt: a request body is at most 1 MiB by
# default (`--max-body-bytes`), and 4 Mi characters is about a million tokens,
# past any context the engine serves. It keeps one step under 16 MB (4 bytes a
# character at most), where a width or a doubling would otherwise build GBs.
MAX_TEXT = 1 << 22


def check_repeat(seq: Any, times: Any) -> None:
    if isinstance(seq, (str, list, tuple)) and is_int(times) and len(seq) * times > MAX_RANGE:
        raise jinja2.exceptions.SecurityError(f"repeating a sequence to more than {MAX_RANGE} items is not allowed")


def check_size(size: int, step: str) -> None:
    """Refuse a step (`step` names it) whose result would hold `size` characters or items."""
    if size > MAX_TEXT:
        raise SecurityError(f"{step} would build more than {MAX_TEXT} characters or items")


_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def text_size(value: Any) -> int:
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


def check_percent(fmt: str, args: Any, step: str) -> None:
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
                size += abs(star) if is_int(star) else 0
            elif field:
                size += _number(field)
        if not keyed:
            value = positional[used] if used < len(positional) else ""
            used += 1
        size += text_size(value)
        i = fmt.find("%", spec.end() + 1)
    check_size(size, step)


def _check_format(fmt: str, args: Any, kwargs: Any, step: str) -> None:
    """Refuse `fmt.format(*args, **kwargs)` if it could build more than MAX_TEXT
    characters: its text plus, for each field, the numbers in its spec (a
    nested field in the spec counts as the largest int argument) and the
    largest argument's text."""
    values = [*args, *kwargs.values()]
    largest = max((text_size(v) for v in values), default=0)
    widest = max((abs(v) for v in values if is_int(v)), default=0)
    size, specs = len(fmt), [fmt]
    while specs and size <= MAX_TEXT:
        for _, field, spec, _ in string.Formatter().parse(specs.pop()):
            if field is not None:
                size += largest + sum(_number(n) for n in re.findall(r"\d+", spec or ""))
                if spec and "{" in spec:
                    size += widest
                    specs.append(spec)
    check_size(size, step)


def _check_replace(s: Any, old: Any, new: Any, count: Any, step: str) -> None:
    s, old, new = str(s), str(old), str(new)
    times = s.count(old) if old else len(s) + 1
    if is_int(count) and count >= 0:
        times = min(times, count)
    check_size(len(s) + times * (len(new) - len(old)), step)


def _check_join(sep: Any, items: list, step: str) -> None:
    check_size(sum(map(text_size, items)) + len(str(sep)) * max(len(items) - 1, 0), step)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def check_str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
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
        check_size(width if is_int(width) else 0, step)
    elif name == "expandtabs":
        tabsize = _arg(args, kwargs, 0, "tabsize", 8)
        check_size(len(s) + s.count("\t") * (tabsize if is_int(tabsize) else 0), step)
    elif name == "replace" and len(args) >= 2:
        _check_replace(s, args[0], args[1], _arg(args, kwargs, 2, "count", -1), step)
    elif name == "translate" and len(args) == 1 and isinstance(args[0], dict):
        table = args[0]
        grown = (n * len(table[ord(c)]) for c, n in Counter(s).items() if isinstance(table.get(ord(c)), str))
        check_size(len(s) + sum(grown), step)
    elif name == "join" and len(args) == 1:
        args = (list(args[0]),)
        _check_join(s, args[0], step)
    return args


def checked_filter(filter_: Any, check: Any, name: str) -> Any:
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
            check_size(text_size(args[0]), f"the {name} filter")
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
    check_size(max(text_size(value), width if is_int(width) else 0), "the center filter")


def _indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> None:
    indent = len(width) if isinstance(width, str) else width if is_int(width) else 0
    s = str(s)
    check_size(len(s) + 1 + (s.count("\n") + 1) * indent, "the indent filter")


def _wordwrap(
    s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None, break_on_hyphens: Any = True
) -> None:
    # Every wrapped line holds a character at least, so there are at most len(s) joins
    # (of the environment's newline, "\n", by default).
    joiner = "\n" if wrapstring is None else str(wrapstring)
    check_size(len(str(s)) * (1 + len(joiner)), "the wordwrap filter")


def _no_check(*args: Any, **kwargs: Any) -> None:
    """For the filters that build no more text than their value's (checked in `checked_filter`)."""


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
    check_size(10 * len(s) + len(s.split()) * extra, "the urlize filter")


def _batch(value: Any, linecount: Any, fill_with: Any = None) -> None:
    if fill_with is not None and is_int(linecount):
        check_size(linecount, "the batch filter")  # the last row is filled to linecount items


def _slice(value: Any, slices: Any, fill_with: Any = None) -> None:
    check_size(slices if is_int(slices) else 0, "the slice filter")


def _format(value: Any, *args: Any, **kwargs: Any) -> None:
    check_percent(str(value), kwargs or args, "the format filter")


def _replace(s: Any, old: Any, new: Any, count: Any = None) -> None:
    _check_replace(s, old, new, -1 if count is None else count, "the replace filter")


@jinja2.pass_context  # not folded at compile time (see `checked_filter`)
def join_filter(context: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
    """jinja's `join`, its items read into a list and measured first."""
    eval_ctx = context.eval_ctx
    items = list(value) if attribute is None else list(map(make_attrgetter(eval_ctx.environment, attribute), value))
    _check_join(d, items, "the join filter")
    return jinja2.filters.sync_do_join(eval_ctx, items, d)


@jinja2.pass_context  # as `join_filter`
def sum_filter(context: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """jinja's `sum`, its items read into a list and, when it adds lists or
    tuples, their total length refused past MAX_TEXT items first."""
    getter = make_attrgetter(context.environment, attribute) if attribute is not None else None
    items = list(iterable) if getter is None else list(map(getter, iterable))
    if isinstance(start, (list, tuple)):
        check_size(len(start) + sum(len(i) for i in items if isinstance(i, (list, tuple))), "the sum filter")
    return sum(items, start)


# The filters that build text from their value (all refuse a value whose text
# would pass MAX_TEXT) and the check of what each adds.
FILTER_CHECKS = {
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


def join_output(chunks: Any) -> str:
    """How jinja joins what a macro, call block, filter block, block or
    `{% set %}` block rendered (`environment.concat`), refused past MAX_TEXT
    characters: each chunk is capped, but a body may print a value twice."""
    chunks = list(chunks)
    check_size(sum(map(len, chunks)), "joining a block's output")
    return "".join(chunks)


def finalize(value: Any) -> Any:
    """What `{{ value }}` prints, refused if it is not a string and its text would pass MAX_TEXT."""
    if not isinstance(value, str):
        check_size(text_size(value), "printing a value")
    return value


def lipsum(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> str:  # noqa: A002 (jinja's names)
    """jinja's `lipsum`, refused past MAX_TEXT characters (words of 12 at most, and a space)."""
    if is_int(n) and is_int(max):
        check_size(n * max * 13, "lipsum")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def concat(use_markup: bool, *values: Any) -> str:
    """`a ~ b ~ ...` as jinja compiles it (`markup_join` where the template
    autoescapes, else `str_join`), refused if it would build more than MAX_TEXT
    characters."""
    check_size(sum(map(text_size, values)), "the ~ operator")
    return (markup_join if use_markup else str_join)(values)


class CheckEveryConcat(NodeTransformer):
    """Route every `~` (a `nodes.Concat`) through `concat`, as the sandbox
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
                if sum(text_size(n.as_const(self.eval_ctx)) for n in node.nodes) <= MAX_TEXT:
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
