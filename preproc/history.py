"""User histories from an event log: the work of the history pass's Spark tasks (numpy, no Spark
objects).

A history feature H of an item feature I, a user column U and a time column T, with max_length L:
for every event (good row), the I keys (written as I's ids) of the last L events of the same U
whose T is strictly below the event's T, oldest first (ties in T by input order), most recent
last. Events of one user at the same T never see each other. An event counts for later
histories when it has a user and an item (with only_positive, also a positive label); every
event gets a history (maybe empty).

A side feature aligned with H (preproc.raw_spec.History.aligned_with) is a history of its own
item over H's events (those that count for H), so position k of both is one event: its value
(missing: id 0, `known` false), or with `gaps` its time before the event as an id (`gap_ids`).

`save_events` writes each block's events beside the parse cache; `bucketed` and `bucketed_state`
send them, and the state carried from an earlier output, to (feature, bucket of the user);
`compute` sorts one bucket's events by (user, time, line), gathers each event's history and
writes the bucket's state (each user's last L counting events: user, time, item key, in order)
under vocab/<H>.history/, which the next day (--vocab_from) prepends to its own events;
`save_split` writes a split's histories in its cache order for the writers to encode with I's
ids.
"""
import os
from typing import Dict, Iterator, List, Tuple

import numpy as np

from preproc import vocab
from preproc.layout import hash_buckets

EVENT = np.dtype([("user", "<u8"), ("time", "<f8"), ("line", "<i8"), ("position", "<i8"), ("item", "<u8"),
                  ("known", "?"), ("counts", "?")])
STATE = np.dtype([("user", "<u8"), ("time", "<f8"), ("item", "<u8"), ("known", "?")])   # (known: read as true
GAP_IDS = 64                                                                           # where a file lacks it)


def gap_ids(gaps: np.ndarray) -> np.ndarray:
    """Time gaps (> 0, in the time column's units) -> ids in [1, GAP_IDS): 1 below 2, then one id
    per doubling (2 to 4: 2, 4 to 8: 3, ...), the last id for all longer ones."""
    return 1 + np.clip(np.floor(np.log2(np.maximum(gaps, 1.0))), 0, GAP_IDS - 2).astype(np.uint64)


def state_dir(root: str, feature: str) -> str:
    return os.path.join(root, vocab.VOCAB_DIR, f"{feature}.history")


def state_files(root: str, feature: str) -> List[str]:
    folder = state_dir(root, feature)
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".npy")]


def events_path(cache_root: str, split_id: int) -> str:
    return os.path.join(cache_root, f"events{split_id:05d}.npy")


def history_paths(cache_root: str, split_id: int, feature: str) -> Tuple[str, str, str]:
    """The (lengths, item keys, items known) files of a split's histories of `feature`."""
    stem = os.path.join(cache_root, f"history{split_id:05d}-{feature}")
    return f"{stem}.lengths.npy", f"{stem}.items.npy", f"{stem}.known.npy"


def save_events(cache, rows, lines: np.ndarray, positions: np.ndarray, schema):
    """Appends a block's events of each history feature (schema order) to the open events file."""
    for feature, item in schema.histories.items():
        users, times, counts = rows.events[feature]
        events = np.zeros(len(lines), EVENT)
        events["user"], events["time"], events["line"], events["position"] = users, times, lines, positions
        keys, missing = rows.categorical[schema.categorical.index(item)]
        events["item"], events["known"], events["counts"] = keys, ~missing, counts
        np.save(cache, events)


def _pieces(feature: str, events: np.ndarray, buckets: int):
    for b, piece in hash_buckets(events["user"], 0, buckets):
        yield (feature, b), events[piece]


def bucketed(cache_root: str, split_id: int, features: List[str], buckets: int) -> Iterator[tuple]:
    """((feature, bucket), events) pieces of a split's events, one per feature and bucket."""
    blocks = {f: [np.zeros(0, EVENT)] for f in features}
    with open(events_path(cache_root, split_id), "rb") as f:
        while f.peek(1):
            for feature in features:
                blocks[feature].append(np.load(f))
    for feature in features:
        yield from _pieces(feature, np.concatenate(blocks[feature]), buckets)


def bucketed_state(feature: str, path: str, buckets: int) -> Iterator[tuple]:
    """((feature, bucket), events) pieces of a state file: counting events before every line of
    this run (negative lines, in their order), written nowhere."""
    state = np.load(path)
    events = np.zeros(len(state), EVENT)
    events["user"], events["time"], events["item"] = state["user"], state["time"], state["item"]
    events["known"] = state["known"] if "known" in state.dtype.names else True
    events["line"], events["position"], events["counts"] = np.arange(len(state)) - len(state), -1, True
    yield from _pieces(feature, events, buckets)


def _starts(change: np.ndarray) -> np.ndarray:
    """Per element of a sorted array, the index where its run starts (`change`: a run starts here)."""
    starts = np.flatnonzero(change)
    return starts[np.cumsum(change) - 1]


def _gather(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """values[starts[0]:starts[0] + lengths[0]], then the next run, ..., back to back."""
    firsts = np.cumsum(lengths) - lengths
    return values[np.repeat(starts - firsts, lengths) + np.arange(int(lengths.sum()))]


def compute(feature: str, bucket: int, pieces, max_length: int, out_root: str, split_lines: List[int],
            gaps: bool = False):
    """One bucket's events -> [(split, (feature, lines, positions, lengths, item keys, known))] of
    this run's events (with `gaps`, the items' gap ids as their keys); writes the bucket's state to
    out_root/vocab/<feature>.history/<bucket>.npy."""
    events = np.concatenate(list(pieces))
    events = events[np.lexsort((events["line"], events["time"], events["user"]))]
    user, time, counts = events["user"], events["time"], events["counts"]
    new_user = np.r_[True, user[1:] != user[:-1]]
    new_time = new_user | np.r_[True, time[1:] != time[:-1]]
    before = np.r_[0, np.cumsum(counts)]            # counting events before each sorted index
    hi = before[_starts(new_time)]                   # ... before its (user, time) group
    lo = np.maximum(before[_starts(new_user)], hi - max_length)
    user_end = np.r_[np.flatnonzero(new_user)[1:], len(events)][np.cumsum(new_user) - 1]
    kept = counts & (before[1:] > before[user_end] - max_length)
    state = np.zeros(int(kept.sum()), STATE)
    state["user"], state["time"], state["item"] = user[kept], time[kept], events["item"][kept]
    state["known"] = events["known"][kept]
    os.makedirs(state_dir(out_root, feature), exist_ok=True)
    np.save(os.path.join(state_dir(out_root, feature), f"{bucket:05d}.npy"), state)
    out = np.flatnonzero(events["line"] >= 0)
    if not len(out):
        return []
    split = np.searchsorted(np.asarray(split_lines), events["line"][out], side="right") - 1
    out = out[np.argsort(split, kind="stable")]
    split = np.sort(split)
    lengths = hi[out] - lo[out]
    if gaps:
        taken = gap_ids(np.repeat(time[out], lengths) - _gather(time[counts], lo[out], lengths))
        known = np.ones(len(taken), bool)
    else:
        taken, known = (_gather(events[k][counts], lo[out], lengths) for k in ("item", "known"))
    ends = np.r_[0, np.cumsum(lengths)]
    bounds = np.r_[np.flatnonzero(np.diff(split)) + 1, len(out)]
    result, first = [], 0
    for last in bounds:
        rows = out[first:last]
        result.append((int(split[first]), (feature, events["line"][rows], events["position"][rows],
                                            lengths[first:last], taken[ends[first]:ends[last]],
                                            known[ends[first]:ends[last]])))
        first = last
    return result


def save_split(cache_root: str, split_id: int, pieces, layout) -> Dict[int, Dict[str, int]]:
    """Writes a split's histories per feature in line order (the cache's order); returns its
    history ids per part: {pid: {feature: ids}}."""
    by_feature: Dict[str, list] = {}
    for piece in pieces:
        by_feature.setdefault(piece[0], []).append(piece[1:])
    part_ids: Dict[int, Dict[str, int]] = {}
    for feature, parts in by_feature.items():
        lines, positions, lengths = (np.concatenate([p[k] for p in parts]) for k in range(3))
        items, known = (np.concatenate([p[k] for p in parts]) for k in (3, 4))
        order = np.argsort(lines, kind="stable")
        starts = np.cumsum(lengths) - lengths
        lengths_path, items_path, known_path = history_paths(cache_root, split_id, feature)
        np.save(lengths_path, lengths[order])
        np.save(items_path, _gather(items, starts[order], lengths[order]))
        np.save(known_path, _gather(known, starts[order], lengths[order]))
        _, pids, _ = layout.assign(positions)
        for p, n in enumerate(np.bincount(pids, lengths, minlength=1).astype(np.int64)):
            if n:
                part_ids.setdefault(p, {})[feature] = int(n)
    return part_ids
