"""Routed hash shards: a dynamic table in S > 1 hash shards at N > 1 ranks sends each shard's
owner only the ids of its hash range and brings each id's row back only to the rank whose sample
it is (one table's traffic, not S [B, D] blocks; a multi-hot table's rows summed per sample by the
owner first, in batch order, so the sums are one process's). DistributedEmbedding (layer.py) owns
the tables and the all-to-alls of rows and gradients; a `Router` says what each carries for the
routed shards: it adds no all-to-all (data-parallel input: the ids ride in the ids' all-to-all;
model-parallel input: the samples go with the rows).

Shapes: `N` ranks, `b` local batch, `B = N b`; a routed table f, read by m_f inputs, D_f wide;
`K_s` the ids of hash shard s in the global batch (their order: global batch order, as one
process sees them), `c` the rows of one rank's samples in one shard (one an id, or for a multi-hot
table one a sample: its ids' rows summed); the wire order of a shard's ids and rows: rank by rank.

    router = Router(plan, collectives, inputs_per_table, data_parallel_input, name)
    router.features, router.on[r], router.shards      routed tables; rank r's routed shards; all, rank by rank
    routes, owned_ids = router.keep_own(flat)         model-parallel input, flat ids per feature
                                                      (ids.FlatIds, [m_f B]) -> `Routes`, per shard of
                                                      this rank its [K_s] ids; no all-to-all (the ids'
                                                      samples go with their rows)
    outgoing = router.outgoing_ids(flat)              data-parallel input ([m_f b] flat): per rank r the
                                                      int64 ids it gets of r's shards, which ride in the
                                                      data-parallel input exchange (layer.py)
    static, routes, owned_ids, checks = router.incoming_ids(received, lead, outgoing)   its output
    wire = router.to_wire(rows, routes)               per shard here [K_s, D] -> per rank r its flat [c, D]
    router.floats(r, routes, mine)                    floats of routed rows to/from rank r
    static, routed, checks = router.from_ranks(received, static_sizes, routes, mine)   an all-to-all's output
    router.combine(routed, routes, b)                 {f: [m_f b, D_f]}: each row summed at its sample
    router.gradients_to(r, feature_grads, routes)     flat gradients ([c, D] a shard) for rank r's shards
    router.owned_gradients(routed, routes)            {shard here: [K_s, D]} in global batch order
    hash_shards(ids, S)                               [n] int64 -> [n] int32: each id's hash shard
"""
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

from parallel_embedding.dynamic_table import mix, shift
from parallel_embedding.ids import FlatIds
from parallel_embedding.planner import Plan, Shard


def hash_shards(ids, shards: int) -> tf.Tensor:
    """ids [n] int64 -> [n] int32: the hash shard of each id among `shards` (< 2^31): h * shards
    // 2^64 of h, the id's 64 bits mixed by splitmix64's finaliser (id_map.reference.mix), so that
    shard s holds the s-th of `shards` equal ranges of hashes."""
    x = mix(tf.cast(ids, tf.int64))
    high, low = shift(x, 32), tf.bitwise.bitwise_and(x, 0xFFFFFFFF)
    return tf.cast(shift(high * shards + shift(low * shards, 32), 32), tf.int32)


class Owned(NamedTuple):
    """A routed hash shard of this rank, its owner's side: its K ids (from every rank) in global
    batch order, and the wire order in which their rows go to (and gradients come from) the ranks:
    rank by rank, each rank's ids as that rank sent them (data-parallel input) or in batch order."""
    order: tf.Tensor                   # [K] int32: each id's place in the wire order
    counts: tf.Tensor                  # [N] int32: its ids from (rows to) each rank; with `segments`
    #                                    its rows to each rank (one a sample)
    weights: Optional[tf.Tensor]       # [K] combiner weights applied here ("mean"), or None
    positions: Optional[tf.Tensor] = None   # [U] int32, wire order: each row's sample in its rank's [m b]
    #                                         output (model-parallel: sent with the rows), or None
    segments: Optional[tf.Tensor] = None    # [K] int32, wire order: each id's row among the U (multi-hot:
    #                                         its sample's ids' rows summed here), or None


class Sent(NamedTuple):
    """This rank's rows of one routed hash shard of the plan, in the wire order (the sample side):
    an id's, or a multi-hot table's sum of a sample's ids' rows in the shard."""
    positions: tf.Tensor               # [c] int32: each row's sample in this rank's [m b] output


class Outgoing(NamedTuple):
    """The routed tables' ids this rank sends with data-parallel input (`Router.outgoing_ids`)."""
    send: List[List[tf.Tensor]]        # per rank r, int64: per routed shard of r m_f counts, then per
    #                                    shard its ids (multi-hot: then as many samples and weights)
    sent: List[Sent]                   # per routed shard of the plan (`shards`, rank by rank)
    multi: Dict[int, bool]             # per routed table: multi-hot
    weighted: Dict[int, bool]          # per routed table: "mean" weights travel with its ids


class Routes(NamedTuple):
    """Where a routed table's ids went (`Router.keep_own`, `Router.incoming_ids`): read by the
    exchange and the gradients.
    With model-parallel input `sent` is filled by the rows' all-to-all (`from_ranks`), which
    brings each rank its ids' samples with their rows."""
    owned: List[Owned]                 # per routed shard of this rank (`on[rank]`)
    sent: List[Sent]                   # per routed shard of the plan (`shards`, rank by rank)


def assert_size(received: tf.Tensor, expected, what: str, exchange: str = "the data-parallel input exchange"):
    """Checks that an all-to-all delivered `expected` elements (None when run eagerly)."""
    return tf.debugging.assert_equal(tf.size(received, out_type=tf.int64), tf.cast(expected, tf.int64),
                                     message=f"{exchange} received a wrong number of {what}")


def split_by_source(received: tf.Tensor, headers: Sequence[int], per_count: Optional[Sequence[int]] = None,
                    lead=0):
    """An all-to-all's output whose part from rank n is `lead` elements, then `headers[n]` counts,
    then as many elements as they sum to (count k standing for `per_count[k]` elements each) -> per
    rank n (its [lead] elements, its counts [headers[n]], its elements), and the size that makes
    (the received size, if every rank sent what it counted)."""
    parts, start, lead = [], tf.constant(0, tf.int64), tf.cast(lead, tf.int64)
    for h in headers:
        counts = received[start + lead:start + lead + h]
        size = tf.reduce_sum(tf.cast(counts, tf.int64) * (1 if per_count is None else
                                                          tf.constant(per_count, tf.int64)))
        parts.append((received[start:start + lead], counts, received[start + lead + h:start + lead + h + size]))
        start = start + lead + h + size
    return parts, start


def _starts(major: tf.Tensor, minor: tf.Tensor) -> tf.Tensor:
    """[K] bool: where the (major, minor) pairs, equal ones adjacent, change (the first of each run)."""
    changed = tf.logical_or(tf.not_equal(major[1:], major[:-1]), tf.not_equal(minor[1:], minor[:-1]))
    return tf.concat([tf.ones_like(major[:1], tf.bool), changed], 0)


class Router:
    """The routed shards of `plan` (the dynamic tables in S > 1 hash shards, at N > 1 ranks) seen
    from rank `collectives.rank`. No all-to-all of its own: with data-parallel input the ids travel
    in the data-parallel input exchange (`outgoing_ids`, `incoming_ids`); with model-parallel input
    each owner holds its tables' global ids (`keep_own`), and the samples of the ids it keeps travel
    with their rows."""

    def __init__(self, plan: Plan, collectives, inputs_per_table: Sequence[int], data_parallel_input: bool,
                 name: str):
        self.plan, self.comm, self.name = plan, collectives, name
        self.rank, self.size = collectives.rank, collectives.size
        self.inputs_per_table, self.data_parallel_input = list(inputs_per_table), data_parallel_input
        self.features = {t.feature for t in plan.tables if t.kind == "dynamic" and len(t.shards) > 1} \
            if self.size > 1 else set()
        self.on = [[s for s in plan.shards_on(r) if s.feature in self.features] for r in range(self.size)]
        self.shards = [s for shards in self.on for s in shards]

    def outgoing_ids(self, flat: Dict[int, FlatIds]) -> "Outgoing":
        """Data-parallel input: the routed tables' local ids ([m_f b] flat per feature) -> what this
        rank sends each shard's owner in the data-parallel input exchange (after the static layout's
        ids, layer.py `_exchange_ids`): its ids of that owner's shards, input by input, after a
        count per input: to rank r, for each shard of r, m_f counts, then those shards' ids. The
        owner puts every shard's ids in global batch order, (input, rank, sample, place in the
        sample): the order in which one process holding the shard would see them, so its id map
        decides alike (`incoming_ids`).

        Example, N = 2, b = 3, m = 1, S = 2 (shard k on rank k): rank 0's ids a b c hash to shards
        1 0 1, rank 1's d e f to 0 0 1. Rank 0 sends [1 | b] to rank 0 and [2 | a c] to rank 1;
        rank 1 sends [2 | d e] to rank 0 and [1 | f] to rank 1 (each after its static ids for
        that rank). Rank 0 receives [1 b 2 d e] (the static ids aside): shard 0's ids b d e (wire
        order = global order, m being 1); by the rows' all-to-all it returns b's row to rank 0 and
        d's and e's to rank 1. Rank 0 adds the rows of a c from rank 1 at its samples 0 2, and b's
        at 1 (`Sent`).

        A multi-hot table's ids go with, each, its sample in the sender's [m_f b] and its "mean"
        weight (`_packed`: after the shard's ids, as many int64s), so that the owner sums a
        sample's ids' rows, weighted as one process weighs them (`segments`), and returns one row
        a sample and shard."""
        m = self.inputs_per_table
        multi = {f: flat[f].sample is not None for f in self.features}   # the same on every rank
        pieces, counts, sent = {}, {}, {}
        for f in sorted(self.features):
            x, shards = flat[f], self.plan.tables[f].shards
            samples = tf.range(tf.size(x.ids)) if x.sample is None else tf.cast(x.sample, tf.int32)
            b = tf.maximum((tf.size(x.ids) if x.sample is None else tf.cast(x.num_samples, tf.int32)) // m[f], 1)
            hashed = hash_shards(x.ids, len(shards))
            key = hashed * m[f] + samples // b   # (shard, input)
            order = tf.argsort(key, stable=True)
            per_input = tf.reshape(tf.math.unsorted_segment_sum(tf.ones_like(key), key, len(shards) * m[f]),
                                   [len(shards), m[f]])
            per_shard = tf.reduce_sum(per_input, axis=1)
            ids = tf.split(tf.gather(x.ids, order), per_shard, num=len(shards))
            if multi[f]:   # the ids with their samples and weights; a sample's rows come back summed
                packed = tf.split(tf.gather(self._packed(x, samples), order), per_shard, num=len(shards))
                ids = [tf.concat([i, p], 0) for i, p in zip(ids, packed)]
                hashed, samples = tf.gather(hashed, order), tf.gather(samples, order)
                first = _starts(hashed, samples)
                per_shard = tf.math.unsorted_segment_sum(tf.cast(first, tf.int32), hashed, len(shards))
                positions = tf.split(tf.boolean_mask(samples, first), per_shard, num=len(shards))
            else:
                positions = tf.split(tf.gather(samples, order), per_shard, num=len(shards))
            for k, s in enumerate(shards):
                pieces[s], counts[s], sent[s] = ids[k], per_input[k], Sent(positions[k])
        send = [[tf.cast(counts[s], tf.int64) for s in shards] + [tf.cast(pieces[s], tf.int64) for s in shards]
                for shards in self.on]
        return Outgoing(send, [sent[s] for s in self.shards], multi,
                        {f: flat[f].weights is not None for f in self.features})

    def incoming_ids(self, received: tf.Tensor, lead, outgoing: "Outgoing"):
        """The data-parallel input exchange's output: from each rank `lead` elements of the static
        layout, then (if the plan routes any table) its `outgoing_ids` part for this rank ->
        (the static elements, rank by rank; Routes; per routed shard of this rank its K ids in
        global batch order; checks of the amount received)."""
        n, m, multi = self.size, self.inputs_per_table, outgoing.multi
        if not self.shards:
            return received, None, [], [assert_size(received, n * lead, "ids")]
        mine = self.on[self.rank]
        header = sum(m[s.feature] for s in mine)
        per_count = [1 + multi[s.feature] for s in mine for _ in range(m[s.feature])]
        parts, end = split_by_source(received, [header] * n, per_count, lead)
        owned, owned_ids = [], []
        by_source = [tf.split(ids, [tf.reduce_sum(head[o:o + m[s.feature]]) * (1 + multi[s.feature])
                                    for s, o in self._offsets(mine)], num=len(mine)) if mine else []
                     for _, head, ids in parts]
        for t, (s, o) in enumerate(self._offsets(mine)):
            per_input = tf.cast(tf.stack([head[o:o + m[s.feature]] for _, head, _ in parts]), tf.int32)   # [N, m]
            starts = tf.reshape(tf.cumsum(tf.reshape(per_input, [-1]), exclusive=True), [n, m[s.feature]])
            # wire order: (rank, input); global order: (input, rank)
            order = tf.ragged.range(tf.reshape(tf.transpose(starts), [-1]),
                                    tf.reshape(tf.transpose(starts + per_input), [-1])).flat_values
            per_rank = tf.reduce_sum(per_input, axis=1)
            blocks = [ids[t] for ids in by_source]
            if not multi[s.feature]:
                owned.append(Owned(order, per_rank, None))
                owned_ids.append(tf.gather(tf.concat(blocks, 0), order))
                continue
            halves = [tf.split(x, 2) for x in blocks]   # per rank: its ids, then their samples and weights
            wire, packed = tf.concat([h[0] for h in halves], 0), tf.concat([h[1] for h in halves], 0)
            rank = tf.repeat(tf.range(n), per_rank)
            first = _starts(rank, tf.bitwise.bitwise_and(packed, 0xFFFFFFFF))
            weights = None
            if outgoing.weighted[s.feature]:   # "mean": the sender's weights, bit for bit
                weights = tf.gather(tf.bitcast(tf.cast(shift(packed, 32), tf.int32), tf.float32), order)
            owned.append(Owned(order, tf.math.unsorted_segment_sum(tf.cast(first, tf.int32), rank, n), weights,
                               None, tf.cumsum(tf.cast(first, tf.int32)) - 1))
            owned_ids.append(tf.gather(wire, order))
        return tf.concat([static for static, _, _ in parts], 0), Routes(owned, outgoing.sent), owned_ids, \
            [assert_size(received, end, "ids")]

    @staticmethod
    def _packed(x, samples: tf.Tensor) -> tf.Tensor:
        """A multi-hot feature's flat ids (ids.FlatIds) -> [K] int64: each id's sample (in [m b])
        in the low 32 bits, its combiner weight's float32 bits ("mean"; else 0) in the high ones."""
        if x.weights is None:
            return tf.cast(samples, tf.int64)
        weights = tf.bitwise.bitwise_and(tf.cast(tf.bitcast(x.weights, tf.int32), tf.int64), 0xFFFFFFFF)
        return tf.cast(samples, tf.int64) + weights * (1 << 32)

    def _offsets(self, shards: Sequence[Shard]):
        """(shard, where its m_f counts start in a header of m counts per shard) for `shards`."""
        offsets = np.cumsum([0] + [self.inputs_per_table[s.feature] for s in shards])
        return list(zip(shards, offsets[:-1].tolist()))

    def keep_own(self, flat: Dict[int, FlatIds]):
        """Model-parallel input, flat ids per feature ([m_f B]) -> (Routes, per routed shard of this
        rank its K ids in global batch order), with no all-to-all: each routed shard's owner, which
        holds its feature's global ids, keeps its own in global batch order, and for each the
        sample (in its rank's [m_f b] output) that its row goes to: they travel with the rows
        (`to_wire`). A multi-hot table's rows are summed per sample here first (`segments`): one
        row a sample and shard travels, its ids' rows added in batch order, as one process adds
        them."""
        n, m = self.size, self.inputs_per_table
        owned, owned_ids = [], []
        hashed = {s.feature: hash_shards(flat[s.feature].ids, len(self.plan.tables[s.feature].shards))
                  for s in self.on[self.rank]}   # once per table, whatever its shards here
        for s in self.on[self.rank]:
            x, shards = flat[s.feature], self.plan.tables[s.feature].shards
            samples = tf.range(tf.size(x.ids)) if x.sample is None else tf.cast(x.sample, tf.int32)
            big_b = tf.maximum((tf.size(x.ids) if x.sample is None else tf.cast(x.num_samples, tf.int32))
                               // m[s.feature], 1)
            b = tf.maximum(big_b // n, 1)
            own = tf.equal(hashed[s.feature], shards.index(s))
            samples = tf.boolean_mask(samples, own)
            rank = samples % big_b // b
            wire = tf.argsort(rank, stable=True)
            positions = tf.gather(samples // big_b * b + samples % big_b % b, wire)
            rank, segments = tf.gather(rank, wire), None
            if x.sample is not None:   # ids of one (rank, sample) are adjacent in the wire order
                first = _starts(rank, positions)
                segments = tf.cumsum(tf.cast(first, tf.int32)) - 1
                positions, rank = tf.boolean_mask(positions, first), tf.boolean_mask(rank, first)
            counts = tf.math.unsorted_segment_sum(tf.ones_like(rank), rank, n)
            owned.append(Owned(tf.math.invert_permutation(wire), counts,
                               None if x.weights is None else tf.boolean_mask(x.weights, own), positions, segments))
            owned_ids.append(tf.boolean_mask(x.ids, own))
        return Routes(owned, []), owned_ids

    def floats(self, r: int, routes: Optional[Routes], mine: bool):
        """Floats of routed rows between this rank and rank r: of this rank's routed shards to (or
        from) rank r (`mine`; model-parallel input: rows to r with their samples, after a count
        per shard), or of rank r's routed shards from (or to) this rank."""
        if mine:
            owned = list(zip(self.on[self.rank], routes.owned if routes else []))
            if self.data_parallel_input or not owned:
                return tf.add_n([tf.constant(0)] + [o.counts[r] * s.width for s, o in owned])
            # a count per shard, then per row its sample and its w floats
            return tf.add_n([tf.constant(len(owned))] + [o.counts[r] * (s.width + 1) for s, o in owned])
        sent = dict(zip(self.shards, routes.sent if routes else []))
        return tf.add_n([tf.constant(0)] + [tf.size(sent[s].positions) * s.width for s in self.on[r]])

    def to_wire(self, rows: Sequence[tf.Tensor], routes: Optional[Routes]) -> List[List[tf.Tensor]]:
        """This rank's routed shards' [K, w] rows in global batch order -> per rank, flat, each shard's
        [c, w] rows of that rank's samples in the wire order (a multi-hot table's summed per sample);
        model-parallel input: after a count per shard and each shard's c samples (int32 bit
        patterns as floats, `tf.bitcast`)."""
        n, owned = self.size, routes.owned if routes else []
        out = [[] for _ in range(n)]
        for x, o in zip(rows, owned):
            x = tf.gather(x, tf.math.invert_permutation(o.order))
            if o.segments is not None:   # a row a sample
                x = tf.math.unsorted_segment_sum(x, o.segments, tf.reduce_sum(o.counts))
            parts = tf.split(x, o.counts, num=n)
            for r in range(n):
                out[r].append(tf.reshape(parts[r], [-1]))
        if owned and not self.data_parallel_input:
            positions = [tf.split(tf.bitcast(o.positions, tf.float32), o.counts, num=n) for o in owned]
            counts = tf.bitcast(tf.stack([o.counts for o in owned], axis=1), tf.float32)   # [N, shards]
            out = [[counts[r]] + [p[r] for p in positions] + out[r] for r in range(n)]
        return out

    def from_ranks(self, received: tf.Tensor, static_sizes: Sequence, routes: Optional[Routes], mine: bool):
        """An all-to-all's output holding, per rank r, `static_sizes[r]` floats of the static layout,
        then routed rows: of rank r's routed shards (`mine` false: the rows of this rank's ids, per
        shard [c, w]) or of this rank's (`mine`: from rank r; per shard of this rank, its [K, w]
        rows from every rank, in global batch order) -> (the static floats, rank by rank; the
        routed rows per shard; checks of the amount received). Model-parallel input, not `mine`:
        the rows come with their samples, which fill `routes.sent`."""
        if not self.shards:
            return received, [], []
        if not mine and not self.data_parallel_input:
            return self._with_samples(received, static_sizes, routes)
        n, me = self.size, self.rank
        if mine:
            sizes = [[static_sizes[r]] + [o.counts[r] * s.width for s, o in zip(self.on[me], routes.owned)]
                     for r in range(n)]
        else:
            sent = dict(zip(self.shards, routes.sent))
            sizes = [[static_sizes[r]] + [tf.size(sent[s].positions) * s.width for s in self.on[r]]
                     for r in range(n)]
        parts = tf.split(received, tf.stack([tf.cast(x, tf.int32) for xs in sizes for x in xs]),
                         num=sum(len(xs) for xs in sizes))
        static, routed, k = [], [], 0
        for xs in sizes:
            static.append(parts[k])
            routed.append(parts[k + 1:k + len(xs)])
            k += len(xs)
        if mine:   # per shard of this rank: its rows from every rank (wire order) -> global batch order
            routed = [tf.reshape(tf.concat([of_rank[t] for of_rank in routed], 0), [-1, s.width])
                      for t, s in enumerate(self.on[me])]
            routed = [tf.gather(x if o.segments is None else tf.gather(x, o.segments), o.order)
                      for x, o in zip(routed, routes.owned)]
        else:
            routed = [tf.reshape(x, [-1, s.width]) for of_rank, shards in zip(routed, self.on)
                      for x, s in zip(of_rank, shards)]
        return tf.concat(static, 0), routed, []

    def _with_samples(self, received: tf.Tensor, static_sizes: Sequence, routes: Routes):
        """`from_ranks` of the rows' all-to-all with model-parallel input: from rank r, its static
        floats, then for its routed shards a count each, their samples, their rows (`to_wire`)."""
        static, routed, sent, start = [], [], [], tf.constant(0, tf.int64)
        for r, shards in enumerate(self.on):
            end = start + tf.cast(static_sizes[r], tf.int64)
            static.append(received[start:end])
            if not shards:
                start = end
                continue
            counts = tf.bitcast(received[end:end + len(shards)], tf.int32)
            start = end + len(shards)
            end = start + tf.reduce_sum(tf.cast(counts, tf.int64))
            sent += [Sent(p) for p in tf.split(tf.bitcast(received[start:end], tf.int32), counts,
                                                     num=len(shards))]
            floats = counts * tf.constant([s.width for s in shards])
            start = end + tf.reduce_sum(tf.cast(floats, tf.int64))
            routed += [tf.reshape(x, [-1, s.width]) for x, s in
                       zip(tf.split(received[end:start], floats, num=len(shards)), shards)]
        routes.sent[:] = sent
        return tf.concat(static, 0), routed, [assert_size(received, start, "routed rows", "the rows' all-to-all")]

    def combine(self, routed: Sequence[tf.Tensor], routes: Routes, b) -> Dict[int, tf.Tensor]:
        """`from_ranks`' routed rows of this rank's ids (per shard of the plan, [c, D_f]) -> per routed
        table f its [m_f b, D_f] rows: each row summed into its sample's, shard by shard (the
        order in which one process adds its hash shards' rows)."""
        out = {}
        for f in sorted(self.features):
            sent = sorted([(self.plan.tables[f].shards.index(s), rows, route)
                           for s, rows, route in zip(self.shards, routed, routes.sent) if s.feature == f],
                          key=lambda x: x[0])
            sent = [(rows, route) for _, rows, route in sent]
            out[f] = tf.math.unsorted_segment_sum(
                tf.concat([rows for rows, _ in sent], 0),
                tf.concat([r.positions for _, r in sent], 0), b * self.inputs_per_table[f])
        return out

    def gradients_to(self, r: int, feature_grads: Sequence[tf.Tensor], routes: Optional[Routes]) -> List[tf.Tensor]:
        """Per routed shard of rank r, flat: the gradients [c, w] of this rank's ids' rows (wire order)."""
        sent = dict(zip(self.shards, routes.sent if routes else []))
        out = []
        for s in self.on[r]:
            g = tf.gather(feature_grads[s.feature], sent[s].positions)
            out.append(tf.reshape(g, [-1]))
        return out

    def owned_gradients(self, routed: Sequence[tf.Tensor], routes: Optional[Routes]) -> Dict[Shard, tf.Tensor]:
        """`from_ranks`' routed gradients (`mine`) -> per routed shard of this rank its [K, w] in global
        batch order, the combiner's weights applied where the ids are (model-parallel "mean")."""
        return {s: g if owned.weights is None else g * owned.weights[:, None]
                for s, g, owned in zip(self.on[self.rank], routed, routes.owned if routes else [])}
