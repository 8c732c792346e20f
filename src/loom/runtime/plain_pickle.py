"""Read a pickle that holds only plain data, without `pickle.Unpickler`.

torch's Flight Recorder hands its dump over as pickle bytes (the JSON dump is 5-10x slower,
too slow for every logging step). `pickle.Unpickler` with a `find_class` that refuses all is
safe today, but its safety rests on every opcode that can call code going through
`find_class`; this reader never calls anything. It walks the opcodes with `pickletools.genops`
(which parses, never executes) and builds dicts, lists, tuples, sets, strings, bytes, numbers,
booleans and None on its own stack. Any opcode that names a global, calls, builds an object,
or reaches outside the bytes (persistent ids, extension codes, out-of-band buffers) is refused
with the opcode's name.
"""

from __future__ import annotations

import pickletools
from typing import Any


class NotPlainData(ValueError):
    """The pickle names a class or function, calls one, or is malformed."""


_MARK = object()

_SCALARS = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING",
    "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
})
_EMPTY = {"EMPTY_DICT": dict, "EMPTY_LIST": list, "EMPTY_TUPLE": tuple, "EMPTY_SET": set}
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_NO_EFFECT = frozenset({"PROTO", "FRAME"})
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})


def loads(data: bytes) -> Any:
    """The plain value `data` pickles; `NotPlainData` for anything else."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name == "STOP":
                if len(stack) != 1 or stack[0] is _MARK:
                    raise NotPlainData("the pickle ends with a malformed stack")
                return stack[0]
            _apply(name, arg, stack, memo)
    except NotPlainData:
        raise
    except (ValueError, IndexError, KeyError, TypeError) as error:
        raise NotPlainData(f"malformed pickle: {error}") from None
    raise NotPlainData("the pickle has no STOP opcode")


def _apply(name: str, arg: Any, stack: list[Any], memo: dict[int, Any]) -> None:
    """One opcode's effect on the stack and memo (genops has already decoded `arg`)."""
    if name in _NO_EFFECT:
        return
    if name in _SCALARS:
        stack.append(bytes(arg) if name == "BYTEARRAY8" else arg)
    elif name in _CONSTANTS:
        stack.append(_CONSTANTS[name])
    elif name in _EMPTY:
        stack.append(_EMPTY[name]())
    elif name == "MARK":
        stack.append(_MARK)
    elif name in _MEMO_PUT:
        memo[int(arg)] = stack[-1]
    elif name == "MEMOIZE":
        memo[len(memo)] = stack[-1]
    elif name in _MEMO_GET:
        stack.append(memo[int(arg)])
    elif name == "POP":
        stack.pop()
    elif name == "DUP":
        stack.append(stack[-1])
    else:
        _apply_container(name, stack)


def _apply_container(name: str, stack: list[Any]) -> None:
    """Opcodes that fill or build a container from the stack; anything else is refused."""
    if name in ("TUPLE1", "TUPLE2", "TUPLE3"):
        size = int(name[-1])
        items = stack[-size:]
        del stack[-size:]
        stack.append(tuple(_no_marks(items)))
        return
    if name == "APPEND":
        (value,) = _no_marks([stack.pop()])
        _target(stack, list).append(value)
        return
    if name == "SETITEM":
        value, key = _no_marks([stack.pop(), stack.pop()])
        _target(stack, dict)[key] = value
        return
    if name not in ("TUPLE", "LIST", "DICT", "APPENDS", "SETITEMS", "ADDITEMS", "FROZENSET",
                    "POP_MARK"):
        raise NotPlainData(f"refused opcode {name}: only plain data is read")
    items = _pop_to_mark(stack)
    if name == "TUPLE":
        stack.append(tuple(items))
    elif name == "LIST":
        stack.append(items)
    elif name == "FROZENSET":
        stack.append(frozenset(items))
    elif name in ("DICT", "SETITEMS"):
        pairs = dict(zip(items[::2], items[1::2], strict=True))
        if name == "DICT":
            stack.append(pairs)
        else:
            _target(stack, dict).update(pairs)
    elif name == "APPENDS":
        _target(stack, list).extend(items)
    elif name == "ADDITEMS":
        _target(stack, set).update(items)


def _pop_to_mark(stack: list[Any]) -> list[Any]:
    """The items above the topmost mark, removed from the stack with the mark."""
    for index in range(len(stack) - 1, -1, -1):
        if stack[index] is _MARK:
            items = stack[index + 1:]
            del stack[index:]
            return items
    raise NotPlainData("malformed pickle: no mark on the stack")


def _no_marks(items: list[Any]) -> list[Any]:
    """`items`, refused if a mark stands among them (a mark is never a value)."""
    if any(item is _MARK for item in items):
        raise NotPlainData("malformed pickle: a mark where a value belongs")
    return items


def _target(stack: list[Any], kind: type) -> Any:
    """The container an opcode fills: it must be of the type the opcode expects."""
    if not stack or type(stack[-1]) is not kind:
        raise NotPlainData(f"malformed pickle: expected a {kind.__name__} to fill")
    return stack[-1]
