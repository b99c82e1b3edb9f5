"""A dynamic table's raw id -> row map on the server (`RowIndex`), vectorised: the live ids
sorted, looked up with np.searchsorted. Built from the table's ids file (repository_format: [R, 2]
int64, row r's (raw id, LIVE or FREE)); a delta moves it to a new one (`moved`): the rows of
evicted ids are freed, new ids take free rows, the lowest first, in ascending id order, and the
table grows past R only when no free row is left. The assignment depends only on the index and
the delta, so servers sharing Redis (keyed by row) that apply the same deltas agree on it.
Immutable: each snapshot of the server holds its own.
"""
from typing import Tuple

import numpy as np

from deployment.repository_format import FREE, IDS_DTYPE, LIVE


class RowIndex:
    """row_ids [R, 2] int64 (per row: raw id, LIVE or FREE) -> find(ids) -> rows."""

    def __init__(self, row_ids: np.ndarray):
        self.row_ids = np.array(row_ids, IDS_DTYPE).reshape(-1, 2)
        self.row_ids.setflags(write=False)
        live = np.flatnonzero(self.row_ids[:, 1] == LIVE)
        order = np.argsort(self.row_ids[live, 0], kind="stable")
        self.ids, self.rows = self.row_ids[live, 0][order], live[order]
        if self.ids.size and np.any(self.ids[1:] == self.ids[:-1]):
            raise ValueError(f"an id is live in two rows ({int(self.ids[1:][self.ids[1:] == self.ids[:-1]][0])})")

    @property
    def size(self) -> int:
        """R: the rows the table needs."""
        return len(self.row_ids)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Raw ids (any shape, int64) -> their rows (same shape, int64), -1 for an id not live."""
        if not self.ids.size:
            return np.full(np.shape(ids), -1, np.int64)
        at = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[at] == ids, self.rows[at], -1)

    def moved(self, updated: np.ndarray, live: np.ndarray) -> Tuple["RowIndex", np.ndarray, np.ndarray]:
        """The index after a delta whose ids `updated` [n] (ascending) get new rows and after which
        exactly `live` [L] (ascending) are live: (the new index, the rows of `updated` [n], the rows
        whose entry changed [k], ascending). ValueError, one line, if `updated` is not within `live`
        or an id new to this index has no row in the delta."""
        if not np.isin(updated, live, assume_unique=True).all():
            raise ValueError(f"updates {int((~np.isin(updated, live)).sum())} ids that are not live after it")
        rows = self.find(live)
        new = live[rows < 0]
        if not np.isin(new, updated, assume_unique=True).all():
            raise ValueError(f"{int((~np.isin(new, updated)).sum())} ids new to the served version have no row "
                             "in it")
        row_ids = self.row_ids.copy()
        evicted = np.setdiff1d(self.rows, rows[rows >= 0], assume_unique=True)
        row_ids[evicted, 1] = FREE
        free = np.flatnonzero(row_ids[:, 1] == FREE)
        if len(free) < len(new):   # more rows
            row_ids = np.concatenate([row_ids, np.zeros((len(new) - len(free), 2), IDS_DTYPE)])
            free = np.concatenate([free, np.arange(len(self.row_ids), len(row_ids))])
        taken = free[:len(new)]
        row_ids[taken, 0], row_ids[taken, 1] = new, LIVE
        index = RowIndex(row_ids)
        changed = np.union1d(evicted, taken)
        return index, index.find(updated), changed
