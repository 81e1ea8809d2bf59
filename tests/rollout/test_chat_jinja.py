"""A chat template is the checkpoint's code: a rendering that loops past its
time limit is stopped, a value too large to build in one step is refused, and
every failure (syntax, undefined, raise_exception, Python errors, the time
limit) is a `ChatTemplateError`, a `ValueError` naming the template."""

from __future__ import annotations

import threading
import time

import jinja2
import pytest

from rollout.chat import ChatTemplate

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
    with pytest.raises(ValueError, match="time_limit_s must be a number of seconds > 0"):
        ChatTemplate({"default": ""}, {}, time_limit_s=limit)
