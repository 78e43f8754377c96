"""The same request gets the same answer (docs/determinism.md): SmolLM2 in float32 (its
GGUF's float copy, float32 KV cache), 20 chat prompts greedy and 10 of them seeded, alone,
inside a crowd of 40 other requests and again after their prefixes are cached: tokens and logprobs
bit for bit. The default launch (the GGUF as it is, bfloat16) is probed in test_cpu_paths,
2 shards in test_multi_shard, n-gram speculation in test_speculative_serving and
preemption (recompute and swap) with chunked prefill in test_scheduler, each on the server
its module already runs. (This probe replaced a check that 32 concurrent requests each
equal their output alone: it checks the same on the same server, logprobs included.)"""

from __future__ import annotations

from invariance import PROMPTS, assert_same_answers

from conftest import LaunchedServer


def test_float32_answers_do_not_depend_on_the_batch_or_the_prefix_cache(
    smollm_server: LaunchedServer,
) -> None:
    assert_same_answers(smollm_server.url, PROMPTS, seeded=10, max_tokens=8, crowd=40)
