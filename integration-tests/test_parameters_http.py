"""Each TGI decoding parameter, sent over HTTP, changes the output the way its definition
says. The exact arithmetic of every processor is checked against reference computations
in server/tests/test_sampling.py; these tests prove the wiring from JSON to the shard."""

from __future__ import annotations

import httpx

from conftest import together

PROMPT = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat"


def generate(client: httpx.Client, inputs: str = PROMPT, **parameters) -> dict:
    parameters.setdefault("max_new_tokens", 16)
    parameters["details"] = True
    response = client.post("/generate", json={"inputs": inputs, "parameters": parameters})
    assert response.status_code == 200, response.text
    return response.json()


def ids(body: dict) -> list[int]:
    return [token["id"] for token in body["details"]["tokens"]]


def sampled_with_seeds(client: httpx.Client, **parameters) -> set[tuple[int, ...]]:
    """The four seeds' samples, sent together (a seeded draw depends on the seed and the
    position only, so the batch they share changes none)."""
    answers = together(
        *(
            lambda seed=seed: generate(
                client, do_sample=True, temperature=1.5, seed=seed, **parameters
            )
            for seed in (1, 2, 3, 4)
        )
    )
    return {tuple(ids(answer)) for answer in answers}


def test_top_k_1_and_min_p_near_1_equal_greedy(client: httpx.Client) -> None:
    greedy = ids(generate(client))
    assert sampled_with_seeds(client, top_k=1) == {tuple(greedy)}
    # min_p keeps tokens with p >= min_p * p_max: at 0.999 only the argmax survives.
    assert sampled_with_seeds(client, min_p=0.999) == {tuple(greedy)}


def test_typical_p_tiny_leaves_one_candidate_per_step(client: httpx.Client) -> None:
    assert len(sampled_with_seeds(client)) > 1, "plain sampling should vary with the seed"
    assert len(sampled_with_seeds(client, typical_p=1e-6)) == 1


def test_top_p_tiny_equals_greedy(client: httpx.Client) -> None:
    greedy = ids(generate(client))
    assert sampled_with_seeds(client, top_p=1e-6) == {tuple(greedy)}


def test_repetition_penalty_stops_greedy_repeating_the_prompt(client: httpx.Client) -> None:
    prompt_ids = {t["id"] for t in client.post("/tokenize", json={"inputs": PROMPT}).json()}
    plain = ids(generate(client))
    assert set(plain) & prompt_ids, "the unpenalized continuation repeats the prompt"
    penalized = ids(generate(client, repetition_penalty=1e4))
    # Dividing a positive logit by 1e4 (or multiplying a negative one) removes every seen
    # token from contention while unseen tokens remain.
    assert not set(penalized) & prompt_ids
    assert len(set(penalized)) == len(penalized), "no generated token repeats either"


def test_presence_and_frequency_penalties_only_push_away_generated_tokens(
    client: httpx.Client,
) -> None:
    plain = ids(generate(client, max_new_tokens=24))
    assert len(set(plain)) < len(plain), "greedy repeats itself here"
    for name in ("presence_penalty", "frequency_penalty"):
        penalized = ids(generate(client, max_new_tokens=24, **{name: 2.0}))
        assert penalized != plain, name
        # Both penalties lower only tokens already generated, so greedy can first leave the
        # unpenalized path exactly where that path repeats one of its own tokens.
        first = next(i for i, (a, b) in enumerate(zip(plain, penalized, strict=False)) if a != b)
        assert plain[first] in plain[:first], (name, first)


def test_truncate_keeps_the_last_tokens_of_the_input(client: httpx.Client) -> None:
    long_input = "one two three four five six seven eight nine ten eleven twelve"
    body = generate(client, inputs=long_input, truncate=4, decoder_input_details=True)
    prefill = body["details"]["prefill"]
    assert len(prefill) == 4
    last_four = [t["id"] for t in client.post("/tokenize", json={"inputs": long_input}).json()][-4:]
    assert [t["id"] for t in prefill] == last_four
