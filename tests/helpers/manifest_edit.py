"""Editing a committed step's manifest in place, as a fault test makes one that is valid JSON but
wrong."""
import os

import orjson

from flexckpt.format.jsondoc import SEAL_FIELD, seal
from flexckpt.format.names import MANIFEST, step_dir


def set_at(path, value):
    """An edit of a manifest document: the value at key path ``path`` (dict keys, list
    indices) set to ``value``."""
    def edit(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


def _edit_manifest(root, step, edit):
    path = os.path.join(root, step_dir(step), MANIFEST)
    with open(path, "rb") as f:
        doc = orjson.loads(f.read())
    sealed = doc.pop(SEAL_FIELD, None) is not None
    edit(doc)
    with open(path, "wb") as f:
        f.write(seal(orjson.dumps(doc)) if sealed else orjson.dumps(doc))  # the checksum recomputed, as an attacker would
