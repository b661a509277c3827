"""The producer's fast batch paths agree with the one rule each copies: the idempotency key
of an input never changes (existing ledgers dedup across versions), ``build_many`` builds
the items ``build`` builds and refuses bad input the same way (on generated specs too), an
inline blob made on the loop is the claim store's own, and the one-frame shortcut of
``AsyncClient._frames`` gives the frames the splitter gives. Pure, no sockets (fast)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
import types
from typing import NamedTuple
from pathlib import Path

import msgpack
import pytest

from ccsq.common.storage.claimstore import open_store
from ccsq.common.wire import protocol
from ccsq.common.wire.errors import InvalidRequest, PayloadTooLarge
from ccsq.common.wire.frames import FRAME_SLACK_BYTES, FrameBudget, split_frames
from ccsq.producer.client import AsyncClient
from ccsq.producer.items import (ItemBuilder, canonical_params, derive_key, item_size, item_size_bound,
                                 unchecked_constructor)


@pytest.mark.parametrize(("args", "key"), [
    (("0" * 64, "echo", {}), "f10f63e1f4a2e7599839b6112d7e2728ea6954a80438b58fccf8398b7ab3493e"),
    (("ab" * 32, "ocr", {"lang": "en", "dpi": 300, "z": 1.5, "b": b"\x00x", "n": None, "t": True, "u": "\u00e9\u6f22"}),
     "2150031106ba736a76385be1dd52db037ea6ba11ab284fdc7442f39dfecc9afb"),
    (("ab" * 32, "kind-\u00e9", {"t": 1764604800.123}), "7a63069c3564c748fa2ee7ed3370e45d2721bd176809ee2ec180d6b35e8c2ae0"),
])
def test_derived_keys_are_the_keys_of_earlier_versions(args: tuple, key: str) -> None:
    assert derive_key(*args) == key  # the keys every earlier version derived: a ledger's dedup depends on them


def _random_item(rng: random.Random) -> protocol.SubmitItem:
    def text(n: int) -> str:
        return "".join(rng.choice(["a", "Z", "9", "\u00e9", "\u6f22", "\U0001f600", "-"]) for _ in range(n))

    def scalar() -> protocol.Scalar:
        return rng.choice([None, True, False, rng.randint(-(1 << 63), (1 << 64) - 1), rng.random() * 1e300, -0.0,
                           text(rng.choice([0, 5, 31, 32, 300])), bytes(rng.choice([0, 3, 255, 256, 70000]))])

    inline = rng.choice([None, b"", b"x" * rng.choice([1, 255, 256, 65535, 65536, 200_000])])
    blob = protocol.Blob("c" * 64, rng.randint(0, 1 << 40) if inline is None else len(inline), inline)
    return protocol.SubmitItem(text(rng.randint(1, 400)), text(rng.randint(1, 128)), blob,
                        params={text(rng.choice([1, 40, 300])): scalar() for _ in range(rng.randint(0, 20))},
                        priority=rng.randint(protocol.PRIO_MIN, protocol.PRIO_MAX), deadline_ts=rng.choice([None, 1e9, -1.5]),
                        max_attempts=rng.randint(0, 1000), max_runtime_s=rng.choice([0.0, 3.5]),
                        origin=rng.choice([b"", b"o" * 300]), origin_sig=rng.choice([b"", b"s" * 64]))


def test_item_size_bound_is_never_below_the_packed_size() -> None:
    rng = random.Random(15)
    for _ in range(400):
        item = _random_item(rng)
        exact = len(msgpack.packb(protocol.encode_body(item), use_bin_type=True))
        assert item_size(item) == exact
        assert exact <= item_size_bound(item) <= exact + 600 + 4 * (len(item.key) + len(item.kind)) + 20 * len(item.params) + \
            4 * sum(len(k) + (len(v) if isinstance(v, str) else 0) for k, v in item.params.items())


@pytest.mark.parametrize("budget", [300, 5_000, 150_000, 1 << 20])
@pytest.mark.parametrize("count", [1, 99, 1000, 1001])
def test_frames_are_what_the_splitter_gives(budget: int, count: int) -> None:
    rng = random.Random(budget + count)
    inlines = [b"y" * rng.choice([10, 1024]) for _ in range(count)]
    items = [protocol.SubmitItem(f"{i:064x}", "echo", protocol.Blob("d" * 64, len(data), data), params={"t": 1.5})
             for i, data in enumerate(inlines)]
    frame = budget + FRAME_SLACK_BYTES if budget >= FRAME_SLACK_BYTES else 2 * budget  # room_bytes == budget
    client = types.SimpleNamespace(_budget=FrameBudget(frame, max_items=1000), _too_large=lambda item, n: PayloadTooLarge(f"{n}"))
    assert client._budget.room_bytes == budget
    try:
        expected = split_frames(items, size_of=item_size, budget_bytes=budget, max_items=1000,
                                too_large=client._too_large)
    except PayloadTooLarge:
        with pytest.raises(PayloadTooLarge):
            AsyncClient._frames(client, items)
        return
    assert AsyncClient._frames(client, items) == expected


def _builder(tmp_path: Path) -> ItemBuilder:
    return ItemBuilder(open_store(f"file://{tmp_path / 'store'}", base_dir=tmp_path, create=True), 64)


def test_build_many_builds_what_build_builds(tmp_path: Path) -> None:
    b = _builder(tmp_path)
    big = b"B" * 1000  # over inline_max_bytes: to the claim store
    specs = [(b"doc", "echo"), (big, "ocr", {"lang": "en"}), {"payload": b"x", "kind": "echo", "key": "k1", "priority": 3},
             (bytearray(b"doc"), "echo", {})]

    async def main() -> None:
        many = await b.build_many(specs)
        one = [await b.build(s[0], s[1], params=s[2] if len(s) == 3 else None) if isinstance(s, tuple)
               else await b.build(**s) for s in specs]
        assert many == one
        assert many[1].payload.inline is None and b.store.exists(many[1].payload.sha256)
        assert many[0].key == many[3].key == derive_key(many[0].payload.sha256, "echo", {})
        assert many[2].key == "k1" and many[2].priority == 3

    try:
        asyncio.run(main())
    finally:
        b.close()


async def _outcome(coro: object) -> tuple:
    try:
        return ("ok", await coro)  # type: ignore[misc]
    except Exception as exc:  # noqa: BLE001 - compared as is: type and message
        return ("raised", type(exc), str(exc))


def _packed(items: list[protocol.SubmitItem]) -> bytes:
    return msgpack.packb([protocol.encode_body(item) for item in items], use_bin_type=True)  # tells 1 from 1.0 and True


@pytest.mark.parametrize("seed", range(3))
def test_build_many_agrees_with_build_on_generated_specs(tmp_path: Path, seed: int) -> None:
    """``build_many``'s tuple specs take a copy of ``build``'s steps (``_checked_tuple_fields``,
    the kind's key bytes once per batch, the item made positionally): on generated batches of
    good and bad specs it gives the items ``build`` gives one by one, or the refusal ``build``
    gives for the first bad spec (same type, same message)."""
    rng = random.Random(seed)
    b = _builder(tmp_path)

    def pick(good: list[object], bad: list[object]) -> object:
        return rng.choice(good if rng.random() < 0.85 else bad)

    def kind() -> object:
        return pick(["echo", "ocr", "echo", "e" * 128, "\u00e9\u6f22", "\U0001f600" * 3, "\x85"],
                    ["", "e" * 129, "k\x00", "tab\t", 5, None, b"echo"])

    def payload() -> object:
        return pick([b"", b"doc", b"doc", b"x" * 64, b"y" * 65, b"z" * 300, bytearray(b"ba"), memoryview(b"mv")],
                    [str(tmp_path / "missing-file"), 7])

    def params() -> object:
        if rng.random() < 0.15:
            return pick([None, {f"k{i}": i for i in range(protocol.MAX_MAP_LEN)}], [{f"k{i}": i for i in range(protocol.MAX_MAP_LEN + 1)}])
        good_keys, bad_keys = ["t", "lang", "", "\u00e9"], ["a\x00", 1, None]
        good_values = [None, True, False, 0, -1, (1 << 64) - 1, 1.5, -0.0, "", "\u00e9", b"\x00"]
        bad_values = [1 << 64, float("nan"), float("-inf"), "x\x00y", [1], object()]
        return {pick(good_keys, bad_keys): pick(good_values, bad_values) for _ in range(rng.randint(0, 3))}

    def spec() -> tuple:
        return (payload(), kind()) if rng.random() < 0.3 else (payload(), kind(), params())

    async def main() -> None:
        agreed = refused = 0
        for _ in range(150):
            specs = [spec() for _ in range(rng.randint(1, 4))]
            one: list[protocol.SubmitItem] = []
            expected: tuple = ("ok", one)
            for one_spec in specs:  # build, one by one, until the first refusal
                got = await _outcome(b.build(one_spec[0], one_spec[1], params=one_spec[2] if len(one_spec) == 3 else None))
                if got[0] != "ok":
                    expected = got
                    break
                one.append(got[1])
            many = await _outcome(b.build_many(specs))
            assert many[0] == expected[0] and (many[1:] == expected[1:] if many[0] != "ok" else
                                               many[1] == one and _packed(many[1]) == _packed(one)), (seed, specs)
            agreed += many[0] == "ok"
            refused += many[0] != "ok"
        assert agreed > 20 and refused > 20  # both sides of the rule are exercised

    try:
        asyncio.run(main())
    finally:
        b.close()


def test_blob_made_on_the_loop_is_what_the_store_makes(tmp_path: Path) -> None:
    """``ItemBuilder._blob_now`` (no coroutine hop) gives the store's ``put_blob`` blob exactly
    when the store says that needs no I/O (``inline_without_io``), else None: on the file
    store and on a store with a ``put_blob`` of its own, for sizes around ``inline_max_bytes``."""
    from ccsq.common.storage.claimstore import FileStore

    class OwnPutBlob(FileStore):
        def put_blob(self, data: bytes, inline_max_bytes: int) -> protocol.Blob:
            return super().put_blob(data, inline_max_bytes)

    rng = random.Random(26)
    for store in (FileStore(tmp_path / "plain"), OwnPutBlob(tmp_path / "own")):
        for inline_max in (0, 64, 4096):
            b = ItemBuilder(store, inline_max)
            try:
                for n in {0, 1, inline_max - 1, inline_max, inline_max + 1, *(rng.randrange(2 * inline_max + 2) for _ in range(20))}:
                    if n < 0:
                        continue
                    data = rng.randbytes(n)
                    now = b._blob_now(data)
                    if store.inline_without_io(n, inline_max):
                        assert now == store.put_blob(data, inline_max) and type(now) is protocol.Blob, (n, inline_max)
                    else:
                        assert now is None, (n, inline_max)
            finally:
                b.close()


@pytest.mark.parametrize(("spec", "error", "match"), [
    ((b"x",), InvalidRequest, "tuples or dicts"),
    ({"kind": "echo"}, InvalidRequest, "needs 'payload'"),
    ((b"x", ""), InvalidRequest, "kind must be a non-empty string"),
    ((b"x", "echo", {"n": float("nan")}), InvalidRequest, "not a finite number"),
    ((b"x", "echo", {1: "a"}), InvalidRequest, "must be a string"),
    ((b"x", "e\0cho"), InvalidRequest, "control characters"),
    ((b"x", 5), InvalidRequest, "kind must be a non-empty string"),
    ((b"x", "echo", {"a": object()}), InvalidRequest, "must be str, int, float"),
    ((b"x", "e" * 129), InvalidRequest, "kind must be 1..128"),
    (("/nonexistent/file", "echo"), InvalidRequest, "payload file"),
    ({"payload": b"x", "kind": "echo", "max_attempts": 0}, InvalidRequest, "max_attempts"),
    ({"payload": b"x", "kind": "echo", "colour": 1}, TypeError, "colour"),
])
def test_build_many_refuses_bad_input_before_writing_its_blob(tmp_path: Path, spec: object, error: type,
                                                              match: str) -> None:
    b = _builder(tmp_path)
    big = b"G" * 1000

    async def main() -> None:
        with pytest.raises(error, match=match):
            await b.build_many([(big, "echo"), spec, (b"H" * 1000, "echo")])

    try:
        asyncio.run(main())
        blobs = {sha for sha, _ in b.store.list()}
        assert len(blobs) == 1  # the good item before the bad one wrote its blob; nothing after it ran
    finally:
        b.close()


def test_canonical_params_after_a_refused_value_are_the_plain_packb_bytes() -> None:
    with pytest.raises(OverflowError):
        canonical_params({"a": 1 << 70, "b": "x" * 50})  # half packed when refused: the packer must start clean
    for params in ({"t": 1.5}, {}, {"b": b"\x00", "a": "\u00e9", "n": None, "i": -1, "f": True}):
        assert canonical_params(params) == msgpack.packb(sorted(params.items()), use_bin_type=True)


def test_outbox_emptiness_is_known_without_a_query_only_until_the_next_spool(tmp_path: Path) -> None:
    import logging

    from ccsq.producer.outbox import Outbox
    from ccsq.producer.replay import OutboxReplay

    async def confirm_all(items: list[protocol.SubmitItem], _deadline: float):
        return {it.key: protocol.SubmitResult(it.key, f"id-{it.key}") for it in items}, [], None

    async def main() -> None:
        outbox = Outbox(tmp_path / "outbox")
        replay = OutboxReplay(outbox, send_frame=confirm_all, first_frame=lambda items: items, submit_timeout_s=1.0,
                              retry_base_s=0.01, backoff_cap_s=0.1, log=logging.getLogger("test"))
        ready = asyncio.Event()  # no session yet: the flusher waits
        flusher = asyncio.create_task(replay.run(ready))
        try:
            assert await replay.is_empty() and not replay._known_empty  # asked the database
            item = protocol.SubmitItem("k1", "echo", protocol.Blob("e" * 64, 1, b"x"))
            await replay.spool([item], reason="test")
            assert not await replay.is_empty()
            ready.set()
            for _ in range(500):
                if replay._known_empty:
                    break
                await asyncio.sleep(0.01)
            assert replay._known_empty and await replay.is_empty() and await outbox.count() == 0
            spooling = asyncio.create_task(replay.spool([item], reason="test"))
            await asyncio.sleep(0)  # spool() has begun: the verdict is dropped before its write lands
            assert not replay._known_empty
            await spooling
        finally:
            flusher.cancel()
            replay.close()

    asyncio.run(main())


def test_unchecked_constructors_make_the_objects_the_classes_make() -> None:
    from ccsq.producer.client import Receipt, _receipt

    data = b"payload"
    blob = protocol.Blob(hashlib.sha256(data).hexdigest(), len(data), data)
    fast_blob = unchecked_constructor(protocol.Blob, ("sha256", "size", "inline"))(blob.sha256, blob.size, data)
    assert fast_blob == blob and hash(fast_blob) == hash(blob) and type(fast_blob) is protocol.Blob
    names = tuple(f.name for f in dataclasses.fields(protocol.SubmitItem))
    item = protocol.SubmitItem("k", "echo", blob, {"a": 1}, 3, 1e9, 2, 1.5, b"o", b"s")
    fast = unchecked_constructor(protocol.SubmitItem, names)(*(getattr(item, n) for n in names))
    assert fast == item and repr(fast) == repr(item) and protocol.encode_body(fast) == protocol.encode_body(item)
    assert _receipt("id", "k", True, False, True) == Receipt("id", "k", True, False, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.key = "other"  # still frozen
    # a record whose fields are not the ones named (a changed wire record): the class itself, checks and all
    assert unchecked_constructor(protocol.Blob, ("sha256", "size")) is protocol.Blob
    assert unchecked_constructor(tuple, ("a",)) is tuple  # not a dataclass at all
    with pytest.raises(protocol.DecodeError):
        unchecked_constructor(protocol.Blob, ("sha256", "size"))("not hex", 1, b"x")


class _Spec(NamedTuple):
    payload: object
    kind: str
    params: dict


def test_build_many_tuple_path_builds_what_build_builds_at_the_inline_limit(tmp_path: Path) -> None:
    b = _builder(tmp_path)  # inline_max_bytes = 64
    (tmp_path / "doc").write_bytes(b"F" * 65)
    specs = [(b"a" * 63, "echo"), (b"b" * 64, "k\u00e9nd-\u6f22", {"z": 1, "a": "\u00e9", "m": None, "f": 2.5, "b": b"\0"}),
             (b"c" * 65, "echo", {"t": 1.5}), (bytearray(b"d" * 64), "echo"), (memoryview(b"e" * 10), "echo"),
             (tmp_path / "doc", "echo"), (str(tmp_path / "doc"), "ocr"), _Spec(b"g", "echo", {"n": True}),
             (b"a" * 63, "echo"), (b"", "echo", {})]

    async def main() -> None:
        many = await b.build_many(specs)
        one = [await b.build(s[0], s[1], params=s[2] if len(s) == 3 else None) for s in specs]
        assert many == one and len(many) == len(specs)
        for spec, item in zip(specs, many):
            data = bytes(spec[0]) if not isinstance(spec[0], (str, Path)) else Path(spec[0]).read_bytes()
            assert item.payload.sha256 == hashlib.sha256(data).hexdigest() and item.payload.size == len(data)
            assert item.payload.inline == (data if len(data) <= 64 else None)
            assert item.key == derive_key(item.payload.sha256, spec[1], spec[2] if len(spec) == 3 else {})
            assert protocol.submit_item_problem(item) == ""
            # what the records' own __init__ (and any check it runs) makes of the same values
            assert protocol.Blob(item.payload.sha256, item.payload.size, item.payload.inline) == item.payload
            assert protocol.SubmitItem(*(getattr(item, f.name) for f in dataclasses.fields(protocol.SubmitItem))) == item
        assert b.store.exists(many[2].payload.sha256) and b.store.exists(many[5].payload.sha256)
        params = {"t": 1}
        item = (await b.build_many([(b"x", "echo", params)]))[0]
        params["t"] = 2  # the item holds its own copy of the caller's params
        assert item.params == {"t": 1}

    try:
        asyncio.run(main())
    finally:
        b.close()


def test_receipts_of_a_batch_without_repeated_keys_are_the_general_ones() -> None:
    from ccsq.common.wire.errors import QueueFull
    from ccsq.producer.client import _receipts

    blob = protocol.Blob("f" * 64, 1, b"x")
    items = [protocol.SubmitItem(f"k{i}", "ocr" if i % 2 else "echo", blob) for i in range(6)]
    results = {it.key: protocol.SubmitResult(it.key, f"id{i}", duplicate=i == 3) for i, it in enumerate(items)}
    fast = _receipts(items, results, set(), {"ocr"}, repeats=False)
    assert fast == _receipts(items, results, set(), {"ocr"})
    assert [(r.item_id, r.duplicate, r.unserved, r.spooled) for r in fast][2:4] == [("id2", False, False, False),
                                                                                    ("id3", True, True, False)]
    spooled = _receipts(items, results, {"k1"}, set(), repeats=False)  # a spooled key: the general path
    assert spooled[1].spooled and spooled[1].item_id == "" and not spooled[0].spooled
    results["k4"] = protocol.SubmitResult("k4", "", error="QUEUE_FULL", message="full")
    with pytest.raises(QueueFull):
        _receipts(items, results, set(), set(), repeats=False)
