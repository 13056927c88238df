"""The router's raw ASGI responses: a streamed body's messages as the server receives them."""

from __future__ import annotations

from serve_app.http import send_stream


async def _messages(pieces: list[bytes], last_after: int | None) -> list[dict]:
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    taken = 0

    async def gen():
        nonlocal taken
        for p in pieces:
            taken += 1
            yield p

    last = None if last_after is None else (lambda: taken == last_after)
    await send_stream(send, 200, gen(), content_type="text/event-stream", last=last)
    return sent


async def test_a_stream_ends_with_an_empty_message_when_its_end_is_unknown():
    sent = await _messages([b"a", b"b"], None)
    assert [m.get("body") for m in sent[1:]] == [b"a", b"b", b""]
    assert [m.get("more_body", False) for m in sent[1:]] == [True, True, False]


async def test_the_last_piece_carries_the_end_of_the_response():
    # one message (one write downstream) for the last piece and the end, not two
    sent = await _messages([b"a", b"b"], 2)
    assert sent[0]["type"] == "http.response.start"
    assert [m.get("body") for m in sent[1:]] == [b"a", b"b"]
    assert [m.get("more_body", False) for m in sent[1:]] == [True, False]
