"""The wire protocol's body codec: a message <-> the plain msgpack-able map of its fields.
No I/O. The message types: :mod:`ccsq.common.wire.messages`; framing and signatures:
:mod:`ccsq.common.wire.envelope`.

:func:`decode_body` checks the key set and every value's type strictly, so nothing
malformed is half-applied: either the whole message decodes or
:class:`~ccsq.common.wire.errors.DecodeError` is raised with one of the ``REJECT_*`` codes.
Two implementations with one behaviour: the reference (per-field closures, the only place
that words a refusal) and the fast codec generated from it per message type at import,
which falls back to the reference on anything unusual (tests/test_codec_equivalence.py
checks that they agree).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Union

from ccsq.common.wire.errors import DecodeError
from ccsq.common.wire.limits import _HEX_RE, MAX_DEPTH, MAX_MAP_LEN
from ccsq.common.wire.messages import (
    _OMIT_EMPTY,
    MESSAGE_CLASSES,
    REJECT_MALFORMED,
    REJECT_UNKNOWN_TYPE,
    SCALAR_TYPES,
    Blob,
    Message,
    MsgType,
)

# --- the reference codec -------------------------------------------------------
# Converters are compiled once per dataclass (a closure per field) so the hot
# path does no typing introspection per value.
_ENCODERS: dict[type, Any] = {}
_DECODERS: dict[type, Any] = {}


def _bad(path: str, why: str) -> DecodeError:
    return DecodeError(f"{path}: {why}", code=REJECT_MALFORMED)


def _compile_encoder(tp: Any):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            enc = _record_encoder(inner[0])
            return lambda v: None if v is None else enc(v)
        return None
    if origin is list:
        (elem,) = typing.get_args(tp)
        if dataclasses.is_dataclass(elem):
            enc = _record_encoder(elem)
            return lambda v: [enc(x) for x in v]
        return list
    if origin is dict:
        return dict
    if dataclasses.is_dataclass(tp):
        return _record_encoder(tp)
    return None  # scalar: as is


def _record_encoder(cls: Any):  # a dataclass (Any: what is_dataclass narrows to is no `type`)
    enc = _ENCODERS.get(cls)
    if enc is not None:
        return enc
    hints = typing.get_type_hints(cls)
    plan: list = []

    def encode(obj: Any) -> dict:
        out = {}
        for name, conv, omit_empty in plan:
            v = getattr(obj, name)
            if omit_empty and not v:
                continue
            out[name] = v if conv is None else conv(v)
        return out

    _ENCODERS[cls] = encode
    plan.extend((f.name, _compile_encoder(hints[f.name]), bool(f.metadata.get(_OMIT_EMPTY)))
                for f in dataclasses.fields(cls))
    return encode


def _compile_decoder(tp: Any):
    """Return ``conv(value, path, depth)`` that validates and converts one value of type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        nullable = type(None) in args
        variants = [_compile_decoder(a) for a in args if a is not type(None)]

        def conv_union(v, path, depth):
            if v is None and nullable:
                return None
            errors = []
            for var in variants:
                try:
                    return var(v, path, depth)
                except DecodeError as exc:
                    errors.append(str(exc))
            raise _bad(path, f"no variant matched ({'; '.join(errors)})")

        return conv_union
    if origin is list:
        (elem,) = typing.get_args(tp)
        econv = _compile_decoder(elem)

        def conv_list(v, path, depth):
            if type(v) is not list:
                raise _bad(path, f"expected array, got {type(v).__name__}")
            if depth >= MAX_DEPTH:
                raise _bad(path, "nested too deeply")
            return [econv(x, path, depth + 1) for x in v]  # element errors name the list

        return conv_list
    if origin is dict:

        def conv_map(v, path, depth):
            if type(v) is not dict:
                raise _bad(path, f"expected map, got {type(v).__name__}")
            if len(v) > MAX_MAP_LEN:
                raise _bad(path, "map too long")
            for k, x in v.items():
                if type(k) is not str:
                    raise _bad(path, "map keys must be strings")
                if not isinstance(x, SCALAR_TYPES):
                    raise _bad(f"{path}.{k}", "map values must be scalars")
            return dict(v)

        return conv_map
    if dataclasses.is_dataclass(tp):
        rec = _record_decoder(tp)

        def conv_rec(v, path, depth):
            if depth >= MAX_DEPTH:
                raise _bad(path, "nested too deeply")
            return rec(v, path, depth + 1)

        return conv_rec
    if tp is float:

        def conv_float(v, path, depth):
            t = type(v)
            if t is float:
                return v
            if t is int:
                return float(v)
            raise _bad(path, f"expected number, got {t.__name__}")

        return conv_float
    if tp in (int, bool, str, bytes):
        name = "integer" if tp is int else tp.__name__

        def conv_exact(v, path, depth, tp=tp, name=name):
            if type(v) is not tp:
                raise _bad(path, f"expected {name}, got {type(v).__name__}")
            return v

        return conv_exact
    if tp is Any:
        return lambda v, path, depth: v
    raise TypeError(f"unsupported field type {tp!r}")  # programming error, at import time


def _record_decoder(cls: Any):
    dec = _DECODERS.get(cls)
    if dec is not None:
        return dec
    fields: list = []
    required: set[str] = set()
    known: set[str] = set()

    def decode(value: Any, path: str, depth: int) -> Any:
        if type(value) is not dict:
            raise _bad(path, f"expected map for {cls.__name__}, got {type(value).__name__}")
        if not known.issuperset(value.keys()):
            unknown = sorted(str(k) for k in value if k not in known)
            raise _bad(path, f"unknown field(s) {unknown} for {cls.__name__}")
        if not required.issubset(value.keys()):
            missing = sorted(required - set(value))
            raise _bad(path, f"missing field {missing[0]!r} for {cls.__name__}")
        kwargs = {}
        for name, conv in fields:
            if name in value:
                try:
                    kwargs[name] = conv(value[name], name, depth)
                except DecodeError as exc:
                    # paths are built only on the error path (hot path stays cheap)
                    raise DecodeError(f"{path}.{exc}", code=exc.code) from None
        try:
            return cls(**kwargs)
        except DecodeError:
            raise
        except (TypeError, ValueError) as exc:
            raise _bad(path, str(exc)) from None

    _DECODERS[cls] = decode
    hints = {k: v for k, v in typing.get_type_hints(cls).items() if k != "TYPE"}
    for f in dataclasses.fields(cls):
        fields.append((f.name, _compile_decoder(hints[f.name])))
        known.add(f.name)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.add(f.name)
    return decode


def _slow_decode_body(msg_type: int, body: Any) -> Message:
    """The reference decoder: the compiled closures above, one call per value."""
    try:
        cls = MESSAGE_CLASSES[MsgType(msg_type)]
    except ValueError:
        raise DecodeError(f"unknown message type {msg_type!r}", code=REJECT_UNKNOWN_TYPE) from None
    return _record_decoder(cls)(body, cls.__name__, 0)


# --- generated fast codec ----------------------------------------------------------
# The closures above are the reference: clear, one call per value, and the only place
# that words a refusal. On the hot path every process runs instead one function per
# message type, generated here once at import as Python source: type checks inlined
# per field (exact ``type(v) is T``), nested records and lists of records inlined into
# loops, a record map with exactly its usual keys (all but the empty extensions) read by
# key without a lookup per absent field, each record's slots filled directly
# (``__post_init__`` still runs, or its rule is inlined: ``_INLINE_CHECKS``).
# A generated decoder only ever accepts a subset of what the reference accepts (it
# bails out on anything unusual: a missing or unknown field, a subclass, a wrong type,
# a refusal from ``__post_init__``); when it bails out, the reference decoder runs on
# the same body and either refuses with its exact message or returns its result. So
# what is accepted and refused, and every error message, is the reference's.


class _Bail(Exception):
    """The generated fast path gives up; the reference decoder decides."""


_MISS = object()
_SCALAR_SET = frozenset(SCALAR_TYPES)
_EXACT_NAMES = {str: "str", int: "int", bool: "bool", bytes: "bytes"}


class _Gen:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ns: dict[str, Any] = {"_Bail": _Bail, "_MISS": _MISS, "_SCALARS": _SCALAR_SET, "_new": object.__new__,
                                   "_hexfull": _HEX_RE.fullmatch}
        self._n = 0

    def var(self, base: str) -> str:
        self._n += 1
        return f"{base}{self._n}"

    def const(self, obj: Any, base: str) -> str:
        name = self.var(f"_k_{base}_")
        self.ns[name] = obj
        return name

    def emit(self, ind: int, line: str) -> None:
        self.lines.append("    " * ind + line)

    def build(self, name: str) -> Callable:
        exec(compile("\n".join(self.lines) + "\n", f"<ccsq codec {name}>", "exec"), self.ns)  # noqa: S102
        return self.ns[name]


def _plain_fields(cls: type) -> tuple:
    fields = dataclasses.fields(cls)
    if any(not f.init for f in fields):  # the reference refuses such a field when sent: leave it to it
        raise TypeError(f"{cls.__name__}: no generated decoder for a field outside __init__")
    return fields


def _gen_dec_value(g: _Gen, tp: Any, x: str, depth: int, ind: int) -> None:
    """Emit statements that check local ``x`` like ``_compile_decoder(tp)(x, _, depth)``
    and leave the converted value in ``x`` (or raise _Bail)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        inner = [a for a in args if a is not type(None)]
        if type(None) not in args or len(inner) != 1:
            g.emit(ind, "raise _Bail")  # not in the schema today: the reference decides
            return
        g.emit(ind, f"if {x} is not None:")
        _gen_dec_value(g, inner[0], x, depth, ind + 1)
        return
    if origin is list:
        (elem,) = typing.get_args(tp)
        g.emit(ind, f"if type({x}) is not list: raise _Bail")
        if depth >= MAX_DEPTH:
            g.emit(ind, "raise _Bail")
            return
        e = g.var("e")
        if elem in _EXACT_NAMES:
            g.emit(ind, f"for {e} in {x}:")
            g.emit(ind + 1, f"if type({e}) is not {_EXACT_NAMES[elem]}: raise _Bail")
            g.emit(ind, f"{x} = list({x})")
            return
        lst = g.var("l")
        g.emit(ind, f"{lst} = []")
        g.emit(ind, f"for {e} in {x}:")
        _gen_dec_value(g, elem, e, depth + 1, ind + 1)
        g.emit(ind + 1, f"{lst}.append({e})")
        g.emit(ind, f"{x} = {lst}")
        return
    if origin is dict:
        k, e = g.var("k"), g.var("e")
        g.emit(ind, f"if type({x}) is not dict or len({x}) > {MAX_MAP_LEN}: raise _Bail")
        g.emit(ind, f"for {k}, {e} in {x}.items():")
        g.emit(ind + 1, f"if type({k}) is not str or type({e}) not in _SCALARS: raise _Bail")
        g.emit(ind, f"{x} = dict({x})")
        return
    if dataclasses.is_dataclass(tp):
        if depth >= MAX_DEPTH:
            g.emit(ind, "raise _Bail")
            return
        _gen_dec_record(g, tp, x, depth + 1, ind)
        return
    if tp is float:
        g.emit(ind, f"if type({x}) is not float:")
        g.emit(ind + 1, f"if type({x}) is not int: raise _Bail")
        g.emit(ind + 1, f"{x} = float({x})")
        return
    if tp in _EXACT_NAMES:
        g.emit(ind, f"if type({x}) is not {_EXACT_NAMES[tp]}: raise _Bail")
        return
    if tp is Any:
        return
    raise TypeError(f"unsupported field type {tp!r}")


#: Default factories whose value is immutable: a decoder uses one value made at import (the same
#: object: ``bytes()`` and ``str()`` are singletons) instead of a call per record.
_IMMUTABLE_FACTORIES = (bytes, str, tuple, frozenset)


def _gen_dec_record(g: _Gen, cls: Any, m: str, depth: int, ind: int) -> None:
    """Emit statements that decode the map in local ``m`` as ``_record_decoder(cls)(m, _, depth)``
    would and leave the instance in ``m``."""
    hints = typing.get_type_hints(cls)
    fields = _plain_fields(cls)
    n_req = sum(1 for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    g.emit(ind, f"if type({m}) is not dict: raise _Bail")
    args = [g.var("v") for _ in fields]
    required = [f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields]
    defaults = {f.name: (g.const(f.default, f.name) if f.default is not dataclasses.MISSING
                         else g.const(f.default_factory(), f.name) if f.default_factory in _IMMUTABLE_FACTORIES
                         else g.const(f.default_factory, f.name) + "()") for f, req in zip(fields, required) if not req}
    if n_req == len(fields):
        g.emit(ind, f"if len({m}) != {n_req}: raise _Bail")
        for f, v in zip(fields, args):
            g.emit(ind, f"{v} = {m}[{f.name!r}]")  # KeyError: the reference names the missing field
            _gen_dec_value(g, hints[f.name], v, depth, ind)
    else:
        # The usual map (every field but the empty extensions the encoder leaves out): each
        # field read by its key, the extensions at their defaults. Exactly that many keys, all
        # found, are exactly those keys; a missing one raises KeyError: the reference decides.
        usual = [not f.metadata.get(_OMIT_EMPTY) for f in fields]
        g.emit(ind, f"if len({m}) == {sum(usual)}:")
        for f, v, is_usual in zip(fields, args, usual):
            if is_usual:
                g.emit(ind + 1, f"{v} = {m}[{f.name!r}]")
                _gen_dec_value(g, hints[f.name], v, depth, ind + 1)
            else:
                g.emit(ind + 1, f"{v} = {defaults[f.name]}")
        g.emit(ind, "else:")
        ind += 1
        cnt = g.var("n")
        g.emit(ind, f"{cnt} = {n_req}")
        for f, v, req in zip(fields, args, required):
            if req:
                g.emit(ind, f"{v} = {m}[{f.name!r}]")  # KeyError: the reference names the missing field
                _gen_dec_value(g, hints[f.name], v, depth, ind)
                continue
            g.emit(ind, f"{v} = {m}.get({f.name!r}, _MISS)")
            g.emit(ind, f"if {v} is _MISS:")
            g.emit(ind + 1, f"{v} = {defaults[f.name]}")
            g.emit(ind, "else:")
            g.emit(ind + 1, f"{cnt} += 1")
            _gen_dec_value(g, hints[f.name], v, depth, ind + 1)
        g.emit(ind, f"if len({m}) != {cnt}: raise _Bail")  # every key was a known field
        ind -= 1
    post = getattr(cls, "__post_init__", None)
    check = _INLINE_CHECKS.get(cls)
    if check is not None:  # __post_init__'s rule as one expression over the (exactly typed) values
        g.emit(ind, f"if not ({check.format(**dict(zip((f.name for f in fields), args)))}): raise _Bail")
        post = None
    twin = _twin(cls)
    if twin is None:  # not a plain slots class: its constructor
        g.emit(ind, f"{m} = {g.const(cls, cls.__name__)}({', '.join(args)})")
        return
    # A frozen dataclass's __init__ stores each field through object.__setattr__ (a
    # call per field): instead fill the slots of an unfrozen twin with plain stores, make
    # it the real class (same slot layout), and run __post_init__ as __init__ would.
    g.emit(ind, f"{m} = _new({g.const(twin, 'twin_' + cls.__name__)})")
    for f, v in zip(fields, args):
        g.emit(ind, f"{m}.{f.name} = {v}")
    g.emit(ind, f"{m}.__class__ = {g.const(cls, cls.__name__)}")
    if post is not None:
        g.emit(ind, f"{g.const(post, 'post')}({m})")


#: ``__post_init__`` rules the generated decoders inline, as one expression over the field
#: values (there already of the exact field types: str, int, bytes | None). Keep each in
#: step with its ``__post_init__`` (tests/test_codec_equivalence.py compares the two).
_INLINE_CHECKS: dict[type, str] = {
    Blob: "len({sha256}) == 64 and _hexfull({sha256}) is not None and {size} >= 0"
          " and ({inline} is None or len({inline}) == {size})",
}


_TWINS: dict[type, type | None] = {}


def _twin(cls: type) -> type | None:
    """An unfrozen class with ``cls``'s exact slots whose instances may become ``cls``
    instances by ``__class__`` assignment; None when ``cls`` is not such a slots class."""
    if cls not in _TWINS:
        _TWINS[cls] = _make_twin(cls)
    return _TWINS[cls]


def _make_twin(cls: type) -> type | None:
    names = tuple(f.name for f in dataclasses.fields(cls))
    if getattr(cls, "__slots__", None) != names or any("__slots__" not in vars(b) for b in cls.__mro__[:-1]):
        return None
    if any(vars(b)["__slots__"] for b in cls.__mro__[1:-1]):
        return None
    twin = type(f"_{cls.__name__}Slots", cls.__bases__, {"__slots__": names})
    try:  # prove it once: the same object the constructor would build
        probe: Any = object.__new__(twin)
        for n in names:
            setattr(probe, n, None)
        probe.__class__ = cls
        if any(getattr(probe, n) is not None for n in names):
            return None
    except Exception:  # noqa: BLE001 - a layout CPython will not swap: use the constructor
        return None
    return twin


def trusted_constructor(cls: type, names: tuple[str, ...]) -> Any:
    """A positional constructor of the frozen, slotted dataclass ``cls`` whose fields are
    ``names`` (all of them, in order) that fills the slots of its unfrozen twin and makes the
    object a ``cls`` (as the generated decoders do): no ``__init__`` (one
    ``object.__setattr__`` call per field in a frozen class) and no ``__post_init__`` check.
    Only for values that pass ``cls``'s checks by construction (a digest from
    ``hexdigest()``, a size from ``len``...); the object is the one ``cls(...)`` makes
    (equal, hashed, encoded the same, still frozen). When ``cls`` is not such a dataclass or
    its fields are not exactly ``names`` (a changed record): ``cls`` itself, checks and all."""
    try:
        fields = tuple(f.name for f in dataclasses.fields(cls))
    except TypeError:  # not a dataclass
        return cls
    twin = _twin(cls) if fields == names else None
    if twin is None:
        return cls
    g = _Gen()
    fn = f"_make_{cls.__name__}"
    args = [f"_a{i}" for i in range(len(names))]  # never a field's own name
    g.emit(0, f"def {fn}({', '.join(args)}):")
    g.emit(1, f"_o = _new({g.const(twin, 'twin')})")
    for n, a in zip(names, args):
        g.emit(1, f"_o.{n} = {a}")
    g.emit(1, f"_o.__class__ = {g.const(cls, 'cls')}")
    g.emit(1, "return _o")
    return g.build(fn)


def _gen_decoder(cls: type) -> Callable[[Any], Any]:
    g = _Gen()
    name = f"_decode_{cls.__name__}"
    g.emit(0, f"def {name}(m):")
    _gen_dec_record(g, cls, "m", 0, 1)
    g.emit(1, "return m")
    return g.build(name)


def _gen_enc_value(g: _Gen, tp: Any, src: str, ind: int) -> str:
    """Emit what is needed before, and return the expression ``_compile_encoder(tp)`` gives for ``src``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            t, r = g.var("t"), g.var("r")
            g.emit(ind, f"{t} = {src}")
            g.emit(ind, f"if {t} is None:")
            g.emit(ind + 1, f"{r} = None")
            g.emit(ind, "else:")
            g.emit(ind + 1, f"{r} = {_gen_enc_record(g, inner[0], t, ind + 1)}")
            return r
        return src
    if origin is list:
        (elem,) = typing.get_args(tp)
        if not dataclasses.is_dataclass(elem):
            return f"list({src})"
        lst, e = g.var("l"), g.var("e")
        g.emit(ind, f"{lst} = []")
        g.emit(ind, f"for {e} in {src}:")
        g.emit(ind + 1, f"{lst}.append({_gen_enc_record(g, elem, e, ind + 1)})")
        return lst
    if origin is dict:
        return f"dict({src})"
    if dataclasses.is_dataclass(tp):
        t = g.var("t")
        g.emit(ind, f"{t} = {src}")
        return _gen_enc_record(g, tp, t, ind)
    return src


def _gen_enc_record(g: _Gen, cls: Any, o: str, ind: int) -> str:
    """Emit statements that build ``_record_encoder(cls)(o)`` (same keys, same order); return its variable."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    d = g.var("d")
    head = []
    i = 0
    while i < len(fields) and not fields[i].metadata.get(_OMIT_EMPTY):
        head.append(f"{fields[i].name!r}: {_gen_enc_value(g, hints[fields[i].name], f'{o}.{fields[i].name}', ind)}")
        i += 1
    g.emit(ind, f"{d} = {{{', '.join(head)}}}")
    for f in fields[i:]:
        if f.metadata.get(_OMIT_EMPTY):
            t = g.var("t")
            g.emit(ind, f"{t} = {o}.{f.name}")
            g.emit(ind, f"if {t}:")
            g.emit(ind + 1, f"{d}[{f.name!r}] = {_gen_enc_value(g, hints[f.name], t, ind + 1)}")
        else:
            g.emit(ind, f"{d}[{f.name!r}] = {_gen_enc_value(g, hints[f.name], f'{o}.{f.name}', ind)}")
    return d


def _gen_encoder(cls: type) -> Callable[[Any], dict]:
    g = _Gen()
    name = f"_encode_{cls.__name__}"
    g.emit(0, f"def {name}(o):")
    g.emit(1, f"return {_gen_enc_record(g, cls, 'o', 1)}")
    return g.build(name)


_FAST_ENCODERS: dict[type, Callable[[Any], dict]] = {}
_FAST_DECODERS: dict[int, Callable[[Any], Message]] = {}


def encode_body(obj: Any) -> Any:
    """Turn a message or record into plain msgpack-able data (maps of field name -> value).

    Same maps as the reference ``_record_encoder``: keys in field order, empty
    ``extension`` fields left out, nested records as maps, lists and maps copied."""
    enc = _FAST_ENCODERS.get(type(obj))
    if enc is None:
        return _record_encoder(type(obj))(obj)
    return enc(obj)


def decode_body(msg_type: int, body: Any) -> Message:
    """Build the typed message for ``msg_type`` from decoded msgpack ``body``.

    Raises :class:`DecodeError` (``UNKNOWN_TYPE`` or ``MALFORMED``) on any
    unknown type, unknown or missing field, or wrong value type.
    """
    try:
        fast = _FAST_DECODERS[msg_type]
    except Exception:  # not a plain message type number (or unhashable): the reference words it
        return _slow_decode_body(msg_type, body)
    try:
        return fast(body)
    except Exception:  # noqa: BLE001 - _Bail, KeyError, a refusal: the reference decides and words it
        return _slow_decode_body(msg_type, body)


for _cls in MESSAGE_CLASSES.values():  # compile eagerly: errors show at import, not on the wire
    _record_encoder(_cls)
    _record_decoder(_cls)
for _cls in list(_ENCODERS):  # every record reachable from a message
    _FAST_ENCODERS[_cls] = _gen_encoder(_cls)
for _type, _cls in MESSAGE_CLASSES.items():
    try:
        _FAST_DECODERS[int(_type)] = _gen_decoder(_cls)
    except TypeError:  # a shape the generator does not know: the reference decodes it (slowly)
        pass
