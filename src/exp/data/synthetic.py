"""The embedded default dataset: a seeded, generated instruction task that ships with the project.

Each example is Alpaca-shaped ({instruction, input, output}) so it flows through the same tokenisation and
loss-masking code as a user's file. The task (repeat a random list of words) has one right answer that a model
can only produce by reading the prompt, so held-out exact match measures learning rather than memorisation.
(Reversal was tried first: a randomly initialised 4-layer model with rank-8 adapters on q/v learns copying in
minutes on two CPU cores, reversal not.)
"""

from __future__ import annotations

import random

# Single-token words once the local tokenizer is trained (see exp.model.local): short, common, distinct.
WORDS: tuple[str, ...] = (
    "red",
    "blue",
    "green",
    "black",
    "white",
    "gold",
    "cat",
    "dog",
    "fox",
    "owl",
    "bee",
    "ant",
    "sun",
    "moon",
    "star",
    "rain",
    "snow",
    "wind",
    "tree",
    "leaf",
    "rock",
    "sand",
    "lake",
    "hill",
)
INSTRUCTION = "Repeat the words exactly."
MIN_WORDS, MAX_WORDS = 3, 6


def generate_examples(num_examples: int, seed: int) -> list[dict[str, str]]:
    """`num_examples` distinct-looking examples drawn with `seed` (same seed, same list, on every machine)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        words = [rng.choice(WORDS) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
        rows.append({"instruction": INSTRUCTION, "input": " ".join(words), "output": " ".join(words)})
    return rows


def corpus_for_tokenizer() -> list[str]:
    """Text the local tokenizer is trained on: the task's words plus enough English to tokenise prompts."""
    rows = generate_examples(2000, seed=12345)
    text = [f"{r['instruction']} {r['input']} {r['output']}" for r in rows]
    text += [
        "### Instruction: ### Input: ### Response: Below is an instruction that describes a task.",
        "Write a response that appropriately completes the request. The quick brown fox jumps over the lazy dog.",
    ]
    return text
