"""The generated body codec of ``common/wire/protocol.py`` against references (issue 15).

``encode_body`` must give the bytes a plain field-by-field encoding gives (a small one is
written here, independent of protocol.py); ``decode_body`` must accept and refuse exactly
what the reference decoder (the per-field closures, ``_slow_decode_body``) accepts and
refuses, with the same code and message, and hand back equal dataclasses. The generated
fast decoders are also checked on their own: they may give up (the reference then
decides) but must never accept what the reference refuses, and must not give up on
well-formed messages (else the speed is gone). Seeded: a failure names its seed.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import types
import typing

import msgpack
import pytest

from ccsq.common.wire import protocol
from ccsq.common.wire.errors import DecodeError

SEEDS = range(6)
PER_SEED = 120  # valid messages per seed (each also mutated MUTATIONS times)
MUTATIONS = 6
OMIT = "ccsq_omit_empty"


# --- an independent reference encoder ------------------------------------------------
def ref_encode(obj):
    """Field by field, in field order; extension fields left out when empty."""
    out = {}
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.metadata.get(OMIT) and not v:
            continue
        out[f.name] = _ref_value(hints[f.name], v)
    return out


def _ref_value(tp, v):
    if dataclasses.is_dataclass(v):
        return ref_encode(v)
    if typing.get_origin(tp) is list:
        return [_ref_value(typing.get_args(tp)[0], x) for x in v]
    if typing.get_origin(tp) is dict:
        return dict(v)
    return v


def pack(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


# --- seeded generator of valid messages ------------------------------------------------
def _text(rng: random.Random) -> str:
    alphabet = "abcXYZ019-_ .:/é世🙂"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))


def _scalar(rng: random.Random):
    return rng.choice([None, True, False, rng.randint(-(2**63), 2**64 - 1), rng.uniform(-1e9, 1e9), _text(rng),
                       rng.randbytes(rng.randint(0, 5))])


def _blob(rng: random.Random) -> protocol.Blob:
    data = rng.randbytes(rng.randint(0, 40))
    sha = "".join(rng.choice("0123456789abcdef") for _ in range(64))
    return protocol.Blob(sha, len(data), data if rng.random() < 0.7 else None)


def gen_value(rng: random.Random, tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if rng.random() < 0.4 else gen_value(rng, inner[0])
    if origin is list:
        (elem,) = typing.get_args(tp)
        return [gen_value(rng, elem) for _ in range(rng.randint(0, 3))]
    if origin is dict:
        return {_text(rng): _scalar(rng) for _ in range(rng.randint(0, 3))}
    if tp is protocol.Blob:
        return _blob(rng)
    if dataclasses.is_dataclass(tp):
        return gen_record(rng, tp)
    if tp is str:
        return _text(rng)
    if tp is int:
        return rng.choice([0, 1, rng.randint(-(2**31), 2**31), rng.randint(0, 2**64 - 1), -(2**63)])
    if tp is float:
        return rng.choice([0.0, rng.uniform(-1e12, 1e12), 1.7e9 + rng.random()])
    if tp is bool:
        return rng.random() < 0.5
    if tp is bytes:
        return rng.randbytes(rng.choice([0, 0, 3, 64]))
    raise AssertionError(f"no generator for {tp!r}")


def gen_record(rng: random.Random, cls):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if has_default and rng.random() < 0.3:
            continue  # leave the default
        kwargs[f.name] = gen_value(rng, hints[f.name])
    return cls(**kwargs)


# --- mutations of a body --------------------------------------------------------------
class StrSub(str):
    pass


class IntSub(int):
    pass


def _junk(rng: random.Random, depth: int = 0):
    pool = [None, True, False, 0, -1, 2**64 - 1, 1.5, float("nan"), "s", "", b"b", [], {}, [1, "a"], {"a": 1},
            {"a": [1]}, {1: "x"}, StrSub("x"), IntSub(3), ("t",), "0" * 64, "A" * 64]
    if depth < 12 and rng.random() < 0.15:
        return [_junk(rng, depth + 1)] if rng.random() < 0.5 else {"d": _junk(rng, depth + 1)}
    return rng.choice(pool)


def _maps(node, out):
    if type(node) is dict:
        out.append(node)
        for v in node.values():
            _maps(v, out)
    elif type(node) is list:
        for v in node:
            _maps(v, out)
    return out


def mutate(rng: random.Random, body):
    body = copy.deepcopy(body)
    maps = _maps(body, [])
    target = rng.choice(maps)
    op = rng.randrange(10)
    keys = list(target)
    if op == 8 and keys:  # the same keys in another order (accepted: fields go by name)
        items = list(target.items())
        rng.shuffle(items)
        target.clear()
        target.update(items[::-1] if len(items) > 1 and [k for k, _ in items] == keys else items)
    elif op == 9 and keys:  # one key renamed: the same count, an unknown field and (maybe) a missing one
        k = rng.choice(keys)
        target[k + "_"] = target.pop(k)
    elif op == 0 or not keys:
        target[rng.choice(["extra", "TYPE", "Key", StrSub("key")])] = _junk(rng)
    elif op == 1:
        del target[rng.choice(keys)]
    elif op in (2, 3, 4):
        target[rng.choice(keys)] = _junk(rng)
    elif op == 5:  # a value of the right shape but a subclass / int for float / float for int
        k = rng.choice(keys)
        v = target[k]
        target[k] = {str: StrSub, int: IntSub, float: int, bool: int}.get(type(v), lambda x: x)(v) \
            if type(v) in (str, int, float, bool) and not (type(v) is float and v != v) else _junk(rng)
    elif op == 6:  # break a blob's checks
        blobs = [m for m in maps if "sha256" in m and "size" in m]
        if blobs:
            b = rng.choice(blobs)
            b[rng.choice(["sha256", "size", "inline"])] = rng.choice(["F" * 64, "a" * 63, -1, b"xx", 10**3])
        else:
            target[rng.choice(keys)] = _junk(rng)
    else:  # free-form maps: too long, non-string keys, non-scalar values
        k = rng.choice(keys)
        target[k] = rng.choice([{f"k{i}": i for i in range(protocol.MAX_MAP_LEN + 1)}, {f"k{i}": i for i in range(protocol.MAX_MAP_LEN)},
                                {1: 1}, {"a": [1]}, {"a": {"b": 1}}, {"a": b"x", "b": None}])
    return body


# --- outcomes ---------------------------------------------------------------------------
def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except DecodeError as exc:
        return ("refused", exc.code, str(exc))
    except Exception as exc:  # noqa: BLE001 - compared as is
        return ("raised", type(exc).__name__, str(exc))


def check_body(msg_type: int, body) -> tuple:
    ref = outcome(protocol._slow_decode_body, msg_type, body)
    new = outcome(protocol.decode_body, msg_type, body)
    assert new == ref, f"decode_body differs from the reference on {body!r}"
    if ref[0] == "ok":  # same values and same types all the way down
        assert pack(ref_encode(new[1])) == pack(ref_encode(ref[1]))
    fast = outcome(protocol._FAST_DECODERS[msg_type], body)
    if ref[0] != "ok":
        assert fast[0] != "ok", f"the fast decoder accepted what the reference refuses: {body!r} ({ref})"
    elif fast[0] == "ok":
        assert fast[1] == ref[1] and type(fast[1]) is type(ref[1])
    return ref


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_codec_matches_references(seed: int) -> None:
    rng = random.Random(seed)
    refused = accepted_mutants = 0
    classes = list(protocol.MESSAGE_CLASSES.values())
    for i in range(PER_SEED):
        cls = classes[i % len(classes)]
        msg = gen_record(rng, cls)
        body = protocol.encode_body(msg)
        assert pack(body) == pack(ref_encode(msg)), f"seed {seed}: {cls.__name__} bytes differ"
        assert pack(body) == pack(protocol._record_encoder(cls)(msg))
        wire = msgpack.unpackb(pack(body), raw=False)
        # a well-formed message takes the fast path (no fallback) and round-trips
        fast = protocol._FAST_DECODERS[int(cls.TYPE)](wire)
        assert fast == msg and type(fast) is cls, f"seed {seed}: {cls.__name__} did not round-trip"
        assert protocol.decode_body(int(cls.TYPE), wire) == msg
        check_body(int(cls.TYPE), wire)
        for _ in range(MUTATIONS):
            ref = check_body(int(cls.TYPE), mutate(rng, wire))
            if ref[0] == "ok":
                accepted_mutants += 1
            else:
                refused += 1
                assert ref[1] == protocol.REJECT_MALFORMED, ref
    assert refused > PER_SEED * MUTATIONS // 2 and accepted_mutants > 0  # the mutations bite, and not always


def test_refusal_messages_name_the_path() -> None:
    item = protocol.SubmitItem("k", "echo", protocol.Blob("a" * 64, 2, b"ok"), {"t": 1.0})
    body = protocol.encode_body(protocol.Submit(1, [item, item]))
    cases = [
        ({**body, "items": [body["items"][0], {**body["items"][1], "priority": "9"}]},
         "Submit.items.priority: expected integer, got str"),
        ({**body, "items": [{**body["items"][0], "payload": {"sha256": "A" * 64, "size": 2}}]},
         "blob sha256 must be 64 lowercase hex chars"),
        ({**body, "items": [{**body["items"][0], "params": {"a": [1]}}]}, "Submit.items.params.a: map values must be scalars"),
        ({**body, "items": [{**body["items"][0], "zz": 1}]}, "Submit.items: unknown field(s) ['zz'] for SubmitItem"),
        ({"req": 1}, "Submit: missing field 'items' for Submit"),
        ({**body, "items": [{**body["items"][0], "deadline_ts": "x"}]}, "Submit.items.deadline_ts: no variant matched"),
    ]
    for bad, words in cases:
        with pytest.raises(DecodeError) as exc:
            protocol.decode_body(protocol.MsgType.SUBMIT, bad)
        assert exc.value.code == protocol.REJECT_MALFORMED and words in str(exc.value), str(exc.value)
    with pytest.raises(DecodeError) as exc:
        protocol.decode_body(999, body)
    assert exc.value.code == protocol.REJECT_UNKNOWN_TYPE
    with pytest.raises(DecodeError) as exc:
        protocol.decode_body([10], body)  # unhashable: the reference words it
    assert exc.value.code == protocol.REJECT_UNKNOWN_TYPE


def test_decoded_records_are_fresh_and_checked() -> None:
    """Lists and maps in a decoded message are copies (as the reference made them); a Blob
    built by the fast path ran its __post_init__ (a refusal there surfaces as MALFORMED)."""
    body = protocol.encode_body(protocol.Submit(1, [protocol.SubmitItem("k", "echo", protocol.Blob("a" * 64, 2, b"ok"), {"t": 1})]))
    msg = protocol.decode_body(protocol.MsgType.SUBMIT, body)
    assert msg.items is not body["items"] and msg.items[0].params is not body["items"][0]["params"]
    assert type(msg.items[0].max_runtime_s) is float
    body["items"][0]["payload"]["size"] = 3
    with pytest.raises(DecodeError, match="inline blob length differs from size"):
        protocol.decode_body(protocol.MsgType.SUBMIT, body)


@pytest.mark.parametrize("seed", range(3))
def test_submit_item_problem_matches_the_full_rule(seed: int) -> None:
    rng = random.Random(seed)
    blob = protocol.Blob("a" * 64, 2, b"ok")
    texts = ["", "a", "echo", "k" * 128, "k" * 129, "k" * 400, "k" * 401, "é" * 200, "é" * 201, "a\x00b", "tab\t",
             "del\x7f", "\x85next", "\u2028", "ok key", "🙂" * 100, "🙂" * 101, "\ud800"]
    numbers = [0, 1, -1, 1000, 1001, protocol.PRIO_MAX, protocol.PRIO_MAX + 1, protocol.PRIO_MIN, protocol.PRIO_MIN - 1, True, 2**2000,
               0.0, 1.5, -0.0, -0.5, 0.5, -1.5, float("inf"), float("-inf"), float("nan"), 1e308, IntSub(5)]
    params = [{}, {"t": 0.0}, {"a\x00": 1}, {"a": "x\x00"}, {"a": float("nan")}, {"a": float("inf")}, {"a": 2**70},
              {"a": None, "b": b"\x00", "c": True}, {"a": StrSub("x")}, {"a": [1]}, {1: 2}]
    choices = {"key": texts, "kind": texts, "params": params, "priority": numbers, "deadline_ts": [None, *numbers],
               "max_attempts": numbers, "max_runtime_s": numbers}
    fine = protocol.SubmitItem(key="k", kind="echo", payload=blob, params={"t": 0.0}, deadline_ts=1.7e9, max_runtime_s=1.0)
    assert protocol.submit_item_problem(fine) == ""
    for _ in range(3000):  # a fine item with one to three fields changed
        changed = rng.sample(sorted(choices), rng.choice([1, 1, 2, 3]))
        item = dataclasses.replace(fine, **{name: rng.choice(choices[name]) for name in changed})
        full = outcome(lambda: protocol.submit_fields_problem(
            kind=item.kind, key=item.key, priority=item.priority, max_attempts=item.max_attempts,
            max_runtime_s=item.max_runtime_s, deadline_ts=item.deadline_ts, params=item.params))
        assert outcome(protocol.submit_item_problem, item) == full, item


def test_blob_rule_inlined_exactly() -> None:
    """The generated decoders inline Blob.__post_init__'s rule: same verdict on every corner."""
    item = protocol.encode_body(protocol.SubmitItem("k", "echo", protocol.Blob("a" * 64, 2, b"ok")))
    shas = ["a" * 64, "0123456789abcdef" * 4, "A" * 64, "a" * 63, "a" * 65, "g" * 64, "a" * 63 + "\n", " " + "a" * 63,
            "é" * 64, "a" * 63 + "٣", ""]
    sizes = [0, 2, 3, -1, 2**64 - 1, True, 2.0]
    inlines = [None, b"", b"ok", b"okk", "ok", bytearray(b"ok")]
    for sha in shas:
        for size in sizes:
            for inline in inlines:
                blob = {"sha256": sha, "size": size, "inline": inline}
                for payload in (blob, {k: v for k, v in blob.items() if k != "inline"}):
                    ref = check_body(protocol.MsgType.SUBMIT, {"req": 1, "items": [{**item, "payload": payload}]})
                    if ref[0] == "ok":
                        blob_out = ref[1].items[0].payload
                        assert type(blob_out) is protocol.Blob and blob_out.sha256 == sha


def test_fast_decoded_objects_are_the_real_frozen_classes() -> None:
    msg = protocol.Dispatch([protocol.Task("i", 1, "echo", protocol.Blob("a" * 64, 0, b""), {}, 1)])
    got = protocol._FAST_DECODERS[int(protocol.MsgType.DISPATCH)](msgpack.unpackb(pack(protocol.encode_body(msg)), raw=False))
    assert type(got) is protocol.Dispatch and isinstance(got, protocol.Message) and got == msg and hash(got.tasks[0].payload)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.tasks[0].token = 2  # type: ignore[misc]
    assert copy.deepcopy(got) == msg and dataclasses.replace(got.tasks[0], token=5).token == 5
