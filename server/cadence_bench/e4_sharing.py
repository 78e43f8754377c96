"""E4's second half: the KV blocks saved by sharing. The same prompts sent at once to
/v1/completions with n = 1, 2, 4, 8 parallel samples, then as beam searches of width 2,
4, 8; the peak of `cadence_kv_blocks_used` (and, for beams,
`cadence_kv_blocks_shared_by_beams`) polled during each run, set against W (or n) × the
n = 1 run's peak, what the same sequences would hold unshared, and the analytic count."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from cadence_bench.exp_records import Record
from cadence_bench.exp_runner import Context, Measured, Planned
from cadence_bench.kv import MetricsSampler, shared_sampling_blocks

SAMPLES = (1, 2, 4, 8)
BEAMS = (2, 4, 8)
SHARE_PROMPTS = 4
SHARE_PROMPT_LEN = 512
SHARE_GEN = 128
POLL_S = 0.02


def _body(kind: str, width: int, prompt: str, max_tokens: int, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "n": width,
        "ignore_eos": True,
    }
    if kind == "beams":
        body |= {"use_beam_search": True, "temperature": 0.0}
    else:
        body |= {"temperature": 1.0, "seed": 4}
    return body


def send_all(
    url: str, kind: str, width: int, prompts: list[str], max_tokens: int
) -> tuple[float, int]:
    """Every prompt at once to /v1/completions with n = width samples (or a beam search
    of that width); returns the wall time and the completion tokens of all answers."""

    async def go() -> int:
        async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
            model = str((await client.get("/v1/models")).json()["data"][0]["id"])

            async def one(prompt: str) -> int:
                r = await client.post(
                    "/v1/completions", json=_body(kind, width, prompt, max_tokens, model)
                )
                r.raise_for_status()
                return int(r.json()["usage"]["completion_tokens"])

            return sum(await asyncio.gather(*(one(p) for p in prompts)))

    start = time.perf_counter()
    tokens = asyncio.run(go())
    return time.perf_counter() - start, tokens


def _measure(url: str, kind: str, width: int, prompts: list[str], gen: int) -> Measured:
    with MetricsSampler(url, every=POLL_S) as sampler:
        wall, tokens = send_all(url, kind, width, prompts, gen)
    result = {
        "duration_s": wall,
        "completed": len(prompts),
        "failed": 0,
        "total_output_tokens": tokens,
        "output_throughput": tokens / wall if wall > 0 else 0.0,
        "request_throughput": len(prompts) / wall if wall > 0 else 0.0,
    }
    extras = {
        "peak_blocks_used": int(sampler.peak("cadence_kv_blocks_used")),
        "peak_shared_by_beams": int(sampler.peak("cadence_kv_blocks_shared_by_beams")),
        "samples": len(sampler.samples),
    }
    return Measured(result, [], extras)


def plan(
    ctx: Context, prompts: list[str], prompt_len: int, gen: int, block_size: int
) -> list[Planned]:
    widths = [("samples", n) for n in SAMPLES] + [("beams", w) for w in BEAMS]
    items = []
    for kind, width in widths:

        def measure(url: str, kind: str = kind, width: int = width) -> Measured:
            return _measure(url, kind, width, prompts, gen)

        slug = f"samples-n{width}" if kind == "samples" else f"beams-w{width}"
        label = f"n={width} parallel samples" if kind == "samples" else f"beam width {width}"
        items.append(
            Planned(
                slug=slug,
                label=label,
                config={"kind": kind, "width": width},
                flags=list(ctx.server_args),
                requests=len(prompts),
                measure=measure,
                determinants={
                    "prompts": len(prompts),
                    "prompt_len": prompt_len,
                    "gen": gen,
                    "block_size": block_size,
                    "kind": kind,
                    "width": width,
                },
            )
        )
    return items


def analytic_blocks(
    kind: str, prompt_len: int, gen: int, width: int, block_size: int
) -> tuple[int, int]:
    """Blocks one prompt's `width` sequences hold at the end of generation: (shared,
    unshared). Beams hold the prompt's full blocks once. Parallel samples fork once the
    first has computed the prompt and each recomputes the last prompt token into its own
    copy of that token's block, so a prompt ending on a block boundary shares one block
    fewer than the documents' count."""
    shared, unshared = shared_sampling_blocks(prompt_len, gen, width, block_size)
    if kind == "samples" and width > 1 and prompt_len % block_size == 0:
        shared += width - 1
    return shared, unshared


def sharing_rows(
    records: dict[str, Record], prompts: int, prompt_len: int, gen: int, block_size: int
) -> list[dict[str, Any]]:
    """One row per measured width: the peak blocks, W × the n = 1 peak (unshared), what
    was saved against it, and the analytic counts (prompt shared, the rest per sequence)."""
    one = records.get("samples-n1")
    base = one.extras["peak_blocks_used"] if one else None
    rows = []
    for slug in [f"samples-n{n}" for n in SAMPLES] + [f"beams-w{w}" for w in BEAMS]:
        record = records.get(slug)
        if record is None:
            continue
        width = int(record.config["width"])
        peak = int(record.extras["peak_blocks_used"])
        shared, unshared = analytic_blocks(
            record.config["kind"], prompt_len, gen, width, block_size
        )
        unshared_peak = width * base if base is not None else None
        rows.append(
            {
                "kind": record.config["kind"],
                "width": width,
                "peak": peak,
                "shared_by_beams": int(record.extras.get("peak_shared_by_beams", 0)),
                "unshared_peak": unshared_peak,
                "saved": None if unshared_peak is None else 1 - peak / max(unshared_peak, 1),
                "analytic_shared": prompts * shared,
                "analytic_unshared": prompts * unshared,
                "wall_s": float(record.result["duration_s"]),
            }
        )
    return rows


def sharing_section(
    ctx: Context,
    records: dict[str, Record],
    prompt_len: int,
    gen: int,
    block_size: int,
    command: str,
) -> str:
    rows = sharing_rows(records, SHARE_PROMPTS, prompt_len, gen, block_size)
    text = (
        "## Blocks saved by sharing\n\n"
        f"{SHARE_PROMPTS} prompts of {prompt_len} tokens sent at once to /v1/completions for "
        f"{gen} tokens each (EOS ignored): n = {', '.join(map(str, SAMPLES))} parallel samples "
        f"(temperature 1), then beam searches of width {', '.join(map(str, BEAMS))} "
        f"(`use_beam_search`, n = W). Peak `cadence_kv_blocks_used` and "
        f"`cadence_kv_blocks_shared_by_beams` polled every {POLL_S * 1000:.0f} ms. "
        "`W × n=1 peak` is what the W sequences would hold without sharing (W copies of "
        "the n = 1 run); `analytic` counts the blocks at the end of generation with the "
        "prompt's full blocks held once and everything after them per sequence (shared), "
        "against every sequence holding its own prompt (unshared). Two departures from "
        "that count: beams can share more, their common generated prefix too; parallel "
        "samples fork after the first has computed the prompt and each recomputes the last "
        "prompt token into its own copy of its block, so a prompt that ends on a block "
        "boundary shares one block fewer per extra sample (counted in the analytic "
        "column). Made by `" + command + "`.\n\n"
        "| kind | W | peak blocks used | peak shared by beams | W × n=1 peak | saved | "
        "analytic shared | analytic unshared | wall s |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        unshared = "?" if r["unshared_peak"] is None else str(r["unshared_peak"])
        saved = "?" if r["saved"] is None else f"{r['saved']:.0%}"
        beams = str(r["shared_by_beams"]) if r["kind"] == "beams" else "-"
        text += (
            f"| {r['kind']} | {r['width']} | {r['peak']} | {beams} | {unshared} | {saved} | "
            f"{r['analytic_shared']} | {r['analytic_unshared']} | {r['wall_s']:.1f} |\n"
        )
    measured = [r for r in rows if r["width"] > 1 and r["saved"] is not None]
    if measured:
        text += "\nComputed from the table: sharing saved " + ", ".join(
            f"{r['saved']:.0%} at {r['kind']} {r['width']}" for r in measured
        )
        text += " of the blocks W unshared copies of the n = 1 run hold at their peak.\n"
    return text
