"""The same request gets the same answer: a probe that sends chat prompts alone, inside a
crowd of other requests, and again all together (their prefixes now in the prefix cache),
and compares the tokens and logprobs of each situation bit for bit.

Greedy and seeded sampling both: a seeded draw is a function of (seed, position), so with
the logits invariant the sampled tokens are too. The crowd's requests vary in prompt length
(1 to ~300 tokens) and output length, so each probed prompt is prefilled in chunks and
decoded in steps of varying sizes beside them.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from conftest import together

WORDS = ("river", "stone", "light", "amber", "north", "quiet", "seven", "glass", "field")

# 20 chat questions of varied kinds (the chat template adds SmolLM2's system prompt, so
# every one shares a ~30-token prefix with the others)
PROMPTS = (
    "What is the capital of France?",
    "Which planet is closest to the sun?",
    "Write a haiku about the sea.",
    "List three colors of the rainbow.",
    "Explain what a binary search does.",
    "Who wrote Romeo and Juliet?",
    "What is 17 times 3?",
    "Give me a name for a small bakery.",
    "How do plants make their food?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Fahrenheit?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "What does a CPU do?",
    "Suggest a title for a mystery novel.",
    "How many legs does a spider have?",
    "What is the largest ocean on Earth?",
    "Write the first line of a fairy tale.",
    "What is photosynthesis in five words?",
)


@dataclass(frozen=True, slots=True)
class Answer:
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]


def ask(url: str, model: str, prompt: str, max_tokens: int, seed: int | None) -> Answer:
    """A chat completion with the chosen tokens' logprobs: greedy, or sampled with `seed`."""
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "logprobs": True,
        "temperature": 0.0 if seed is None else 0.9,
    }
    if seed is not None:
        body["seed"] = seed
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    return Answer(tuple(t["token"] for t in content), tuple(t["logprob"] for t in content))


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def crowd_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 300)))


def asked(prompts: tuple[str, ...], seeded: int) -> list[tuple[str, int | None]]:
    """Every prompt greedy, and the first `seeded` also sampled with their index as seed."""
    return [(p, None) for p in prompts] + [(p, i) for i, p in enumerate(prompts[:seeded])]


def probe(
    url: str, prompts: tuple[str, ...], seeded: int, max_tokens: int, crowd: int
) -> dict[str, list[Answer]]:
    """The `asked` requests in three situations: "alone" (one request at a time), "crowd"
    (all together with `crowd` other requests), "again" (all together once more, their
    prompts now in the prefix cache: one batch, where one at a time would repeat "alone"'s
    many steps)."""
    model = served_model(url)
    asks = asked(prompts, seeded)
    alone = [ask(url, model, p, max_tokens, s) for p, s in asks]
    rng = random.Random(0)
    others = [(crowd_prompt(rng), rng.randint(4, 3 * max_tokens)) for _ in range(crowd)]
    with ThreadPoolExecutor(len(asks) + crowd) as pool:
        mine = [pool.submit(ask, url, model, p, max_tokens, s) for p, s in asks]
        theirs = [pool.submit(ask, url, model, p, n, None) for p, n in others]
        in_crowd = [f.result() for f in mine]
        for f in theirs:
            f.result()
    again = together(*(lambda p=p, s=s: ask(url, model, p, max_tokens, s) for p, s in asks))
    return {"alone": alone, "crowd": in_crowd, "again": again}


def differences(
    situations: dict[str, list[Answer]], asks: list[tuple[str, int | None]]
) -> list[str]:
    """Which request answered differently in which situation."""
    labels = [f"{p!r} " + ("greedy" if s is None else f"seed {s}") for p, s in asks]
    alone = situations["alone"]
    found = []
    for name, answers in situations.items():
        for label, first, other in zip(labels, alone, answers, strict=True):
            if other != first:
                what = "tokens" if other.tokens != first.tokens else "logprobs"
                found.append(f"{label}: {what} differ {name} vs alone")
    return found


def assert_same_answers(
    url: str, prompts: tuple[str, ...], seeded: int, max_tokens: int, crowd: int
) -> None:
    """The server says it is batch-invariant, and every request answers alike alone, in the
    crowd and again."""
    info = httpx.get(f"{url}/info", timeout=30).json()
    assert info["kernels"]["determinism"].startswith("on:"), info["kernels"]
    situations = probe(url, prompts, seeded, max_tokens, crowd)
    found = differences(situations, asked(prompts, seeded))
    assert not found, "\n".join(found)
    assert all(answer.tokens for answer in situations["alone"])
