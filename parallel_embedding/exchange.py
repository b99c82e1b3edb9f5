"""The all-to-alls of `DistributedEmbedding` (layer.py), forward and backward: the ids of
data-parallel input to the ranks holding their tables (`_exchange_ids`), the looked-up rows to the
ranks whose samples they are (`exchange`), and their gradients back (`gradients`). `Exchange` is
a part of DistributedEmbedding, on its state (plan, collectives, router, the static layout of
which shard's rows go where: `_features_of`, `_static_on`, `_pieces`, `_all_shards`).

Shapes: N ranks, b local batch, B = N b, m_f inputs of table f, w a shard's width."""
from typing import Dict, List, NamedTuple, Optional, Sequence

import tensorflow as tf

from parallel_embedding.ids import FlatIds, flatten_ids, num_samples, spread
from parallel_embedding.planner import Shard
from parallel_embedding.routing import Routes, assert_size


class Jagged(NamedTuple):
    """Which rows of the multi-hot inputs hold ids, with data-parallel input at N > 1 ranks: only
    those rows travel in the exchange and its reverse (the others are zeros, their gradients unused)."""
    local: Dict[int, tf.Tensor]   # per multi-hot feature of any rank's static shards: [m_f b] bool, this rank's rows
    owned: Dict[int, tf.Tensor]   # per multi-hot feature of this rank's static shards: [N] int32, each rank's count


class LookedUp(NamedTuple):
    """What `lookup` returns: rows and the variable indices they came from (for gradients)."""
    shard_rows: List[tf.Tensor]        # per local shard: [m B, w] (a routed shard: [K, w], its ids'; a
                                       # jagged one: the rows that hold ids, rank by rank, `_exchange_ids`)
    shard_indices: List[tf.Tensor]     # per local shard: [K] row indices into its variable
    shard_ids: List[FlatIds]           # per local shard: its feature's ids (a routed shard: its rows)
    replicated_rows: List[tf.Tensor]   # per replicated table: [b, D_f]
    replicated_ids: List[FlatIds]      # per replicated table: its feature's ids
    routes: Optional[Routes] = None    # the routed shards' (None: the plan has none at this world size)
    jagged: Optional[Jagged] = None    # data-parallel input at N > 1 ranks (None: every row travels)


class Exchange:
    """A part of DistributedEmbedding (layer.py): see the module's docstring."""

    def _exchange_ids(self, ids: List[tf.Tensor]):
        """Data-parallel input: every rank's b rows of ids -> (the features this rank holds: a
        one-hot one's B rows, a multi-hot one's rows that hold ids, rank by rank (`Jagged`); the
        routed tables' Routes (None if the plan routes none) and, per routed shard of this rank,
        its ids (routing.py); checks of the amounts received, which the lookup must wait for; per
        multi-hot feature held here, each rank's count of rows that hold ids, [N] int32).
        One all-to-all carries the one-hot ids ([b] each) and, per multi-hot feature, two counts
        (its rows that hold ids, its ids), and after them, to each rank, this rank's ids of the
        routed shards there (`Router.outgoing_ids`: a count per shard and input, then the ids; the
        message int64 then); a second one (only if a feature exchanged here is multi-hot) each
        multi-hot feature's lengths of the rows that hold ids, then its ids. Every rank takes part
        in both, even one that receives nothing; the checks consume every result, so graph
        optimisation never prunes an all-to-all on one rank (the others would wait forever).

        Example, N = 2, b = 2: rank 0 holds feature 0 (one-hot), rank 1 features 1 and 2
        (multi-hot). Global rows 0-1 are rank 0's input, rows 2-3 rank 1's:
            f0: a0 a1 | a2 a3      f1: [p] [q r] | [] [s]      f2: [t u] [] | [v] [w x]
        First all-to-all, each rank sends, per destination rank r, its b ids of every one-hot
        feature of r and two counts of every multi-hot one: rank 0 sends [a0 a1 | 2 3 1 2]
        (counts [2, 4]), rank 1 [a2 a3 | 1 1 2 3]. Rank 1 receives [2 3 1 2 | 1 1 2 3]: per source
        rank and feature, (rows that hold ids, ids). Second all-to-all, per multi-hot feature the
        held rows' lengths, then the ids: rank 0 sends [] to rank 0 and [1 2 p q r | 2 t u] to
        rank 1, rank 1 [1 s | 1 2 v w x] to itself. Rank 1 splits what it receives by those
        counts: f1 = [p] [q r] | [s] (held rows per rank [2 1]), f2 = [t u] | [v] [w x] ([1 2]).
        A table of m inputs (`inputs_per_table`) counts as m features for its one-hot ids, its ids
        [m b] the m inputs' b rows each; it gets their B rows each, concatenated input by input (a
        multi-hot table's rows that hold ids: each rank's in its (input, row) order)."""
        ragged = [isinstance(i, tf.RaggedTensor) for i in ids]
        dtype = tf.int64 if any((i.values if r else i).dtype == tf.int64 for i, r in zip(ids, ragged)) else tf.int32
        m, n = self.inputs_per_table, self.size
        b = num_samples(ids[0]) // m[0]
        features = [f for f in self.global_features if f not in self.router.features]

        def size(f):   # elements of feature f in the first message, from each rank
            return 2 if ragged[f] else m[f] * b

        def first(f):
            if not ragged[f]:
                return ids[f]
            return tf.stack([tf.reduce_sum(tf.cast(ids[f].row_lengths() > 0, tf.int32)), tf.size(ids[f].values)])

        routed = self.router.outgoing_ids({f: flatten_ids(ids[f], self.combiners[f]) for f in self.router.features})
        wire = tf.int64 if self.router.shards else dtype   # the routed ids: int64
        send = [tf.cast(x, wire) for r in range(n) for x in [first(f) for f in self._features_of[r]] + routed.send[r]]
        counts = tf.stack([tf.add_n([0] + [size(f) for f in self._features_of[r]]) +
                           sum(tf.size(x) for x in routed.send[r]) for r in range(n)])
        received = self.comm.alltoall(tf.concat(send, 0) if send else tf.zeros([0], wire), counts,
                                      f"{self.name}_ids")
        lead = tf.add_n([0] + [size(f) for f in features])
        received, routes, owned_ids, checks = self.router.incoming_ids(received, lead, routed)
        parts = tf.split(tf.reshape(tf.cast(received, dtype), [n, -1]), tf.stack([size(f) for f in features]),
                         num=len(features), axis=1) if features else []
        out, held, multi = list(ids), {}, []
        for f, x in zip(features, parts):
            if ragged[f]:
                multi.append((f, tf.cast(x, tf.int32)))   # [N, 2]: held rows, ids
            else:   # [N, m b] (rank, input, row) -> [m B] (input, rank, row)
                out[f] = tf.reshape(tf.transpose(tf.reshape(x, [n, m[f], -1]), [1, 0, 2]), [-1])
        if any(ragged[f] for fs in self._features_of for f in fs):
            values = [[tf.concat([tf.cast(tf.boolean_mask(ids[f].row_lengths(), ids[f].row_lengths() > 0), dtype),
                                  tf.cast(ids[f].values, dtype)], 0) for f in self._features_of[r] if ragged[f]]
                      for r in range(n)]
            received = self.comm.alltoall(
                tf.concat(sum(values, []), 0) if any(values) else tf.zeros([0], dtype),
                tf.stack([tf.add_n([tf.size(v) for v in vs]) if vs else 0 for vs in values]),
                f"{self.name}_multi_hot_ids")
            sizes = tf.stack([tf.reduce_sum(x, axis=1) for _, x in multi], axis=1) if multi else tf.zeros([n, 0],
                                                                                                         tf.int32)
            checks.append(assert_size(received, tf.reduce_sum(sizes), "multi-hot ids"))
            if multi:   # received in (source rank, feature) order: the held rows' lengths, then the ids
                blocks = tf.split(received, tf.reshape(sizes, [-1]), num=n * len(multi))
                for k, (f, x) in enumerate(multi):
                    pieces = [tf.split(blocks[r * len(multi) + k], x[r], num=2) for r in range(n)]
                    out[f] = tf.RaggedTensor.from_row_lengths(tf.concat([p[1] for p in pieces], 0),
                                                              tf.concat([p[0] for p in pieces], 0))
                    held[f] = x[:, 0]
        return out, routes, owned_ids, [c for c in checks if c is not None], held

    def exchange(self, looked_up: LookedUp, local_batch) -> List[tf.Tensor]:
        """This rank's rows -> the F features of the local batch (`local_batch` = b rows, [b, D_f])."""
        out = [None] * len(self.plan.tables)
        for f, rows in zip(self.replicated, looked_up.replicated_rows):
            out[f] = rows
        if self.size == 1:   # every table on this rank, in feature order (a dynamic table's hash shards summed)
            for s, rows in zip(self.shards, looked_up.shard_rows):
                out[s.feature] = rows if out[s.feature] is None else out[s.feature] + rows
            return out
        if not any(self._widths) and not self.router.shards:
            return out
        b, m, jagged = local_batch, self.inputs_per_table, looked_up.jagged
        # To each rank r: each static shard's rows of r's m x b rows, in (input, row) order (jagged:
        # only those that hold ids), then the rows of r's ids in the routed shards here (wire order).
        static = [[] for _ in range(self.size)]
        for s, rows in zip(self.shards, looked_up.shard_rows):
            if s.feature not in self.router.features:
                for r, x in enumerate(self._split_by_rank(rows, s, m[s.feature], jagged)):
                    static[r].append(x)
        routed = self.router.to_wire([looked_up.shard_rows[self.shards.index(s)] for s in self.router.on[self.rank]],
                                     looked_up.routes)
        sizes = [[self._rows_of(s.feature, b, jagged) * s.width for s in shards] for shards in self._static_on]
        received = self.comm.alltoall(
            tf.concat([x for r in range(self.size) for x in static[r] + routed[r]] or [tf.zeros([0])], 0),
            tf.stack([tf.add_n([tf.size(x) for x in static[r]] + [self.router.floats(r, looked_up.routes, mine=True)])
                      for r in range(self.size)]), f"{self.name}_rows")
        received, routed, checks = self.router.from_ranks(received, [tf.add_n([0] + xs) for xs in sizes],
                                                          looked_up.routes, mine=False)
        if checks:
            with tf.control_dependencies(checks):
                received, routed = tf.identity(received), [tf.identity(x) for x in routed]
        pieces = tf.split(received, tf.stack([x for xs in sizes for x in xs]),
                          num=len(self._all_shards)) if self._all_shards else []
        for f, parts in self._pieces.items():
            if parts:
                parts = [tf.reshape(pieces[k], [-1, s.width]) for k, s in parts]
                if jagged and f in jagged.local:   # the rows that hold ids, back in their places
                    where = tf.cast(tf.where(jagged.local[f]), tf.int32)
                    parts = [tf.scatter_nd(where, x, [m[f] * b, x.shape[1]]) for x in parts]
                out[f] = tf.add_n(parts) if self.plan.tables[f].kind in ("row", "dynamic") else tf.concat(parts, axis=1)
        if self.router.shards:   # each id's row summed into its sample's
            for f, rows in self.router.combine(routed, looked_up.routes, b).items():
                out[f] = rows
        return out

    def _by_rank(self, rows: tf.Tensor, m: int) -> tf.Tensor:
        """[m B, w] rows in (input, rank, row) order -> [N, m b w] in (rank, input, row) order."""
        return tf.reshape(tf.transpose(tf.reshape(rows, [m, self.size, -1]), [1, 0, 2]), [self.size, -1])

    def _split_by_rank(self, rows: tf.Tensor, s: Shard, m: int, jagged: Optional[Jagged]) -> List[tf.Tensor]:
        """Shard s's [m B, w] rows (input, rank, row) -> per rank r, flat, r's m x b rows in (input,
        row) order: those that hold ids if the feature is jagged, else all of them."""
        if not jagged or s.feature not in jagged.owned:
            return tf.unstack(self._by_rank(rows, m), num=self.size)
        return tf.split(tf.reshape(rows, [-1]), jagged.owned[s.feature] * s.width, num=self.size)   # rank by rank

    def _rows_of(self, feature: int, b, jagged: Optional[Jagged], rank: Optional[int] = None):
        """How many of a rank's m_f x b rows of `feature` travel: this rank's (`rank` None) or, on
        the feature's owner, rank `rank`'s."""
        if not jagged or feature not in jagged.local:
            return self.inputs_per_table[feature] * b
        if rank is None:
            return tf.reduce_sum(tf.cast(jagged.local[feature], tf.int32))
        return jagged.owned[feature][rank]

    def gradients(self, looked_up: LookedUp, feature_grads: Sequence[tf.Tensor]) -> List[tf.IndexedSlices]:
        """Gradients of the F features ([b, D_f]) -> IndexedSlices for `variables_in_order`."""
        shard_grads = self._reverse_exchange(feature_grads, looked_up.routes, looked_up.jagged)
        grads = [tf.IndexedSlices(spread(g, flat), i, tf.shape(v, out_type=i.dtype))
                 for g, i, flat, v in zip(shard_grads, looked_up.shard_indices, looked_up.shard_ids,
                                          self.shard_variables)]
        for f, flat, var in zip(self.replicated, looked_up.replicated_ids, self.replicated_variables):
            g, ids = spread(feature_grads[f], flat), flat.ids
            if self.size > 1:   # every rank applies the whole batch's rows
                g = self.comm.allgather(g, f"{self.name}_replicated_{f}_grad")
                ids = self.comm.allgather(ids, f"{self.name}_replicated_{f}_ids")
            grads.append(tf.IndexedSlices(g, ids, tf.shape(var, out_type=ids.dtype)))
        return grads

    def _reverse_exchange(self, feature_grads, routes: Optional[Routes], jagged: Optional[Jagged]) -> List[tf.Tensor]:
        """[b, D_f] per feature -> [B, w] per local shard (a routed shard: [K, w], the gradients of
        its ids' rows in global batch order) (the reverse all-to-all)."""
        if self.size == 1:
            return [feature_grads[s.feature] for s in self.shards]
        if not any(self._widths) and not self.router.shards:
            return []
        m = self.inputs_per_table
        b = tf.shape(feature_grads[0])[0] // m[0]
        send, counts = [], []
        for r in range(self.size):   # to rank r: its static shards' [m b, w] (jagged: the rows that hold ids), then
            static = []              # its routed shards' [c, w]
            for s in self._static_on[r]:
                g = feature_grads[s.feature][:, s.col_start:s.col_end]
                if jagged and s.feature in jagged.local:
                    g = tf.boolean_mask(g, jagged.local[s.feature])
                static.append(tf.reshape(g, [-1]))
            send += static + self.router.gradients_to(r, feature_grads, routes)
            counts.append(tf.add_n([tf.size(x) for x in static] + [self.router.floats(r, routes, mine=False)]))
        received = self.comm.alltoall(tf.concat(send, axis=0) if send else tf.zeros([0]), tf.stack(counts),
                                      f"{self.name}_grads")
        static = self._static_on[self.rank]
        sizes = [[self._rows_of(s.feature, b, jagged, r) * s.width for s in static] for r in range(self.size)]
        received, routed, _ = self.router.from_ranks(received, [tf.add_n([0] + xs) for xs in sizes], routes,
                                                     mine=True)
        out = {}
        if static:   # per rank, my shards' rows in a row -> per shard [N, m b, w] (rank, input, row)
            blocks = tf.split(received, tf.stack([x for xs in sizes for x in xs]), num=self.size * len(static))
            for t, s in enumerate(static):
                x = tf.reshape(tf.concat(blocks[t::len(static)], 0), [-1, s.width])
                if not jagged or s.feature not in jagged.owned:   # jagged: the rows as lookup gave them
                    # [N, m b, w] (rank, input, row) -> [m B, w] (input, rank, row)
                    x = tf.reshape(tf.transpose(tf.reshape(x, [self.size, m[s.feature], -1]), [1, 0, 2]),
                                   [-1, s.width])
                out[s] = x
        out.update(self.router.owned_gradients(routed, routes))
        return [out[s] for s in self.shards]
