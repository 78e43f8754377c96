"""The benchmark client against a real HTTP server on loopback that, as llama.cpp's
server does between requests, closes a kept-alive connection just as the next request
arrives on it: the request goes again on a fresh connection instead of counting as a
failure, and a server that never answers still fails it."""

from __future__ import annotations

import asyncio
import json

from cadence_bench.client import send, session
from cadence_bench.datasets import BenchRequest

EVENTS = [
    {"choices": [{"text": " hi"}]},
    {"choices": [{"text": " there"}]},
    {"choices": [], "usage": {"completion_tokens": 2}},
]
BODY = "".join(f"data: {json.dumps(e)}\n\n" for e in EVENTS) + "data: [DONE]\n\n"


async def _read_request(reader: asyncio.StreamReader) -> bool:
    """Reads one HTTP/1.1 request (headers and body); False at the end of the stream."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return False
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return True


async def _serve(answer_per_connection: int) -> tuple[asyncio.Server, list[int]]:
    """Answers the first `answer_per_connection` requests of each connection, then drops
    the connection on the next one without a byte; counts requests per connection."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(0)
        try:
            while await _read_request(reader):
                seen[-1] += 1
                if seen[-1] > answer_per_connection:
                    break
                payload = BODY.encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    + f"Content-Length: {len(payload)}\r\nConnection: keep-alive\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, seen


async def _two_requests(answer_per_connection: int) -> tuple[list, list[int]]:
    server, seen = await _serve(answer_per_connection)
    port = server.sockets[0].getsockname()[1]
    request = BenchRequest(prompt="hello", prompt_len=1, output_len=2)
    async with server, session(f"http://127.0.0.1:{port}", connections=1) as client:
        outputs = [await send(client, "openai", request, ignore_eos=True, model="m")]
        outputs.append(await send(client, "openai", request, ignore_eos=True, model="m"))
    return outputs, seen


def test_a_kept_alive_connection_the_server_dropped_is_retried_on_a_fresh_one():
    outputs, seen = asyncio.run(_two_requests(answer_per_connection=1))
    assert [o.success for o in outputs] == [True, True], [o.error for o in outputs]
    assert [o.output_tokens for o in outputs] == [2, 2]
    assert seen == [2, 1]  # the second request was dropped once, then answered anew


def test_a_server_that_drops_every_request_still_fails_it():
    outputs, seen = asyncio.run(_two_requests(answer_per_connection=0))
    assert not any(o.success for o in outputs)
    assert all("ServerDisconnected" in o.error for o in outputs)
    assert seen == [1, 1, 1, 1]  # each request tried twice, never more
