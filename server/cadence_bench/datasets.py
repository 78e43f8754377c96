"""Benchmark workloads: a list of requests, each a prompt with its token length and the
number of tokens to generate.

- `random`: prompts cut from real English text (corpus.txt) to an exact token length;
  fixed or uniformly ranged input and output lengths.
- `sharegpt-like`: lengths drawn from log-normal fits of the ShareGPT statistics vLLM's
  paper publishes (mean input 161 tokens, mean output 338), prompts as in `random`.
- `capped-exponential`: outputs exponentially distributed with a mean of 128 tokens,
  rejection-sampled below a cap (the continuous-batching benchmark the documents cite).
- `grounded`: the model is given a passage of the corpus and asked to repeat it, or to
  rewrite it fixing the spelling mistakes put into it, in the model's chat template; the
  answer copies spans of the prompt (the workload prompt-lookup speculation serves).
- `jsonl`: one request per line, {"prompt": str, "output_len": int} ("max_tokens" is
  accepted for output_len).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

CORPUS = Path(__file__).with_name("corpus.txt")
# vLLM paper (Kwon et al., 2023), Fig. 11: ShareGPT mean input 161.31, output 337.99
# tokens; both long-tailed. A log-normal with sigma 1 has that shape.
SHAREGPT_MEAN_INPUT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99
SHAREGPT_SIGMA = 1.0


@dataclass(slots=True, frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int
    # the LoRA adapter the request asks for (None: the base model)
    adapter: str | None = None


def load_tokenizer(path: str | None) -> Tokenizer:
    """A model folder or tokenizer.json; None: the embedded SmolLM2 model's (its folder
    made first if no server has made it yet)."""
    if path is None:
        from cadence.model_source import resolve_model

        path = resolve_model(None)
    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


class PromptMaker:
    """Prompts of exactly n tokens: a numbered header (so no two prompts share a prefix
    the server could cache) followed by a window of the corpus at a random offset."""

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator) -> None:
        self.tok = tokenizer
        self.rng = rng
        self.ids = tokenizer.encode(CORPUS.read_text(), add_special_tokens=False).ids
        self.count = 0

    def _count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def make(self, n: int) -> str:
        self.count += 1
        header = f"{self.count}. " if n >= 8 else ""  # very short prompts: text only
        start = int(self.rng.integers(len(self.ids)))
        body = max(0, n - self._count(header))
        # Decoding a window and re-encoding it can merge tokens at its edges; adjust the
        # window until the whole prompt is exactly n tokens (a few passes at most).
        for _ in range(8):
            window = [self.ids[(start + i) % len(self.ids)] for i in range(body)]
            text = header + self.tok.decode(window)
            diff = n - self._count(text)
            if diff == 0 or body + diff < 0:
                return text
            body += diff
        return text


def _lengths(spec: tuple[int, int], count: int, rng: np.random.Generator) -> list[int]:
    low, high = spec
    return [int(x) for x in rng.integers(low, high + 1, size=count)]


def random_dataset(
    tokenizer: Tokenizer,
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    """(low, high) lengths, inclusive; low == high for a fixed length."""
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    ins, outs = _lengths(input_len, num, rng), _lengths(output_len, num, rng)
    return [_request(maker, i, o) for i, o in zip(ins, outs, strict=True)]


def _lognormal(mean: float, count: int, cap: int, rng: np.random.Generator) -> list[int]:
    mu = math.log(mean) - SHAREGPT_SIGMA**2 / 2  # the log-normal's mean is exp(mu + s²/2)
    draws = rng.lognormal(mu, SHAREGPT_SIGMA, size=count)
    return [int(min(cap, max(4, round(x)))) for x in draws]


def sharegpt_like_dataset(
    tokenizer: Tokenizer, num: int, max_input: int = 1024, max_output: int = 2048, seed: int = 0
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    ins = _lognormal(SHAREGPT_MEAN_INPUT, num, max_input, rng)
    outs = _lognormal(SHAREGPT_MEAN_OUTPUT, num, max_output, rng)
    return [_request(maker, i, o) for i, o in zip(ins, outs, strict=True)]


def capped_exponential(
    count: int, cap: int, rng: np.random.Generator, mean: float = 128.0
) -> list[int]:
    """Output lengths ~ Exponential(mean), redrawn while above `cap`; at least 1."""
    out: list[int] = []
    while len(out) < count:
        x = max(1, round(rng.exponential(mean)))
        if x <= cap:
            out.append(int(x))
    return out


def capped_exponential_dataset(
    tokenizer: Tokenizer, num: int, input_len: int, cap: int, mean: float = 128.0, seed: int = 0
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    return [_request(maker, input_len, o) for o in capped_exponential(num, cap, rng, mean)]


def jsonl_dataset(tokenizer: Tokenizer, path: str, num: int | None = None) -> list[BenchRequest]:
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row or not ("output_len" in row or "max_tokens" in row):
            raise ValueError(f"{path}:{lineno}: needs 'prompt' and 'output_len' (or max_tokens)")
        prompt = str(row["prompt"])
        n = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
        requests.append(BenchRequest(prompt, n, int(row.get("output_len", row.get("max_tokens")))))
        if num is not None and len(requests) == num:
            break
    return requests


# What a grounded request asks for: an exact copy, or a copy with its spelling fixed (the
# passage then carries a few swapped letters, so the answer departs from it at those words).
GROUNDED_TASKS = (
    ("Repeat the following text exactly:", False),
    ("Rewrite the following text, fixing any spelling mistakes, and output the whole text:", True),
)
TYPO_RATE = 1 / 15  # of the words of five letters or more, in a passage to fix

# The whole prompt an instruct model expects around one user message.
ChatRenderer = Callable[[str], str]


def plain_message(message: str) -> str:
    """For a tokenizer without a chat template: the message as it is."""
    return message


def load_chat_renderer(path: str | None) -> ChatRenderer:
    """The chat template of a model folder (its tokenizer_config.json's, through
    transformers) as a one-user-message renderer ending where the assistant's answer
    starts; None: the embedded model's. A bare tokenizer.json or a folder without a
    template: the message as plain text."""
    from cadence.model_source import resolve_model

    folder = Path(resolve_model(None) if path is None else path)
    if not folder.is_dir():
        return plain_message
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if not tok.chat_template:
        return plain_message

    def render(message: str) -> str:
        messages = [{"role": "user", "content": message}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(text)

    return render


def add_typos(text: str, rng: np.random.Generator, rate: float = TYPO_RATE) -> str:
    """Swaps two inner letters in about `rate` of the words of five letters or more."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) >= 5 and w.isalpha() and rng.random() < rate:
            j = int(rng.integers(1, len(w) - 2))  # keeps the first and last letters
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


class GroundedPromptMaker:
    """Prompts of exactly n tokens, template included: a task, then a passage of the corpus
    starting at a sentence, as much of it as fits."""

    def __init__(
        self, tokenizer: Tokenizer, render: ChatRenderer, rng: np.random.Generator
    ) -> None:
        self.tok = tokenizer
        self.render = render
        self.rng = rng
        self.ids = tokenizer.encode(CORPUS.read_text(), add_special_tokens=False).ids
        self.starts = [
            i
            for i in range(1, len(self.ids))
            if tokenizer.decode([self.ids[i - 1]]).rstrip().endswith((".", "!", "?"))
        ]
        self.count = 0

    def _count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def _prompt(self, instruction: str, passage: str) -> str:
        return self.render(f"{instruction}\n\n{passage}")

    def make(self, n: int) -> tuple[str, str]:
        """(prompt, the passage as it appears in it)."""
        instruction, typos = GROUNDED_TASKS[self.count % len(GROUNDED_TASKS)]
        self.count += 1
        frame = self._count(self._prompt(instruction, ""))
        if n <= frame:
            raise ValueError(f"grounded prompts need more than {frame} tokens, got {n}")
        first = int(self.rng.integers(len(self.starts)))
        typo_seed = int(self.rng.integers(2**31))
        # As in PromptMaker: tokens merge at the passage's end and typos re-tokenize, so
        # its length is adjusted until the whole prompt is n tokens; where one token more
        # or less steps over n, the passage starts at the next sentence instead.
        for shift in range(len(self.starts)):
            start = self.starts[(first + shift) % len(self.starts)]
            body = n - frame
            for _ in range(8):
                window = [self.ids[(start + i) % len(self.ids)] for i in range(body)]
                passage = self.tok.decode(window).strip()
                if typos:
                    passage = add_typos(passage, np.random.default_rng(typo_seed))
                prompt = self._prompt(instruction, passage)
                diff = n - self._count(prompt)
                if diff == 0:
                    return prompt, passage
                if body + diff < 1:
                    break
                body += diff
        raise ValueError(f"no passage makes a prompt of exactly {n} tokens")


def grounded_dataset(
    tokenizer: Tokenizer,
    render: ChatRenderer,
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    """(low, high) lengths as in `random_dataset`; input_len counts the whole prompt."""
    rng = np.random.default_rng(seed)
    maker = GroundedPromptMaker(tokenizer, render, rng)
    ins, outs = _lengths(input_len, num, rng), _lengths(output_len, num, rng)
    return [BenchRequest(maker.make(i)[0], i, o) for i, o in zip(ins, outs, strict=True)]


def _request(maker: PromptMaker, input_len: int, output_len: int) -> BenchRequest:
    return BenchRequest(maker.make(input_len), input_len, output_len)
