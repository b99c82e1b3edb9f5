"""The tables' state as checkpoints hold it (a part of `DistributedEmbedding`, layer.py): every
table, slot and updated_at as parts of world-size-independent tensors (`checkpoint_entries`,
`checkpoint_names`), a dynamic table's live rows re-hashed into another number of hash shards on
restore (`restoring`), the refusal of a table whose kind changed, and the variables by name."""
import contextlib
from typing import Dict, List, Set

import tensorflow as tf

from parallel_embedding import UPDATED_AT
from parallel_embedding.dynamic_table import IDS, resharded_entries, tensor_names
from parallel_embedding.routing import hash_shards
from parallel_embedding.tiered import DynamicUnit
from storage.checkpoint import Entry, replicated_entries
from utils.errors import ConfigError
from utils.logger import DYNAMIC_COUNTS


class TableState:
    """A part of DistributedEmbedding (layer.py): see the module's docstring."""

    def dynamic_stats(self) -> Dict[str, Dict[str, int]]:
        """Per dynamic table, by table name: its live rows and its admitted, evicted and refused
        ids since the start of its lineage (id_map's totals, checkpointed), summed over its hash
        shards on every rank (at N ranks a collective: every rank calls it at the same point)."""
        stats: Dict[str, Dict[str, int]] = {}
        for s, table in self.dynamic.items():
            total = stats.setdefault(self.table_name(s.feature), dict.fromkeys(DYNAMIC_COUNTS, 0))
            for k, v in table.counts().items():
                if k in total:
                    total[k] += v
        if self.size > 1 and any(t.kind == "dynamic" for t in self.plan.tables):
            merged: Dict[str, Dict[str, int]] = {}
            for part in self.comm.allgather_object(stats, f"{self.name}_dynamic_stats"):
                for name, counts in part.items():
                    total = merged.setdefault(name, dict.fromkeys(DYNAMIC_COUNTS, 0))
                    for k, v in counts.items():
                        total[k] += v
            stats = dict(sorted(merged.items()))
        return stats

    def variables_by_name(self) -> Dict[str, tf.Variable]:
        """This rank's table variables and table optimizer state, by stable variable name."""
        named = {v.name.split(":")[0]: v for v in self.variables_in_order + self.updated_at if v is not None}
        named.update(self.optimizer.variables_by_name() if self.optimizer else {})
        for table in self.dynamic.values():
            named.update({v.name.split(":")[0]: v for v in [table.updated_at] + list(table.slots.values())
                          if v is not None})
            named.update(table.optimizer.variables_by_name())
        return named

    def checkpoint_entries(self, weights_only: bool = False) -> List[Entry]:
        """This rank's tables as parts of world-size-independent tensors: tensor `table_name(f)` is
        feature f's whole table [rows_f, D_f]; shard s holds its rows [row_start, row_end) x columns
        [col_start, col_end) (not the spare row), a replicated table all of it (rank 0 saves it).
        Unless `weights_only`, the optimizer's state too: slot k of a table as tensor
        `table_name(f)/k`, cut as the table, the update counter (replicated), and the rows' updated_at
        [rows_f, 1] int32 as tensor `table_name(f)/updated_at`. A dynamic table's hash shard: its
        live rows only (DynamicTable.checkpoint_entries, under `dynamic_name(s)`, sized by the
        checkpoint on restore; inside `restoring`, a table saved in another number of hash shards:
        entries that read them all and re-hash their ids into this run's shards)."""
        slots = self.optimizer.slots if self.optimizer and not weights_only else {}
        entries = []
        sources = {}
        for unit in (self.tiered.units.values() if self.tiered else ()):
            if isinstance(unit, DynamicUnit):   # its DynamicTable's entries, below
                continue
            sources.update({v.ref(): parts for v, parts in zip(unit.variables, self.tiered.sources(unit))})
            if slots and any(s.feature == unit.feature and s.col_start == 0 for s in self.shards):
                entries.append(Entry(f"{self.table_name(unit.feature)}/{UPDATED_AT}",
                                     self.tiered.updated_at(unit, lambda: int(self._step.numpy())),
                                     (self.cardinalities[unit.feature], 1), unit.row_start))
        for s, table in self.dynamic.items():   # its live rows only (dynamic_table.py)
            if s.feature not in self._resharding:
                entries += table.checkpoint_entries(weights_only or not self.optimizer)
        for f, saved in self._resharding.items():
            entries += self._resharded_entries(f, saved, weights_only or not self.optimizer)
        for s, var, updated_at in zip(self.shards, self.shard_variables, self.updated_at):
            if s in self.dynamic:
                continue
            name, shape = self.table_name(s.feature), (self.cardinalities[s.feature], self.dims[s.feature])
            pieces = self._with_slots(name, var, slots)
            if var.ref() in sources:   # on disk: streamed from and to the store
                pieces = [(tensor, source) for (tensor, _), source in zip(pieces, sources[var.ref()])]
            entries += [Entry(tensor, v, shape, s.row_start, s.col_start, None if var.ref() in sources else s.num_rows)
                        for tensor, v in pieces]
            if slots and updated_at is not None:
                entries.append(Entry(f"{name}/{UPDATED_AT}", updated_at, (shape[0], 1), s.row_start, 0, s.num_rows))
        replicated = {tensor: v for f, var in zip(self.replicated, self.replicated_variables)
                      for tensor, v in self._with_slots(self.table_name(f), var, slots)}
        if self._counted(weights_only):
            replicated[self.optimizer.iterations.name.split(":")[0]] = self.optimizer.iterations
        if slots:
            replicated.update({f"{self.table_name(f)}/{UPDATED_AT}": v
                               for f, v in zip(self.replicated, self.updated_at[len(self.shards):])})
        return entries + replicated_entries(replicated)

    def _counted(self, weights_only: bool) -> bool:
        """Whether checkpoints hold the table optimizer's update counter: with the optimizer's state,
        when the plan has a table that is not dynamic (on any rank: the counter is replicated; each
        dynamic table counts its own updates)."""
        return bool(self.optimizer) and not weights_only and any(t.kind != "dynamic" for t in self.plan.tables)

    @staticmethod
    def _with_slots(name: str, var: tf.Variable, slots: dict) -> list:
        """(tensor name, variable) of a table variable and of its optimizer slots."""
        return [(name, var)] + [(f"{name}/{k}", slot) for k, slot in slots.get(var.ref(), {}).items()]

    def checkpoint_names(self, weights_only: bool = False) -> Set[str]:
        """Every tensor of `checkpoint_entries` on any rank: the logical tensors of the tables in a
        complete checkpoint."""
        tables = self.plan.tables
        names = {self.table_name(f) for f in range(len(tables)) if tables[f].kind != "dynamic"}
        if self.optimizer and not weights_only:
            names |= {f"{name}/{k}" for name in names for k in self.optimizer.slot_names + (UPDATED_AT,)}
        if self._counted(weights_only):
            names.add(self.optimizer.iterations.name.split(":")[0])
        slots = self.optimizer.slot_names if self.optimizer else ()
        for t in tables:
            prefixes = self._resharding.get(t.feature, [self.dynamic_name(s) for s in t.shards]) \
                if t.kind == "dynamic" else []
            for prefix in prefixes:
                names.update(tensor_names(prefix, t.dynamic.policy, slots, weights_only or not self.optimizer))
        return names

    def _resharded_entries(self, feature: int, saved: List[str], weights_only: bool) -> List[Entry]:
        """Restore-only entries of dynamic table `feature` saved in the hash shards `saved` (their
        tensor prefixes): every rank holding one of its shards reads them all (dynamic_table.reshard)."""
        t = self.plan.tables[feature]
        tables = {t.shards.index(s): table for s, table in self.dynamic.items() if s.feature == feature}
        if not tables:
            return []
        slots = list(next(iter(tables.values())).slots)
        name = self.table_name(feature)
        names = [n[len(name):].lstrip("/") for n in tensor_names(name, t.dynamic.policy, slots, weights_only)]
        return resharded_entries(name, saved, names, tables, [s.num_rows for s in t.shards],
                                 lambda ids: hash_shards(ids, len(t.shards)).numpy())

    @contextlib.contextmanager
    def restoring(self, tensors: Dict[str, dict]):
        """The block that restores a checkpoint whose manifest's "tensors" are `tensors`: checks them
        (check_checkpoint), and within the block `checkpoint_entries` and `checkpoint_names` take a
        dynamic table saved in another number of hash shards in the checkpoint's shards (their ids
        re-hashed into this run's on restore: dynamic_table.reshard says what is kept exactly)."""
        self.check_checkpoint(tensors)
        self._resharding = {}
        for t in self.plan.tables:
            saved = self._saved_shards(t.feature, tensors)
            if t.kind == "dynamic" and saved and len(saved) != len(t.shards):
                self._resharding[t.feature] = saved
        try:
            yield self
        finally:
            self._resharding = {}

    def _saved_shards(self, feature: int, tensors: Dict[str, dict]) -> List[str]:
        """The tensor prefixes of a table's dynamic hash shards in a checkpoint (by shard; [] if it
        holds the table static): the table's name, or `<table>/shard_<k>` for k < P."""
        name = self.table_name(feature)
        saved = [n[:-len(IDS) - 1] for n in tensors if n.startswith(f"{name}/") and n.endswith(f"/{IDS}")]
        return sorted(saved, key=lambda prefix: int(prefix.rsplit("_", 1)[1]) if prefix != name else -1)

    def check_checkpoint(self, tensors: Dict[str, dict]):
        """Raises ConfigError, one line naming the table, where a checkpoint's tensors (its manifest's
        "tensors") hold a dynamic table as static or the reverse (a dynamic table checkpoints its ids)."""
        for t in self.plan.tables:
            name = self.table_name(t.feature)
            saved = self._saved_shards(t.feature, tensors)
            if (name in tensors or saved) and bool(saved) != (t.kind == "dynamic"):
                raise ConfigError(
                    f"table {name} (feature {t.feature}) is {'dynamic' if t.kind == 'dynamic' else 'static'} in this "
                    f"run, {'dynamic' if saved else 'static'} in the checkpoint: a table's kind cannot change "
                    "across a restore (--dynamic_tables)")
