"""The chat-session example on the real chat model: coherent turns, and every
token of the trajectory computed once across its turns."""

from __future__ import annotations

import re
import sys


def test_chat_session_example(smollm2_path, monkeypatch, capsys):
    from examples import chat_session

    monkeypatch.setattr(sys, "argv", ["chat_session", "--max-tokens", "24"])
    chat_session.main()
    out = capsys.readouterr().out
    assert "assistant: The capital of France is Paris." in out
    total, sampled, computed = map(int, re.search(r"(\d+) tokens, (\d+) sampled.*?: (\d+) tokens", out).groups())
    assert 0 < sampled < total and computed == total - 1  # the last sampled token is never computed
