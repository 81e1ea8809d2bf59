"""verifiers (prime-rl's environments) against the server: a `SingleTurnEnv`
over a dataset built here, evaluated through verifiers' chat-completions
client with `logprobs` and `return_token_ids`, as prime-rl's orchestrator
asks for them. The token ids and logprobs verifiers records for each
rollout must be the ones the checkpoint gives: prompt ids as transformers'
tokenizer renders the chat template, completion logprobs as transformers
recomputes them teacher-forced on the same checkpoint."""

from __future__ import annotations

import asyncio

import pytest
import torch
import verifiers as vf
from datasets import Dataset
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.factories import hf_logprobs

QUESTIONS = [("2+2=", "4"), ("Say hi", "hi"), ("Capital of France?", "Paris")]
ROLLOUTS = 2
MAX_TOKENS = 12


def exact_match(completion, answer: str, **kwargs) -> float:
    return float(completion[-1]["content"].strip() == answer)


# verifiers' plain chat client, asked for logprobs and token ids; and the token client prime-rl's
# orchestrator trains with, which asks for both itself (its first turn is a plain chat completion).
@pytest.fixture(scope="module", params=["OpenAIChatCompletionsClient", "OpenAIChatCompletionsTokenClient"])
def evaluation(tiny_server, request):
    dataset = Dataset.from_list([{"question": q, "answer": a} for q, a in QUESTIONS])
    env = vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[exact_match]))
    openai = AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key=tiny_server.api_key, max_retries=0)
    sampling = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "logprobs": True}
    sampling["extra_body"] = {"return_token_ids": True}

    async def run():
        try:
            return await env.evaluate(
                getattr(vf.clients, request.param)(openai),
                model="tiny",
                sampling_args=sampling,
                num_examples=len(QUESTIONS),
                rollouts_per_example=ROLLOUTS,
                state_columns=["trajectory"],
                on_progress=lambda *a, **k: None,
            )
        finally:
            await openai.close()

    return asyncio.run(run())["outputs"]


@pytest.fixture(scope="module")
def reference(tiny_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(tiny_path)


def question(out) -> str:
    return QUESTIONS[out["example_id"]][0]


def test_every_rollout_completes_and_is_scored(evaluation):
    assert len(evaluation) == len(QUESTIONS) * ROLLOUTS
    assert sorted(o["example_id"] for o in evaluation) == sorted(list(range(len(QUESTIONS))) * ROLLOUTS)
    for out in evaluation:
        assert out["is_completed"] and out.get("error") is None, out["error"]
        assert out["reward"] == exact_match(out["completion"], out["answer"])


def test_tokens_and_logprobs_align_with_the_checkpoint(evaluation, reference):
    model, tokenizer = reference
    for out in evaluation:
        (step,) = out["trajectory"]
        tokens = step["tokens"]
        assert tokens is not None, "verifiers found no token ids or logprobs in the response"
        prompt, completion, logprobs = tokens["prompt_ids"], tokens["completion_ids"], tokens["completion_logprobs"]
        messages = [{"role": "user", "content": question(out)}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert 0 < len(completion) == len(logprobs) <= MAX_TOKENS
        assert tokens["completion_mask"] == [1] * len(completion)
        assert tokenizer.decode(completion, skip_special_tokens=True) == out["completion"][-1]["content"]
        expected = hf_logprobs(model, prompt, completion)
        assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), expected, atol=1e-4), (logprobs, expected)
