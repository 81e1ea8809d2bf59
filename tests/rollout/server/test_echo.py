"""Prompt logprobs on the server: completions' `echo` with `logprobs` (OpenAI's
legacy shape, the first entry None), `max_tokens=0`, batched token-id prompts,
vLLM's `prompt_logprobs`, the tokenizer routes, and the 400s naming a bad
field; values against transformers' log-softmax on the served checkpoint."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from tests.rollout.server.conftest import CHATML

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def hf(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_path)).eval()


@pytest.fixture(scope="module")
def tok(tiny_path):
    return Tokenizer.from_file(str(tiny_path / "tokenizer.json"))


def _log_softmax(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def _post(server, path, body):
    with server.http() as c:
        return c.post(path, json=body)


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs(tiny_server, hf, tok):
    ids = tok.encode(PROMPT).ids
    r = _post(tiny_server, "/v1/completions", dict(prompt=PROMPT, echo=True, max_tokens=0, logprobs=2, temperature=0))
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = choice["logprobs"]
    strings = [tok.decode([t]) for t in ids]
    assert lp["tokens"] == strings and len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _log_softmax(hf, ids)
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-4
        top = lp["top_logprobs"][i]
        best = ref[i - 1].topk(2)
        expected = {tok.decode([t]): v for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)}
        expected[strings[i]] = ref[i - 1, ids[i]].item()
        assert top.keys() == expected.keys()
        assert all(abs(top[k] - expected[k]) < 1e-4 for k in top)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len(PROMPT) - len(strings[-1])


def test_echo_before_a_completion_and_batched_token_id_prompts(tiny_server, hf, tok):
    prompts = [tok.encode(PROMPT).ids, tok.encode("a dog").ids]
    r = _post(
        tiny_server,
        "/v1/completions",
        dict(prompt=prompts, echo=True, max_tokens=3, logprobs=1, temperature=0, return_token_ids=True),
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for c, ids in zip(choices, prompts, strict=True):
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
        assert c["text"].startswith(tok.decode(ids)) and len(c["text"]) > len(tok.decode(ids))
        assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == 3
        greedy = ids + c["token_ids"]
        ref = _log_softmax(hf, greedy)
        values = lp["token_logprobs"][1:]
        assert values == pytest.approx(ref[torch.arange(len(greedy) - 1), torch.tensor(greedy[1:])].tolist(), abs=1e-4)
    plain = _post(tiny_server, "/v1/completions", dict(prompt=prompts[1], echo=True, max_tokens=2, temperature=0))
    assert plain.json()["choices"][0]["text"].startswith(tok.decode(prompts[1]))
    assert plain.json()["choices"][0]["logprobs"] is None


def test_vllm_prompt_logprobs_on_both_endpoints(tiny_server, hf, tok):
    ids = tok.encode(PROMPT).ids
    r = _post(
        tiny_server, "/v1/completions", dict(prompt=PROMPT, max_tokens=1, prompt_logprobs=2, return_token_ids=True)
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["prompt_token_ids"] == ids
    entries = choice["prompt_logprobs"]
    ref = _log_softmax(hf, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        best = ref[i - 1].topk(2).indices.tolist()
        assert set(entries[i]) == {str(t) for t in best} | {str(ids[i])}
        assert entries[i][str(best[0])]["rank"] == 1 and entries[i][str(best[1])]["rank"] == 2
        assert abs(entries[i][str(ids[i])]["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
        assert entries[i][str(ids[i])]["decoded_token"] == tok.decode([ids[i]])
    messages = [{"role": "user", "content": "hi"}]
    r = _post(tiny_server, "/v1/chat/completions", dict(messages=messages, max_tokens=1, prompt_logprobs=0))
    assert r.status_code == 200, r.text
    chat_entries = r.json()["prompt_logprobs"]
    assert chat_entries[0] is None and all(len(e) == 1 for e in chat_entries[1:])


def _streamed(client, **body) -> dict[int, dict]:
    """Each choice of a streamed completion put together: text, logprobs lists, the chunks' texts."""
    choices: dict[int, dict] = {}
    for chunk in client.completions.create(model="tiny", stream=True, **body):
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"text": "", "chunks": [], "logprobs": None, "extra": []})
            got["text"] += c.text
            got["chunks"].append(c.text)
            got["extra"].append(c.model_extra.get("prompt_logprobs"))
            got["finish_reason"] = c.finish_reason
            if c.logprobs is not None and c.logprobs.tokens:
                lp = c.logprobs.model_dump()
                got["logprobs"] = lp if got["logprobs"] is None else {k: got["logprobs"][k] + lp[k] for k in lp}
    return choices


def test_streamed_echo_equals_the_whole_answer_through_the_openai_client(tiny_server, hf, tok):
    """vLLM's streamed echo: each choice's first chunk holds the prompt's text and its
    tokens' logprobs before the first sampled ones; put together, the chunks equal the
    answer without streaming (and the prompt logprobs transformers' log-softmax)."""
    client = tiny_server.openai()
    body = dict(prompt=[PROMPT, "a dog"], echo=True, logprobs=2, max_tokens=3, temperature=0, n=2)
    extra = dict(extra_body={"prompt_logprobs": 1})
    whole = client.completions.create(model="tiny", **body, **extra).model_dump()["choices"]
    streamed = _streamed(client, **body, **extra)
    assert sorted(streamed) == [0, 1, 2, 3]
    for c in whole:
        got, prompt = streamed[c["index"]], [PROMPT, "a dog"][c["index"] // 2]
        assert got["chunks"][0].startswith(prompt) and got["text"] == c["text"]
        assert got["finish_reason"] == c["finish_reason"] == "length"
        assert got["logprobs"]["tokens"] == c["logprobs"]["tokens"]
        assert got["logprobs"]["text_offset"] == c["logprobs"]["text_offset"]
        assert got["logprobs"]["token_logprobs"][0] is None and got["logprobs"]["top_logprobs"][0] is None
        assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(c["logprobs"]["token_logprobs"][1:], abs=1e-5)
        for a, b in zip(got["logprobs"]["top_logprobs"][1:], c["logprobs"]["top_logprobs"][1:], strict=True):
            assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
        assert got["extra"][0] == c["prompt_logprobs"] and got["extra"][1:] == [None] * (len(got["extra"]) - 1)
    ids = tok.encode(PROMPT).ids
    ref = _log_softmax(hf, ids)
    values = streamed[0]["logprobs"]["token_logprobs"][1 : len(ids)]
    assert values == pytest.approx(ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist(), abs=1e-4)
    (only,) = _streamed(client, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0).values()  # the prompt alone
    assert only["text"] == PROMPT and only["finish_reason"] == "length"
    assert only["logprobs"]["token_logprobs"][1:] == pytest.approx(values, abs=1e-5)


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", dict(prompt="a", logprobs=21), "logprobs"),
        ("/v1/completions", dict(prompt="a", prompt_logprobs=-1), "prompt_logprobs"),
        ("/v1/completions", dict(prompt="a", prompt_logprobs=21), "prompt_logprobs"),
        ("/v1/completions", dict(prompt="a", max_tokens=0), "max_tokens"),
        (
            "/v1/chat/completions",
            dict(messages=[{"role": "user", "content": "a"}], prompt_logprobs=1, stream=True),
            "prompt_logprobs",
        ),
        ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "a"}], echo=True), "echo"),
        ("/tokenize", dict(prompt="a", messages=[{"role": "user", "content": "a"}]), "prompt"),
        ("/detokenize", dict(tokens=[5, 10**6]), "tokens"),
    ],
)
def test_bad_values_are_400s_naming_the_field(tiny_server, path, body, field):
    r = _post(tiny_server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_tokenizer_routes_in_vllms_shapes(tiny_server, tok, tiny_engine):
    r = _post(tiny_server, "/tokenize", dict(prompt=PROMPT, add_special_tokens=False, return_token_strs=True))
    assert r.status_code == 200, r.text
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    assert r.json() == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": list(PROMPT)}
    assert _post(tiny_server, "/tokenize", dict(prompt=PROMPT)).json()["tokens"] == tok.encode(PROMPT).ids
    messages = [{"role": "user", "content": "hi"}]
    chat = _post(tiny_server, "/tokenize", dict(messages=messages)).json()["tokens"]
    assert chat == tiny_engine.generate([messages], max_tokens_one())[0].prompt_token_ids
    assert _post(tiny_server, "/detokenize", dict(tokens=ids)).json() == {"prompt": PROMPT}
    with tiny_server.http() as c:
        info = c.get("/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["chat_template"] == CHATML
    assert info["model_max_length"] == 1024


def max_tokens_one():
    from rollout import SamplingParams

    return SamplingParams(max_tokens=1)
