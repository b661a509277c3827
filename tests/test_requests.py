"""The one request tracker (common/link/requests.py): ids, resolve, discard, fail all at
once, resend on a new session; and the producer's SUBMIT item sizing without packing the
payload. Pure asyncio, no sockets (fast)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from ccsq.common.link.requests import RequestTracker
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import AdminFailed, BrokerUnavailable
from ccsq.producer.items import item_size


def test_ids_resolve_once_and_late_replies_are_dropped() -> None:
    async def main() -> None:
        t: RequestTracker[str, str] = RequestTracker()
        a, b = t.next_id(), t.next_id()
        assert (a, b) == (1, 2)
        fa, fb = t.register(a, "msg-a"), t.register(b, "msg-b")
        with pytest.raises(ValueError):
            t.register(a)
        assert len(t) == 2
        assert t.resolve(b, "reply-b") and await fb == "reply-b"
        assert not t.resolve(b, "again") and not t.resolve(99, "stranger")  # duplicate, unknown
        assert len(t) == 1 and not fa.done()
        t.discard(a)
        assert fa.cancelled() and len(t) == 0 and not t.resolve(a, "late")
        t.discard(a)  # no error twice

    asyncio.run(main())


def test_fail_all_ends_every_wait_and_resend_all_skips_the_answered() -> None:
    async def main() -> None:
        t: RequestTracker[str, str] = RequestTracker()
        futs = {req: t.register(req, f"m{req}") for req in (t.next_id() for _ in range(3))}
        futs[4] = t.register(4)  # no message: not re-sent
        t.resolve(2, "ok")
        sent: list[str] = []
        assert t.resend_all(sent.append) == 2 and sent == ["m1", "m3"]
        assert t.fail_all(AdminFailed("ERR: no")) == 3 and len(t) == 0
        for req in (1, 3, 4):
            with pytest.raises(AdminFailed, match="no"):
                await futs[req]
        assert await futs[2] == "ok" and t.fail_all(BrokerUnavailable()) == 0 and t.next_id() == 4

    asyncio.run(main())


@pytest.mark.parametrize("inline_len", [None, 0, 1, 255, 256, 65535, 65536, 300_000])
def test_item_size_is_the_packed_size_without_packing_the_payload(inline_len: int | None) -> None:
    data = None if inline_len is None else b"x" * inline_len
    blob = protocol.Blob("a" * 64, 7 if data is None else len(data), data)
    item = protocol.SubmitItem("k" * 70, "ocr", blob, params={"lang": "en", "dpi": 300, "z": 1.5}, priority=-3, deadline_ts=1e9)
    assert item_size(item) == len(msgpack.packb(protocol.encode_body(item), use_bin_type=True))
    assert item.payload.inline == data  # sizing left the item as it was


def test_a_reply_split_over_frames_completes_once_whole() -> None:
    """add_part keeps each frame; the wait ends when ``complete`` says the parts answer it."""
    import asyncio

    from ccsq.common.link.requests import RequestTracker

    def complete(msg, parts):
        got = [x for part in parts for x in part]
        return got if set(msg) <= set(got) else None

    async def run() -> None:
        t: RequestTracker[list, list] = RequestTracker()
        req = t.next_id()
        fut = t.register(req, ["a", "b", "c"])
        assert t.add_part(req, ["a"], complete) and not fut.done()
        assert t.add_part(req, ["b", "c"], complete) and fut.done() and fut.result() == ["a", "b", "c"]
        assert not t.add_part(req, ["c"], complete) and len(t) == 0  # late frame: nothing waits

    asyncio.run(run())
