"""The reference for grammar-constrained greedy decoding: transformers runs the model and,
before each argmax, llguidance's own mask for the same grammar removes the disallowed
tokens (every EOS id allowed wherever the grammar may end, as cadence documents).

The mask's bits are read here with numpy, not with `llguidance.torch.apply_token_bitmask_inplace`:
that helper is a `torch.compile`d kernel, and the code inductor generates for AVX2
(`ATEN_CPU_CAPABILITY=avx2`, or a CPU without AVX-512) lets half the vocabulary through
(torch 2.15: 24,576 of 49,152 tokens for a mask allowing one), which made this reference,
not cadence, wrong."""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

# The JSON layout cadence compiles schemas with unless a schema sets its own x-guidance.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)


def regex_grammar(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def choice_grammar(options: list[str]) -> str:
    import json

    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(o) for o in options)
    )


def allowed_tokens(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Token i is allowed where bit i % 32 of the mask's word i // 32 is set."""
    words = bitmask.numpy().astype("<i4")  # little-endian: bit i is byte i // 8's bit i % 8
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:width]
    return torch.from_numpy(bits.astype(bool))


class ConstrainedReference:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        width = self.model.config.vocab_size
        self.info = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=width)
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}

    def greedy(self, prompt_ids: list[int], grammar: str, max_new_tokens: int) -> list[int]:
        """Greedy tokens under `grammar`, ending with the EOS it samples (if any)."""
        matcher = llguidance.LLMatcher(self.info, grammar)
        assert not matcher.is_error(), matcher.get_error()
        width = self.model.config.vocab_size
        bitmask = llguidance.torch.allocate_token_bitmask(1, width)
        ids = torch.tensor([prompt_ids])
        past = None
        out: list[int] = []
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                result = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                past = result.past_key_values
                logits = result.logits[0, -1].float().clone()
                allowed = torch.zeros(width, dtype=torch.bool)
                if not matcher.is_stopped():
                    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                    allowed = allowed_tokens(bitmask[0], width)
                if matcher.is_stopped() or matcher.is_accepting():
                    allowed[list(self.eos)] = True
                logits[~allowed] = float("-inf")
                token = int(torch.argmax(logits))
                out.append(token)
                if token in self.eos:
                    break
                assert matcher.consume_token(token), matcher.get_error()
                ids = torch.tensor([[token]])
        return out
