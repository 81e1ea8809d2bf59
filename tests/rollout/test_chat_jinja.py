"""A chat template is the checkpoint's code: a rendering that loops past its
time limit is stopped, a value too large to build in one step is refused before
it is built (and one just under the cap still renders, as a real template
renders unchanged), and every failure (syntax, undefined, raise_exception, Python errors, the time
limit) is a `ChatTemplateError`, a `ValueError` naming the template."""

from __future__ import annotations

import json
import threading
import time

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rollout.chat import ChatTemplate
from rollout.chat_jinja import MAX_TEXT

USER = {"role": "user", "content": "hi"}
LIMIT_S = 0.2
# Each would run for minutes (or for ever) unbounded.
LOOPING = {
    # No call, lookup or output inside: only the tick each iteration makes meets the deadline.
    "silent-nested-loops": "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
    "chatty-nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "recursive-macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
}


def _render_in_thread(template: ChatTemplate, **kwargs) -> tuple[BaseException | None, float]:
    """The error `render` raised and its seconds; fails (instead of hanging) if it runs on."""
    outcome: dict = {}

    def render() -> None:
        start = time.monotonic()
        try:
            template.render([USER], **kwargs)
        except Exception as e:  # noqa: BLE001 (handed to the test)
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=render, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the rendering ran on past its time limit"
    return outcome.get("error"), outcome["seconds"]


@pytest.mark.parametrize("source", LOOPING.values(), ids=LOOPING.keys())
def test_a_looping_template_stops_at_its_time_limit(source):
    error, seconds = _render_in_thread(ChatTemplate({"default": source}, {}, time_limit_s=LIMIT_S))
    assert isinstance(error, ValueError) and isinstance(error, jinja2.TemplateError)
    assert str(error) == f"the chat template 'default' ran past its time limit of {LIMIT_S:g} s"
    assert LIMIT_S <= seconds < LIMIT_S + 5.0  # the margin is for a loaded CI host


BROKEN = [
    ("{% for m in messages %}{{ m.content }}", "cannot be compiled: Unexpected end of template"),
    ("{{ messages[0].content.nope.deeper }}", "failed: 'str object' has no attribute 'nope'"),
    ("{{ raise_exception('roles must alternate') }}", "failed: roles must alternate"),
    ("{{ messages|length // 0 }}", "failed: ZeroDivisionError: integer division or modulo by zero"),
    (
        "{{ messages[0].content.__class__.__base__ }}",
        "failed: access to attribute '__class__' of 'str' object is unsafe",
    ),
    ("{{ 'x' * 1000000 }}", "failed: repeating a sequence to more than 100000 items is not allowed"),
    ("{{ messages * 100001 }}", "failed: repeating a sequence to more than 100000 items is not allowed"),
    ("{{ 7 ** 100000000 }}", "failed: 7 ** 100000000 is too large for a chat template"),
]


@pytest.mark.parametrize(("source", "message"), BROKEN)
@pytest.mark.parametrize("name", ["default", "tool_use"])
def test_every_template_failure_is_a_value_error_naming_the_template(source, message, name):
    templates = {"default": "{{ messages[0].content }}", name: source}
    error, _ = _render_in_thread(ChatTemplate(templates, {}), tools=[{"type": "function"}])
    assert isinstance(error, ValueError) and isinstance(error, jinja2.TemplateError)
    assert str(error).startswith(f"the chat template {name!r} {message}")


def test_small_repetitions_and_powers_still_render():
    source = "{{ '=' * 3 }}{{ [1] * 2 }}{{ 2 ** 10 }}{{ 3 * 4 }}{{ 1.5 ** 2 }}"
    source += "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ChatTemplate({"default": source}, {}).render([USER]) == "===[1, 1]1024122.25hi"


@pytest.mark.parametrize("limit", [0, -1.0, "2", True, None])
def test_a_bad_time_limit_is_refused_naming_it(limit):
    with pytest.raises(ValueError, match="time_limit_s must be a number > 0"):
        ChatTemplate({"default": ""}, {}, time_limit_s=limit)


def _doubling(step: str, start: str, times: int) -> str:
    """A namespace value doubled `times` times with `step` (`~` or `+`): 2**times long."""
    loop = f"{{% for i in range({times}) %}}{{% set ns.s = ns.s {step} ns.s %}}{{% endfor %}}"
    return f"{{% set ns = namespace(s={start}) %}}{loop}{{{{ ns.s|length }}}}"


def _doubling_in(body: str) -> str:
    """`body` run 30 times on a namespace value `ns.s` that starts as "x"."""
    return f"{{% set ns = namespace(s='x') %}}{{% for i in range(30) %}}{body}{{% endfor %}}{{{{ ns.s|length }}}}"


BLOCK = "joining a block's output"
# Each builds far more than MAX_TEXT (4 Mi) characters or items in one step, most
# of them in well under the 2 s time limit, so only the size check refuses them.
BOMBS = {
    "printed-in-a-loop": (
        "{% set s = 'x' * 100000 %}{% for i in range(50) %}{{ s }}{% endfor %}",
        "the rendered prompt",
    ),
    "percent-width": ("{{ '%01000000000d' % 1 }}", "the % operator"),
    "percent-precision": ("{{ '%.100000000d' % 1 }}", "the % operator"),
    "percent-star-width": ("{{ '%*d' % (100000000, 1) }}", "the % operator"),
    "percent-keyed-width": ("{{ '%(a(b))0100000000d' % {'a(b)': 1} }}", "the % operator"),
    "percent-repeated-value": ("{% set s = 'x' * 100000 %}{{ '%s' * 50 % ((s,) * 50) }}", "the % operator"),
    "concat-doubling": (_doubling("~", "'x'", 30), "the ~ operator"),
    "plus-doubling": (_doubling("+", "'x'", 30), "the + operator"),
    "plus-list-doubling": (_doubling("+", "[1]", 30), "the + operator"),
    "concat-of-a-long-list": ("{{ (['x' * 100000] * 100) ~ '' }}", "the ~ operator"),
    # Constants a filter makes are not folded at compile time, where nothing would check them.
    "concat-of-constants": ("{{ ('x'|center(3000000)) ~ ('x'|center(3000000)) }}", "the ~ operator"),
    "center-filter": ("{{ 'x'|center(100000000) }}", "the center filter"),
    "indent-filter": ("{{ 'a\nb'|indent(100000000) }}", "the indent filter"),
    "wordwrap-filter": ("{{ ('ab ' * 30000)|wordwrap(1, wrapstring='x' * 1000) }}", "the wordwrap filter"),
    "format-filter": ("{{ '%0100000000d'|format(1) }}", "the format filter"),
    "replace-filter": ("{{ ('a' * 100000)|replace('a', 'b' * 100) }}", "the replace filter"),
    "join-filter": ("{{ (['a' * 100000] * 100)|join }}", "the join filter"),
    "center-method": ("{{ 'x'.center(100000000) }}", "str.center"),
    "ljust-method": ("{{ 'x'.ljust(100000000) }}", "str.ljust"),
    "rjust-method": ("{{ 'x'.rjust(100000000) }}", "str.rjust"),
    "zfill-method": ("{{ '1'.zfill(100000000) }}", "str.zfill"),
    "expandtabs-method": ("{{ ('\t' * 1000).expandtabs(100000) }}", "str.expandtabs"),
    "replace-method": ("{{ ('a' * 100000).replace('a', 'b' * 100) }}", "str.replace"),
    "join-method": ("{{ ''.join(['a' * 100000] * 100) }}", "str.join"),
    "format-method": ("{{ '{:>100000000}'.format(1) }}", "str.format"),
    "format-method-nested-width": ("{{ '{:>{}}'.format(1, 100000000) }}", "str.format"),
    "format-map-method": ("{{ ('{a}' * 100).format_map({'a': 'x' * 100000}) }}", "str.format_map"),
    # The text of a list of one long string, many times over.
    "print-a-long-list": ("{% set s = 'x' * 100000 %}{{ [s] * 100 }}", "printing a value"),
    "string-filter": ("{{ (['x' * 100000] * 100)|string }}", "the string filter"),
    "pprint-filter": ("{{ (['x' * 100000] * 100)|pprint }}", "the pprint filter"),
    "string-of-dict-items": ("{{ dict.fromkeys(range(100), 'x' * 100000).items()|string }}", "the string filter"),
    "tojson-filter": ("{{ (['x' * 100000] * 100)|tojson }}", "the tojson filter"),
    "tojson-indent": ("{{ [[[1]]]|tojson(indent=100000000) }}", "the tojson filter"),
    "tojson-of-tojson": ("{{ '\"'" + "|tojson" * 24 + " }}", "the tojson filter"),  # each doubles it
    "urlize-filter": ("{{ ('http://a.b ' * 1000)|urlize(target='x' * 100000) }}", "the urlize filter"),
    "batch-filter": ("{{ [1]|batch(10000000, 0)|list }}", "the batch filter"),
    "slice-filter": ("{{ [1]|slice(5000000)|list }}", "the slice filter"),
    "sum-filter": ("{% set l = [1] * 100000 %}{{ ([l] * 100)|sum(start=[]) }}", "the sum filter"),
    "lipsum": ("{{ lipsum(10, false, 100000, 100001) }}", "lipsum"),
    "translate-method": ("{{ ('a' * 100000).translate({97: 'x' * 100}) }}", "str.translate"),
    # A body that prints a value twice doubles it when jinja joins what it rendered.
    "set-block-doubling": (_doubling_in("{% set s %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = s %}"), BLOCK),
    "macro-doubling": (
        "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}" + _doubling_in("{% set ns.s = d(ns.s) %}"),
        BLOCK,
    ),
    "call-block-doubling": (
        "{% macro d() %}{{ caller() }}{{ caller() }}{% endmacro %}"
        + _doubling_in("{% set s %}{% call d() %}{{ ns.s }}{% endcall %}{% endset %}{% set ns.s = s %}"),
        BLOCK,
    ),
    "filter-block-doubling": (
        _doubling_in("{% set s %}{% filter lower %}{{ ns.s }}{{ ns.s }}{% endfilter %}{% endset %}{% set ns.s = s %}"),
        BLOCK,
    ),
    "self-block-doubling": (
        "{% set ns = namespace(s='x') %}{% block b %}{{ ns.s }}{{ ns.s }}{% endblock %}"
        "{% for i in range(30) %}{% set ns.s = self.b() %}{% endfor %}",
        BLOCK,
    ),
}


@pytest.mark.parametrize(("source", "step"), BOMBS.values(), ids=BOMBS.keys())
def test_a_step_that_would_build_too_large_a_value_is_refused_before_it_builds_it(source, step):
    error, _ = _render_in_thread(ChatTemplate({"default": "{{ 1 }}", "tool_use": source}, {}), tools=[{}])
    assert isinstance(error, ValueError) and isinstance(error, jinja2.TemplateError)
    # Refused by the size check (its message), not stopped by the time limit.
    assert (
        str(error)
        == f"the chat template 'tool_use' failed: {step} would build more than {MAX_TEXT} characters or items"
    )


# Just under (or at) the cap: each renders, its length computed by hand.
UNDER_THE_CAP = {
    "percent-width": ("{{ ('%04194200d' % 7)|length }}", 4194200),  # 10 + 4194200 + 1 characters counted
    "concat-doubling": (_doubling("~", "'x'", 22), 1 << 22),
    "plus-doubling": (_doubling("+", "'x'", 22), 1 << 22),
    "plus-list-doubling": (_doubling("+", "[1]", 22), 1 << 22),
    "center-filter": ("{{ ('x'|center(4194304))|length }}", 4194304),
    "replace-filter": ("{{ (('a' * 100000)|replace('a', 'b' * 41))|length }}", 4100000),
    "join-filter": ("{{ ((['a' * 100000] * 41)|join(','))|length }}", 4100040),
    "format-method": ("{{ '{:>4194200}'.format(1)|length }}", 4194200),  # 11 + 1 + 4194200 counted
    "tojson-filter": ("{{ ((['x' * 100000] * 41)|tojson)|length }}", 41 * 100002 + 40 * 2 + 2),
    "macro-doubling": (
        "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}"
        "{% for i in range(22) %}{% set ns.s = d(ns.s) %}{% endfor %}{{ ns.s|length }}",
        1 << 22,
    ),
    "print-a-list": ("{% set s = 'x' * 100000 %}{{ ([s] * 41)|string|length }}", 41 * 100002 + 40 * 2 + 2),
}


@pytest.mark.parametrize(("source", "length"), UNDER_THE_CAP.values(), ids=UNDER_THE_CAP.keys())
def test_a_value_just_under_the_cap_still_renders(source, length):
    assert MAX_TEXT == 1 << 22  # the lengths above are computed for this cap
    assert ChatTemplate({"default": source}, {}).render([USER]) == str(length)


def test_small_sums_and_formats_still_render():
    source = "{{ 'a' + 'b' }}{{ [1] + [2] }}{{ (1,) + (2,) }}{{ 1 + 2.5 }}{{ 7 % 3 }}"
    source += "|{{ '%5d|%-3s|%%|%.2f' % (3, 'a', 1.5) }}"
    source += "|{{ '%(x)s!' % {'x': 'y'} }}|{{ 'x'|center(5) }}|{{ 'a\nb'|indent(2) }}|{{ 'a b'|wordwrap(1) }}"
    source += "|{{ '%s-%s'|format(1, 2) }}|{{ 'aXa'|replace('X', 'yy') }}|{{ ['a', 'b']|join(',') }}"
    source += "|{{ 'x'.ljust(3) ~ 'x'.rjust(3) }}|{{ '{:>4}{}'.format(1, 2) }}|{{ ','.join(['a', 'b']) }}"
    expected = "ab[1, 2](1, 2)3.51|    3|a  |%|1.50|y!|  x  |a\n  b|a\nb|1-2|ayya|a,b|x    x|   12|a,b"
    assert ChatTemplate({"default": source}, {}).render([USER]) == expected


# `~` and the filters go through checking functions; what they render is what
# jinja renders, in and out of `{% autoescape %}` (a constant or a value) and in
# macros, call blocks and blocks, where jinja picks its join at compile time.
UNCHANGED = [
    "{{ 'a' ~ 'b' ~ 1 }}{{ x ~ 1 ~ none ~ [1, 'a'] ~ {'k': 2} }}{% set y %}{{ x ~ x }}{% endset %}{{ y }}",
    "{% autoescape true %}{{ '<'|safe ~ x }}|{{ x ~ x }}|{{ '<' ~ '<'|safe }}{% endautoescape %}{{ '<'|safe ~ x }}",
    "{% autoescape flag %}{{ '<'|safe ~ x }}|{{ x ~ x }}{% autoescape true %}{{ x|safe ~ x }}{% endautoescape %}"
    "{% endautoescape %}",
    "{% autoescape true %}{% macro m(a) %}{{ a|safe ~ x }}{% endmacro %}"
    "{% autoescape false %}{{ m('<') }}{% endautoescape %}{% endautoescape %}",
    "{% macro m() %}[{{ caller() }}]{% endmacro %}{% for i in range(2) %}{{ loop.index ~ '-' ~ i }}{% endfor %}"
    "{% call m() %}{{ x ~ 'c' }}{% endcall %}",
    "{% block b %}{% autoescape true %}{{ '<'|safe ~ x }}{% endautoescape %}{{ '<'|safe ~ x }}{% endblock %}",
    "{% autoescape flag %}{{ '<a>'|replace('a', '<') }}{{ ['<', 'b'|safe]|join('&') }}{{ x|replace('<', '&'|safe) }}"
    "{{ x|indent(2, true) }}{{ '<%s'|format(x) }}{{ x|center(5) }}{{ 'ab'|wordwrap(1) }}{% endautoescape %}"
    "{{ [{'a': '<'}]|join(',', attribute='a') }}{{ ('<' ~ x)|wordwrap(1, wrapstring=x) }}",
    "{{ [x, 1]|string }}{{ {'a': [x]}|pprint }}{{ [x]|tojson }}{{ {'a': [1, {'b': x}]}|tojson(indent=2) }}"
    "{{ [x, 2] }}{{ x|e|e|upper|trim }}{{ [[1], [2]]|sum(start=[]) }}{{ [1, 2]|sum }}{{ [1, 2, 3]|batch(2, 0)|list }}"
    "{{ [1, 2, 3]|slice(2)|list }}{{ 'see http://example.com & ftp://x.org'|urlize(20, true, '_b', 'r', ['ftp:']) }}"
    "{{ ('a' ~ x ~ 'b').translate({97: 'yz', 98: none}) }}",
]


def _transformers_tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@pytest.mark.parametrize("source", UNCHANGED)
@pytest.mark.parametrize("flag", [True, False])
def test_checked_steps_render_as_jinja_renders_them(source, flag):
    jinja = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    jinja.filters["tojson"] = _transformers_tojson
    expected = jinja.from_string(source).render(x="<", flag=flag)
    assert ChatTemplate({"default": source}, {}).render([USER], x="<", flag=flag) == expected
