"""The container tree: which dicts, lists and tuples of a state hold its leaves, with
their keys (str or int) in order. The coordinator's walk writes it into the manifest
(version 4, field ``tree``), so a state comes back without a template
(``Checkpointer.load_dict``) and every leaf has a *key path*, a tuple of str and int
(``("opt", "state", 0, "exp_avg")``), in place of its internal name (``/``-joined and
escaped, see :mod:`flexckpt.state.structure`), which users never see.

A node in JSON is ``0`` (a leaf: a tensor, plain, bytes, per-lane or per-rank value, found
by its name), ``["d", [key, ...], [node, ...]]`` (a dict), ``["l", [node, ...]]`` (a list)
or ``["t", [node, ...]]`` (a tuple). A list or tuple of plain values only is one plain leaf.

A manifest is untrusted: :func:`check_tree` bounds the depth and the number of nodes and
takes tags and keys from a fixed set before anything is built from it.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from flexckpt.errors import ManifestError
from flexckpt.state.plain import MAX_INT, MIN_INT
from flexckpt.state.structure import MAX_TREE_DEPTH, child_name

MAX_TREE_NODES = 1 << 24
MAX_KEY_CHARS = 4096
KeyPath = tuple  # of str and int


def check_tree(raw: Any, where: str) -> None:
    """Raises ManifestError unless ``raw`` is a tree :func:`walk_tree` can follow: a dict
    at the root, tags from the fixed set, str (non-empty) or int keys without repeats, at
    most MAX_TREE_DEPTH levels and MAX_TREE_NODES nodes."""
    if not (isinstance(raw, list) and raw and raw[0] == "d"):
        raise _bad(where, "its root must be a dict node [\"d\", keys, kids]")
    todo = [(raw, 0)]
    count = 0
    while todo:
        node, depth = todo.pop()
        count += 1
        if count > MAX_TREE_NODES:
            raise _bad(where, f"more than {MAX_TREE_NODES} nodes")
        if type(node) is int and node == 0:
            continue
        if not isinstance(node, list) or not node:
            raise _bad(where, f"a node must be 0 or a list, got {type(node).__name__}")
        if depth >= MAX_TREE_DEPTH:
            raise _bad(where, f"containers nested deeper than {MAX_TREE_DEPTH} levels")
        tag = node[0]
        if tag == "d" and len(node) == 3 and isinstance(node[1], list) and isinstance(node[2], list):
            keys, kids = node[1], node[2]
            if len(keys) != len(kids):
                raise _bad(where, f"a dict node has {len(keys)} keys and {len(kids)} values")
            seen = set()
            for k in keys:
                if type(k) is str:
                    ok = 0 < len(k) <= MAX_KEY_CHARS
                else:
                    ok = type(k) is int and MIN_INT <= k <= MAX_INT
                if not ok or (type(k), k) in seen:
                    shown = repr(k[:80] if type(k) is str else k) if type(k) in (str, int) else type(k).__name__
                    raise _bad(where, f"dict key {shown} is repeated, or not a non-empty str or a 64-bit int")
                seen.add((type(k), k))
        elif tag in ("l", "t") and len(node) == 2 and isinstance(node[1], list):
            kids = node[1]
        else:
            shown = repr(tag[:20]) if type(tag) is str else type(tag).__name__
            raise _bad(where, f"a container node must be [\"d\", keys, kids], [\"l\", kids] or [\"t\", kids] (tag "
                              f"{shown})")
        todo.extend((kid, depth + 1) for kid in kids)


def _bad(where: str, msg: str) -> ManifestError:
    return ManifestError(f"invalid checkpoint {where}: its container tree is malformed: {msg}")


def walk_tree(tree: Any) -> Iterator[tuple[str, KeyPath]]:
    """``(name, key path)`` of every leaf of a checked tree, in the saved order."""
    yield from _leaves(tree, "", ())


def _leaves(node: Any, prefix: str, path: KeyPath) -> Iterator[tuple[str, KeyPath]]:
    if node[0] == "d":
        keys = node[1]
        str_keys = {k for k in keys if type(k) is str}
        for key, kid in zip(keys, node[2]):
            name = prefix + child_name(str_keys, key)
            if kid == 0:
                yield name, path + (key,)
            else:
                yield from _leaves(kid, name + "/", path + (key,))
    else:
        for i, kid in enumerate(node[1]):
            name = f"{prefix}{i}"
            if kid == 0:
                yield name, path + (i,)
            else:
                yield from _leaves(kid, name + "/", path + (i,))


def name_path(name: str) -> KeyPath:
    """The key path of a leaf the tree does not hold (a manifest before version 4, or a
    key only another rank saved): its name's parts, unescaped, as str keys."""
    return tuple(_unescape(p) for p in name.split("/"))


def _unescape(part: str) -> str:
    if "%" not in part:
        return part
    out, i = [], 0
    while i < len(part):
        if part[i] == "%" and _is_hex(part[i + 1 : i + 3]):
            out.append(chr(int(part[i + 1 : i + 3], 16)))
            i += 3
        else:
            out.append(part[i])
            i += 1
    return "".join(out)


def _is_hex(s: str) -> bool:
    return len(s) == 2 and all(c in "0123456789abcdefABCDEF" for c in s)


def assemble(tree: Any, values: dict[str, Any], gone: Callable[[str], bool] | None) -> dict:
    """The state the tree describes, each leaf taken (popped) from ``values`` by name. A
    leaf ``values`` lacks, or a container ``gone`` names (excluded), is left out of its
    container (a list is then shorter)."""
    return _build(tree, "", values, gone)


_MISSING = object()


def _build(node: Any, prefix: str, values: dict[str, Any], gone: Callable[[str], bool] | None) -> Any:
    if node[0] == "d":
        keys = node[1]
        str_keys = {k for k in keys if type(k) is str}
        names = [prefix + child_name(str_keys, key) for key in keys]
    else:
        keys = range(len(node[1]))
        names = [f"{prefix}{i}" for i in keys]
    kids = node[2] if node[0] == "d" else node[1]
    out = {}
    for key, name, kid in zip(keys, names, kids):
        if kid == 0:
            value = values.pop(name, _MISSING)
        else:
            value = _MISSING if gone is not None and gone(name) else _build(kid, name + "/", values, gone)
        if value is not _MISSING:
            out[key] = value
    if node[0] == "d":
        return out
    return list(out.values()) if node[0] == "l" else tuple(out.values())


def put(out: dict, path: KeyPath, value: Any, what: str) -> None:
    """Place a leaf the tree does not hold at ``path`` (str keys) of ``out``."""
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ManifestError(f"{what} {path!r} lies below a list or value of the saved state; leave it out with "
                                f"exclude=({path!r},)")
    node[path[-1]] = value
