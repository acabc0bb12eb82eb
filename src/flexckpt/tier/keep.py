"""What one process keeps of the node's tier folder: the saved-rank bundles it wrote (its
own fast saves and the partners' copies it received), oldest first, pruned to
``keep_last`` steps a saved rank. Ranks of one node share its folder, so each removes only
what it wrote; the restored step's bundles on a node are its leader's after a recovery."""
from __future__ import annotations

import threading

from flexckpt.storage import Storage
from flexckpt.tier.inventory import done_name, remove_bundle

Bundle = tuple  # (step, marker name, file names): one saved rank's files of one step


class Holdings:
    def __init__(self, storage: Storage, rank: int) -> None:
        self.storage, self.rank = storage, rank
        self._lock = threading.Lock()
        self._bundles: dict[int, list[Bundle]] = {}  # saved rank -> bundles this process wrote, oldest first
        self._inherited: list[Bundle] = []  # the restored step's bundles on this node (its leader removes them)

    def wrote(self, doc: dict) -> None:
        """A bundle written and marked complete (``doc``: its marker)."""
        with self._lock:
            self._bundles.setdefault(doc["rank"], []).append(
                (doc["step"], done_name(doc["attempt"], doc["rank"], doc["world_size"]), list(doc["files"])))

    def prune(self, saved_rank: int, keep: int) -> None:
        """Remove the bundles of ``saved_rank`` this process wrote but the newest ``keep``;
        the inherited ones go once this rank holds ``keep`` newer bundles of its own."""
        with self._lock:
            mine = self._bundles.get(saved_rank, [])
            cut = max(0, len(mine) - keep)  # (fewer than keep: none goes; a negative cut took all but keep's excess)
            old, self._bundles[saved_rank] = (mine[:cut], mine[cut:]) if keep else (mine, [])
            if saved_rank == self.rank and len(self._bundles[saved_rank]) >= keep and self._inherited:
                old, self._inherited = old + self._inherited, []  # the restored step, once keep newer ones exist
        for step, doc_name, files in old:
            remove_bundle(self.storage, step, doc_name, files)

    def inherit(self, bundles: list[Bundle]) -> None:
        """The restored step's bundles on this node, owned by this process from now on."""
        with self._lock:
            self._inherited = list(bundles)

    def forget(self) -> None:
        """Every bundle was set aside (their removal is not this object's any more)."""
        with self._lock:
            self._bundles.clear()
            self._inherited = []

    def steps(self) -> list[int]:
        """The steps of the bundles held, ascending."""
        with self._lock:
            return sorted({b[0] for bs in self._bundles.values() for b in bs} | {b[0] for b in self._inherited})
