"""Serving a repository's `tables` form (deployment/exporter/table_files.py writes it), updated
while it serves: the backend (backend.py) for repositories with table files.

The embeddings are looked up in NumPy from the table files, the `<name>_dense` SavedModel
computes predictions and logits. The tables are held whole in memory (`MemoryTables`), or, for
tables larger than memory, looked up through tiers/lookup.py's `LookupTiers` (a cache of hot
rows, optionally Redis, the table files memory-mapped as the store); both offer the `Tables`
interface. What is served is a `Snapshot` (version, dense model, tables, an overlay of updated
rows); each request takes the current one once and uses only it, so a new version swaps in
between requests without a restart:

- a delta (deployment/repository_format.py) whose base is the served version: its rows become
  the overlay of a new snapshot (lookups consult it first; no table is copied) with the delta's
  dense model, swapped in; once every request that started on an older snapshot has finished,
  the rows are written into the tables in place (through the tiers: the store's files, Redis and
  the cache; the delta's dense model is kept in the store's directory and named in its
  store.json, so that a restart serves the version the store holds) and a snapshot without
  overlay replaces it. Requests never wait for the update.
  A dynamic table (raw 64-bit ids; its ids file names each row's id) is looked up by raw id
  through the snapshot's `RowIndex` (id_index.py), an id not live reading zeros; a delta moves
  the index (rows of evicted ids freed, new ids into free rows: the overlay and the writes are by
  row) and writes the changed rows' entries into the ids file too. A table grows when a delta
  brings more new ids than free rows (through the tiers: its store files, recorded in store.json).
- a full export with another version: loaded (in memory: whole, memory for both while loading;
  through the tiers: new tiers on its store), swapped in; the old tables are closed once the
  requests using them finished.

`Updater` polls a directory for such updates and applies them in order of their new step. It
takes only what deploy.py writes (deployment/repository_format.py's check_update_files): every
file listed in the manifest with its size and CRC-32, nothing else, no symbolic link; a delta's
rows finite. A delta's dense SavedModel is never loaded as a program: only its variables are read
into the served model's (kept through the tiers: the served graph with the delta's variables). A
full export's SavedModel is a program that runs in the server: taken only when allowed.
"""
import dataclasses
import json
import os
import shutil
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import numpy as np

from deployment.repository_format import (DELTA_INFO, EXPORT_INFO, IDS_DTYPE, LOGITS, PAD, PREDICTIONS, TABLES_INFO,
                                          RepositoryError, ServingLayout, Version, check_files, check_update_files,
                                          export_files, export_version, read_delta, read_export_info, table_lookups)
from deployment.serving.backend import check_request, with_version
from deployment.serving.errors import BadRequest, UpdateRefused
from deployment.serving.id_index import RowIndex
from deployment.serving.tiers import LookupTiers, TierConfig, store_state
from utils.errors import StoreError
from utils.files import no_space, tree_bytes

WRITE_ROWS = 1 << 16   # rows a delta writes into a table at a time
KEPT_DENSE = "dense_model"   # store.json's key: the dense model of the version the store holds (tiers)
STATE_BYTES = 64 << 10   # room kept for store.json's rewrites while a delta is applied (tiers)


class Tables(Protocol):
    """A version's embedding tables, as a snapshot reads and a delta updates them (MemoryTables,
    tiers.LookupTiers). Thread-safe: lookups run concurrently with one update."""
    shapes: List[Tuple[int, int]]   # per feature (rows, D)

    def lookup(self, ids: Dict[int, np.ndarray]) -> Dict[int, np.ndarray]:
        """Per feature its ids (any shape, in range: not checked) -> its rows [*ids.shape, D], new arrays."""

    def advancing(self, base: Version, new: Version, record: Optional[dict] = None):
        """A context: the `update`s inside move the tables from version `base` to `new`."""

    def update(self, feature: int, ids: np.ndarray, rows: np.ndarray):
        """Rows `ids` [n] (unique) become `rows` [n, D], in place."""

    def row_ids(self, feature: int) -> np.ndarray:
        """A dynamic table's ids file [R, 2] int64 (per row: raw id, LIVE or FREE), a copy."""

    def update_ids(self, feature: int, rows: np.ndarray, row_ids: np.ndarray):
        """A dynamic table's entries `rows` [k] become `row_ids` [k, 2], in place (inside `advancing`)."""

    def grow(self, feature: int, rows: int):
        """A dynamic table takes `rows` rows (more than now; the new ones free). Inside `advancing`."""

    def stats(self) -> dict:
        """Lookup counts (hits per tier), {} for tables in memory."""

    def close(self):
        """Frees what it holds; no lookups after."""


class MemoryTables:
    """Every table of a repository held whole in memory (`arrays`: per feature [rows, D] float32).
    Updates are writes in place: the table files keep the export."""

    def __init__(self, directory: str, tables: List[dict]):
        self.arrays = [np.load(os.path.join(directory, t["file"])) for t in tables]
        self.shapes = [a.shape for a in self.arrays]
        self.ids = {f: np.load(os.path.join(directory, t["ids_file"])) for f, t in enumerate(tables)
                    if t.get("dynamic")}

    def lookup(self, ids: Dict[int, np.ndarray]) -> Dict[int, np.ndarray]:
        return {f: self.arrays[f][x] for f, x in ids.items()}

    @contextmanager
    def advancing(self, base: Version, new: Version, record: Optional[dict] = None) -> Iterator[None]:
        yield

    def update(self, feature: int, ids: np.ndarray, rows: np.ndarray):
        self.arrays[feature][ids] = rows

    def row_ids(self, feature: int) -> np.ndarray:
        return self.ids[feature].copy()

    def update_ids(self, feature: int, rows: np.ndarray, row_ids: np.ndarray):
        self.ids[feature][rows] = row_ids

    def grow(self, feature: int, rows: int):
        old = self.arrays[feature]   # lookups of older snapshots read it until the swap below, then either
        self.ids[feature] = np.concatenate([self.ids[feature], np.zeros((rows - len(old), 2), np.int64)])
        self.arrays[feature] = np.concatenate([old, np.zeros((rows - len(old), old.shape[1]), old.dtype)])
        self.shapes[feature] = self.arrays[feature].shape

    def stats(self) -> dict:
        return {}

    def close(self):
        self.arrays = []


@dataclasses.dataclass
class Snapshot:
    """One served version. `tables`: its Tables; `index`: per dynamic table its RowIndex (raw id ->
    row); `overlay`: per table (rows [n] int64 sorted unique, values [n, D_f] float32) that replace
    those rows of its tables; `active`: the requests using it (guarded by its Model's lock)."""
    version: Version
    dense: "DenseModel"
    tables: Tables
    index: Dict[int, RowIndex] = dataclasses.field(default_factory=dict)
    overlay: Dict[int, Tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    active: int = 0

    def lookup(self, ids: Dict[int, np.ndarray]) -> Dict[int, np.ndarray]:
        """Per table its ids (any shape: row numbers in range; a dynamic table's raw ids) -> its
        rows [*ids.shape, D_f]; a dynamic table's ids not live read zeros."""
        rows, missing = dict(ids), {}
        for t, index in self.index.items():
            if t in ids:
                found = index.find(ids[t])
                missing[t], rows[t] = found < 0, np.maximum(found, 0)
        rows = {t: x for t, x in rows.items() if t not in missing or not missing[t].all()}
        out = self.tables.lookup(rows)
        for f, (new_ids, new_rows) in self.overlay.items():
            if f in rows:
                at = np.minimum(np.searchsorted(new_ids, rows[f]), len(new_ids) - 1)
                hit = new_ids[at] == rows[f]
                out[f][hit] = new_rows[at[hit]]
        for t, miss in missing.items():
            if t in out:
                out[t][miss] = 0
            else:
                out[t] = np.zeros(ids[t].shape + (self.tables.shapes[t][1],), np.float32)
        return out


@dataclasses.dataclass(frozen=True)
class _Repository:
    """What a tables-form repository serves: its name, layout, table directory, per table and per
    lookup tables.json's entry (repository_format.table_lookups), the version its table files hold
    and that version's dense model (the export's, or after deltas applied through the tiers the
    one kept in the table directory)."""
    path: str
    name: str
    layout: ServingLayout
    directory: str
    tables: List[dict]
    lookups: List[dict]
    signature: dict
    version: Version
    dense_dir: str

    @classmethod
    def read(cls, path: str) -> "_Repository":
        """Raises UpdateRefused without the tables form, StoreError for table files missing,
        half-written, of another export, or updated past the export without a kept dense model."""
        info = read_export_info(path)
        if "tables" not in info["forms"]:
            raise UpdateRefused(f"{path}: has no table files (exported with --forms={','.join(info['forms'])}); "
                                "export with --forms including tables")
        state = store_state(path)
        directory = os.path.join(path, info["table_files"]["directory"])
        with open(os.path.join(directory, TABLES_INFO)) as f:
            tables_info = json.load(f)
        version, exported = Version.from_json(state["holds"]), export_version(path)
        dense_dir = os.path.join(path, f"{info['name']}_dense")
        if version != exported:
            kept = state.get(KEPT_DENSE)
            if not kept or not os.path.isdir(os.path.join(directory, kept)):
                raise StoreError(f"{directory}: holds {version} (deltas applied after the export, {exported}) "
                                 f"but not its dense model {kept or '(none recorded)'}: export {version} again "
                                 "with deploy.py and serve that")
            dense_dir = os.path.join(directory, kept)
        return cls(path, info["name"], ServingLayout(**info["layout"]), directory, tables_info["tables"],
                   table_lookups(tables_info), model_signature(info["signature"]), version, dense_dir)

    @property
    def dynamic(self) -> List[int]:
        """Its dynamic tables' indices."""
        return [t for t, entry in enumerate(self.tables) if entry.get("dynamic")]

    def served_as(self, other: "_Repository") -> bool:
        """Whether this export is of the model `other` is of (signature, tables but a dynamic table's
        rows, lookups)."""
        def tables(r):
            return [{k: v for k, v in t.items() if not (t.get("dynamic") and k == "rows")} for t in r.tables]
        return (self.signature, tables(self), self.lookups) == (other.signature, tables(other), other.lookups)

    def snapshot(self, tiers: Optional[TierConfig], log: Callable[[str], None]) -> Snapshot:
        """Loads the dense model, and the tables: whole into memory, or through tiers `tiers`."""
        tables = MemoryTables(self.directory, self.tables) if tiers is None else \
            LookupTiers(self.path, tiers, expect=self.version, log=log)
        try:
            index = {}
            for t in self.dynamic:
                try:
                    index[t] = RowIndex(tables.row_ids(t))
                except ValueError as e:
                    raise StoreError(f"{os.path.join(self.directory, self.tables[t]['ids_file'])}: {e}")
            return Snapshot(self.version, DenseModel(self.dense_dir, self.layout), tables, index)
        except BaseException:
            tables.close()
            raise


def model_signature(signature: dict) -> dict:
    """A checkpoint signature without what only training needs (its optimizer)."""
    return {k: v for k, v in signature.items() if k != "optimizer"}


def _saved_model(model_dir: str) -> str:
    saved = os.path.join(model_dir, "1", "model.savedmodel")
    return saved if os.path.isdir(saved) else model_dir


class DenseModel:
    """The dense SavedModel of a model directory (`<dir>/1/model.savedmodel`, or the SavedModel
    itself): (numerical [B, n], embeddings [B, sum D_f]) -> {predictions, logits} [B, 1] ([B, H]
    of H heads), numpy.
    Run once on a row of zeros when loaded, so that its first request is not slower."""

    def __init__(self, model_dir: str, layout: ServingLayout):
        import tensorflow as tf
        self._root = tf.saved_model.load(_saved_model(model_dir))
        self._serve = self._root.signatures["serving_default"]
        self._layout = layout
        self._warm_up()

    def _warm_up(self):
        self(np.zeros((1, self._layout.num_numerical), np.float32),
             np.zeros((1, sum(self._layout.embedding_dims)), np.float32))

    def load_weights(self, model_dir: str):
        """Takes the weights of another dense SavedModel of the same model (a delta's): reads its
        variables only, far less work (and time holding Python's lock) than loading it, and no
        graph of the delta's runs. Weights not finite: UpdateRefused (this model is then unusable
        until the next load_weights)."""
        import tensorflow as tf
        path = os.path.join(_saved_model(model_dir), "variables", "variables")
        tf.train.Checkpoint(dense=self._root.dense).read(path).assert_existing_objects_matched()
        reader = tf.train.load_checkpoint(path)
        if not all(np.isfinite(reader.get_tensor(name)).all() for name, dtype in
                   reader.get_variable_to_dtype_map().items() if dtype.is_floating):
            raise UpdateRefused(f"{path}: its dense model holds NaN or infinite weights")
        self._warm_up()

    def __call__(self, numerical: np.ndarray, embeddings: np.ndarray) -> Dict[str, np.ndarray]:
        import tensorflow as tf
        out = self._serve(numerical_features=tf.constant(numerical), embeddings=tf.constant(embeddings))
        return {PREDICTIONS: out[PREDICTIONS].numpy(), LOGITS: out[LOGITS].numpy()}


class Model:
    """A tables-form repository served, from memory or through lookup tiers `tiers`, replaceable by
    newer versions while serving: a backend.Backend.

    infer(numerical [B, n] float32, categorical [B, W] int64) -> predictions, logits [B, 1]
    ([B, H] of H heads) float32 and model_version [B, 1] int64. Thread-safe: requests and one updater. `log` gets
    the tiers' lines (Redis down, back).
    """

    def __init__(self, repository: str, tiers: Optional[TierConfig] = None, log: Callable[[str], None] = print):
        self._tiers, self._log = tiers, log
        self._repository = _Repository.read(repository)
        self._current = self._repository.snapshot(tiers, log)
        # A second dense model, used by no snapshot being served: the next delta's weights go into it
        self._standby = DenseModel(self._repository.dense_dir, self.layout)
        self._retired: List[Snapshot] = []   # swapped out, maybe still in use
        # Per categorical column [W]: the lowest and highest id allowed (padding in multi-hot features;
        # the fewest rows of the tables its lookups read; a feature no lookup reads, or only
        # dynamic tables, raw ids: any id), its feature (the tables of later versions are the same)
        tables, lookups, width = self._repository.tables, self._repository.lookups, self.layout.categorical_width
        low, high = np.full(width, np.iinfo(np.int64).min), np.full(width, np.iinfo(np.int64).max)
        feature_of = np.zeros(width, np.int64)
        self._cardinalities: Dict[int, int] = {}   # per feature read, the rows it may address
        for x in lookups:
            if tables[x["table"]].get("dynamic"):
                continue
            columns, rows = slice(*x["categorical_columns"]), tables[x["table"]]["rows"]
            low[columns], feature_of[columns] = PAD if x["max_hotness"] is not None else 0, x["feature"]
            high[columns] = np.minimum(high[columns], rows - 1)
            self._cardinalities[x["feature"]] = min(rows, self._cardinalities.get(x["feature"], rows))
        self._bounds = low, high, feature_of
        self._lock = threading.Condition()

    @property
    def name(self) -> str:
        return self._repository.name

    @property
    def layout(self) -> ServingLayout:
        return self._repository.layout

    @property
    def version(self) -> Version:
        return self._current.version

    def stats(self) -> dict:
        """The served tables' lookup counts (tiers.LookupTiers.stats; {} in memory)."""
        return self._current.tables.stats()

    def close(self):
        self._current.tables.close()

    @contextmanager
    def snapshot(self):
        """The current snapshot, counted as in use until the block ends."""
        with self._lock:
            snapshot = self._current
            snapshot.active += 1
        try:
            yield snapshot
        finally:
            with self._lock:
                snapshot.active -= 1
                if snapshot.active == 0:
                    self._lock.notify_all()

    def infer(self, numerical: np.ndarray, categorical: np.ndarray) -> Dict[str, np.ndarray]:
        with self.snapshot() as snapshot:
            return self.infer_with(snapshot, numerical, categorical)

    def infer_with(self, snapshot: Snapshot, numerical: np.ndarray, categorical: np.ndarray) -> Dict[str, np.ndarray]:
        """`infer` on `snapshot` (one taken with `snapshot()`)."""
        check_request(numerical)
        out = snapshot.dense(numerical, self.embeddings(snapshot, categorical))
        return with_version(out, snapshot.version, len(numerical))

    def embeddings(self, snapshot: Snapshot, categorical: np.ndarray) -> np.ndarray:
        """categorical_features [B, W] int64 -> embeddings [B, sum of the lookups' widths] float32, as
        docs/deployment.md says: per lookup its feature's columns' ids without padding, their rows in
        its table combined by sum or mean, or a sequence's unpooled (`unpooled`; a dynamic table's
        ids are raw ids, looked up by value)."""
        self._check(categorical)
        lookups = self._repository.lookups
        ids = [categorical[:, slice(*x["categorical_columns"])] for x in lookups]
        parts = [(x["table"], i[:, 0] if x["max_hotness"] is None and not x.get("sequence") else
                  np.where(i != PAD, i, 0)) for x, i in zip(lookups, ids)]   # per lookup (table, ids [B] or [B, h])
        per_table: Dict[int, list] = {}
        for t, part in parts:
            per_table.setdefault(t, []).append(part.reshape(-1))
        found = snapshot.lookup({t: flat[0] if len(flat) == 1 else np.concatenate(flat)
                                 for t, flat in per_table.items()})
        taken = {t: 0 for t in per_table}   # rows of found[t] handed out
        out = np.empty((len(categorical), lookups[-1]["embedding_columns"][1]), np.float32)
        for x, i, (t, part) in zip(lookups, ids, parts):
            rows = found[t][taken[t]:taken[t] + part.size].reshape(part.shape + (-1,))
            taken[t] += part.size
            a, b = x["embedding_columns"]
            present = i != PAD   # rows: [B, h, D]
            if x.get("sequence"):
                out[:, a:b] = unpooled(rows, present, x["sequence"])
                continue
            if x["max_hotness"] is None:
                out[:, a:b] = rows
                continue
            weights = present.astype(np.float32)
            if x["combiner"] == "mean":
                weights *= (np.float32(1) / np.maximum(present.sum(1), 1).astype(np.float32))[:, None]
            out[:, a:b] = (rows * weights[:, :, None]).sum(1)
        return out

    def _check(self, categorical: np.ndarray):
        """Refuses ids outside [0, rows) (padding aside in multi-hot features; a dynamic table's raw
        ids: any int64), naming the features."""
        low, high, feature_of = self._bounds
        outside = ((categorical < low) | (categorical > high)).any(0)
        if outside.any():
            bad = sorted(set(feature_of[outside].tolist()))
            raise BadRequest(f"embedding ids out of range [0, cardinality) in features (0-based): {bad} "
                             f"(cardinalities {[self._cardinalities[f] for f in sorted(self._cardinalities)]})")

    def _swap(self, snapshot: Snapshot):
        with self._lock:
            self._retired = [s for s in self._retired + [self._current] if s.active]
            self._current = snapshot

    def _wait_for_retired(self):
        """Returns once no request uses a snapshot older than the current one."""
        with self._lock:
            self._lock.wait_for(lambda: not any(s.active for s in self._retired))
            self._retired = []

    def apply_delta(self, delta) -> int:
        """Serves repository_format.Delta `delta` (its base must be the served version); returns the
        rows it updated. Raises UpdateRefused, or repository_format.DeltaError for a broken delta."""
        served = self._current
        tables = served.tables
        if delta.base != served.version:
            raise UpdateRefused(f"its base is {delta.base}, serving {served.version}")
        if delta.name != self.name or model_signature(delta.signature) != self._repository.signature:
            raise UpdateRefused(f"it is of another model ({delta.name!r} or its signature), serving {self.name!r}")
        overlay, index, changed, grown = {}, dict(served.index), {}, {}
        for f in delta.features:
            if not 0 <= f < len(tables.shapes):
                raise UpdateRefused(f"it updates table {f}, the model has {len(tables.shapes)}")
            ids, rows = delta.rows(f)
            if delta.dynamic(f) != (f in index):
                raise UpdateRefused(f"table {f} is {'' if f in index else 'not '}dynamic, in the delta "
                                    f"{'' if delta.dynamic(f) else 'not '}dynamic")
            if f in index:
                if rows.shape[1] != tables.shapes[f][1]:
                    raise UpdateRefused(f"table {f}: rows {list(rows.shape)}, it is {list(tables.shapes[f])}")
                try:
                    index[f], at, changed[f] = index[f].moved(ids, delta.live(f))
                except ValueError as e:
                    raise UpdateRefused(f"dynamic table {f}: it {e}")
                if index[f].size > tables.shapes[f][0]:
                    grown[f] = index[f].size
                order = np.argsort(at)
                ids, rows = at[order], rows[order]
            elif ids.size and (rows.shape != (len(ids), tables.shapes[f][1]) or ids[-1] >= tables.shapes[f][0]):
                raise UpdateRefused(f"table {f}: rows {list(rows.shape)} for ids up to {ids[-1]}, it is "
                                    f"{list(tables.shapes[f])}")
            overlay[f] = (ids, rows)
        dense = self._standby
        dense.load_weights(delta.dense_model)
        kept = self._keep_dense(tables, delta, grown)
        with tables.advancing(delta.base, delta.new, kept and {KEPT_DENSE: kept}):
            for f, rows in grown.items():   # before the new index reads them
                tables.grow(f, rows)
            self._swap(Snapshot(delta.new, dense, tables, index, overlay))
            self._wait_for_retired()   # from here on, no request uses `served` (its dense model is the standby)
            self._standby = served.dense
            for f, (ids, rows) in overlay.items():   # in blocks: requests run between them
                for start in range(0, len(ids), WRITE_ROWS):
                    tables.update(f, ids[start:start + WRITE_ROWS], rows[start:start + WRITE_ROWS])
                    time.sleep(0)
            for f, rows in changed.items():
                tables.update_ids(f, rows, index[f].row_ids[rows])
        self._swap(Snapshot(delta.new, dense, tables, index))
        if kept:
            self._prune_dense(kept)
        return sum(len(ids) for ids, _ in overlay.values())

    def _keep_dense(self, tables: Tables, delta, grown: Dict[int, int]) -> Optional[str]:
        """Through the tiers (the table files updated in place): the delta's dense model in the
        table directory, `dense-<step>`: the served SavedModel with the delta's variables (the
        delta's own graph is never loaded); its name. None in memory. Before any table changes:
        a device without room for the copy and for the rows the tables grow by (`grown`: per table
        its new rows) refuses the delta (UpdateRefused naming the directory and the bytes; nothing
        of the copy left)."""
        if not isinstance(tables, LookupTiers):
            return None
        directory, name = self._repository.directory, f"dense-{delta.new.step}"
        self._prune_dense(tables.store.state.get(KEPT_DENSE))
        tmp = os.path.join(directory, f"{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        graph = _saved_model(os.path.join(self._repository.path, f"{self.name}_dense"))   # the export's
        variables = os.path.join(_saved_model(delta.dense_model), "variables")
        need = (tree_bytes(graph) - tree_bytes(os.path.join(graph, "variables")) + tree_bytes(variables) + STATE_BYTES
                + sum((rows - tables.shapes[f][0]) * (tables.shapes[f][1] * 4 + IDS_DTYPE.itemsize * 2)
                      for f, rows in grown.items()))
        free = shutil.disk_usage(directory).free
        full = UpdateRefused(f"{directory}: no space left on device: the update needs about {need:,} bytes there, "
                             f"{free:,} were free (nothing of it left; serving {self.version})")
        if need > free:
            raise full
        try:
            shutil.copytree(graph, tmp, ignore=lambda d, names: ["variables"] if d == graph else [])
            shutil.copytree(variables, os.path.join(tmp, "variables"))
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not no_space(e):
                raise
            raise full from None
        os.replace(tmp, os.path.join(directory, name))
        return name

    def _prune_dense(self, keep: Optional[str]):
        """Removes the kept dense models (and leftovers of copies) of the table directory but `keep`."""
        for entry in os.listdir(self._repository.directory):
            if entry.startswith("dense-") and entry != keep:
                shutil.rmtree(os.path.join(self._repository.directory, entry))

    def replace(self, repository: str):
        """Serves the full export `repository` instead (same layout), loaded before the swap; the
        old tables are closed once no request uses them."""
        new = _Repository.read(repository)
        if not new.served_as(self._repository):
            raise UpdateRefused("it is of another model (its signature or tables differ from the served model's)")
        old = self._current.tables
        self._swap(new.snapshot(self._tiers, self._log))
        self._repository = new
        self._wait_for_retired()
        old.close()


def unpooled(rows: np.ndarray, present: np.ndarray, length: int) -> np.ndarray:
    """A sequence lookup's block of embeddings (repository_format): the rows [B, h, D] of a
    request's columns, `present` [B, h] where they hold an id -> [B, L D + 1]: per sample the rows of
    its last min(count, L) ids in order, zeros after them, then its count of ids."""
    count = present.sum(1)
    kept = present & (np.cumsum(present[:, ::-1], 1)[:, ::-1] <= length)   # the last L present
    out = np.zeros((len(rows), length, rows.shape[2]), np.float32)
    sample = np.nonzero(kept)[0]
    slot = np.cumsum(kept, 1)[kept] - 1
    out[sample, slot] = rows[kept]
    return np.concatenate([out.reshape(len(rows), -1), count[:, None].astype(np.float32)], axis=1)


def check_export(repository: str):
    """Every file the full export `repository`'s export.json lists is as listed (repository_format.
    check_files; RepositoryError naming the first that is not), but the table files of a store
    that deltas updated in place through the lookup tiers (store.json holds a later version)."""
    info = read_export_info(repository)
    entries, skip = export_files(repository, info), []
    if info.get("table_files") and Version.from_json(store_state(repository)["holds"]) != export_version(repository):
        directory = info["table_files"]["directory"]
        skip = [e["file"] for e in entries
                if e["file"].startswith(f"{directory}/table_") and e["file"].endswith(".npy")]
    check_files(repository, EXPORT_INFO, entries, RepositoryError, skip)


class Updater:
    """Applies the updates that appear in `directory` to `model`, polling every `poll_seconds` in a
    thread: each new subdirectory holding delta.json (a delta) or export.json (a full export, only
    with `allow_full_exports`: its SavedModel runs in the server), in order of its new step, once.
    Names starting with '.' (writers' temporary folders) are never looked at; a subdirectory
    without either file is said once and looked at again on later polls; symbolic links, files and
    updates not as their manifest lists (repository_format.check_update_files) are refused. Updates
    whose new step is not above the step served when it started are skipped (after a restart on a
    store updated by them). Every update applied, refused or skipped is one line of `log`."""

    def __init__(self, model: Model, directory: str, poll_seconds: float = 1.0, log: Callable[[str], None] = print,
                 allow_full_exports: bool = False):
        self.model, self.directory, self.poll_seconds, self.log = model, directory, poll_seconds, log
        self.allow_full_exports = allow_full_exports
        self._seen, self._unmarked = set(), set()
        self._start = model.version
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="updater", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.poll_seconds)

    def poll(self):
        """One pass over the directory: applies what is new and complete."""
        pending = []
        for entry in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []:
            path = os.path.join(self.directory, entry)
            if entry.startswith(".") or path in self._seen:
                continue
            if os.path.islink(path) or not os.path.isdir(path):
                self._seen.add(path)
                self._refuse(path, UpdateRefused("a symbolic link (updates are folders written by deploy.py and "
                                                 "renamed in)" if os.path.islink(path) else "not a folder"))
                continue
            marker = next((os.path.join(path, m) for m in (DELTA_INFO, EXPORT_INFO)
                           if os.path.isfile(os.path.join(path, m))), None)
            if marker is None:
                if path not in self._unmarked:
                    self._unmarked.add(path)
                    self.log(f"not yet an update {path}: no {DELTA_INFO} or {EXPORT_INFO} (deploy.py writes an "
                             "update elsewhere and renames it in); taken once one appears")
                continue
            self._seen.add(path)
            try:
                pending.append(self._read(path, marker))
            except Exception as e:   # whatever is wrong with it: refused, the server goes on
                self._refuse(path, e)
        for step, path, marker, written, update in sorted(pending, key=lambda p: p[:2]):
            if step <= self._start.step:
                self.log(f"skipped update {path}: its step {step} is not above {self._start}, served at start-up")
                continue
            start = time.monotonic()
            try:
                what = update()
            except Exception as e:
                self._refuse(path, e)
                continue
            now = time.monotonic()
            self.log(f"applied update {path} ({what}): serving {self.model.version}, in {now - start:.2f} s, "
                     f"{time.time() - written:.2f} s after its {os.path.basename(marker)} was written")

    def _read(self, path: str, marker: str) -> tuple:
        """(new step, path, marker, when it was written, a function that applies it and says what it was)."""
        written = os.path.getmtime(marker)
        if marker.endswith(DELTA_INFO):
            delta = read_delta(path)

            def apply_delta():
                rows = self.model.apply_delta(delta)
                return f"delta, {rows} rows in {len(delta.features)} tables"
            return delta.new.step, path, marker, written, apply_delta
        if not self.allow_full_exports:
            raise UpdateRefused("a full export, whose SavedModel would run in the server: taken only with "
                                "--updates_allow_full_exports")
        check_update_files(path, EXPORT_INFO, export_files(path, read_export_info(path)), RepositoryError)
        version = export_version(path)

        def replace():
            if version == self.model.version:
                raise UpdateRefused(f"it is the served version, {version}")
            self.model.replace(path)
            return "full export"
        return version.step, path, marker, written, replace

    def _refuse(self, path: str, error: Exception):
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        self.log(f"refused update {path}: {lines[0] if lines else type(error).__name__}")
