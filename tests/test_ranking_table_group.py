"""Several HybridEmbedding layers of one model (ranking.Features.embedding: a TableGroup) are
placed by one planner call over all their tables, made at the first use of one: each layer's
plan is its part of plan_tables over the layers' tables in order (placement and tiers under one
memory budget), cut by Plan.part; a layer made after that, and a budget too small for the layers,
are one line naming them."""
import pytest

from parallel_embedding.planner import BudgetError, Plan, TierOptions, plan_tables
from ranking import CategoricalFeature, Features
from ranking.embedding import TableStorage
from utils.errors import ConfigError

CARDS = [3000, 40, 2000]
STORAGE = TableStorage(100_000, 64, slots=2)   # a rank's 100 kB for both layers' tables and slots


def two_layers():
    """"wide" (width 1) then "deep" (width 4), a table per feature each, planned as one group."""
    features = Features([CategoricalFeature(n, c) for n, c in zip("abc", CARDS)], 3, storage=STORAGE)
    wide = features.embedding(features.feature_configs(1, prefix="wide_"), name="wide")
    deep = features.embedding(features.feature_configs(4), name="deep")
    return features, wide, deep


def joint_plan() -> Plan:
    """plan_tables over both layers' tables (wide's, then deep's) with the storage's tiers."""
    tiers = TierOptions(STORAGE.slots, STORAGE.budget_bytes, [2 * STORAGE.batch_rows] * 6)
    return plan_tables(CARDS * 2, [1] * 3 + [4] * 3, 1, tiers=tiers)


def test_the_layers_are_parts_of_one_plan_under_one_budget():
    features, wide, deep = two_layers()
    want = joint_plan()
    assert wide.embedding.plan == want.part(0, 3) and deep.embedding.plan == want.part(3, 3)
    # the budget's largest units go to disk whichever layer holds them: deep's tables 0 and 2, then wide's 0
    assert [(f, t.kind) for _, f, t in want.tiers] == [(0, "disk"), (3, "disk"), (5, "disk")]
    assert [f for _, f, _ in wide.embedding.plan.tiers] == [0]
    assert [f for _, f, _ in deep.embedding.plan.tiers] == [0, 2]


def test_a_part_of_a_plan_at_two_ranks_keeps_its_placement_renumbered():
    """Plan.part: the tables' kinds, shards and tiers, numbered from the part's first."""
    want = plan_tables(CARDS * 2, [1] * 3 + [4] * 3, 2, row_slice_threshold=2500, data_parallel_threshold=100)
    part = want.part(3, 3)
    assert [t.feature for t in part.tables] == [0, 1, 2]
    for got, table in zip(part.tables, want.tables[3:]):
        assert (got.kind, got.rows, got.dim) == (table.kind, table.rows, table.dim)
        assert [(s.feature + 3, s.rank, s.row_start, s.row_end, s.col_start, s.col_end) for s in got.shards] == \
            [(s.feature, s.rank, s.row_start, s.row_end, s.col_start, s.col_end) for s in table.shards]
    assert {t.kind for t in want.tables} == {"row", "replicated", "whole"}
    tiered = want.part(0, 0)
    assert tiered.tables == () and tiered.world_size == 2


def test_a_layer_made_after_the_plan_and_a_budget_too_small_are_one_line():
    features, wide, _ = two_layers()
    features.plan()
    with pytest.raises(ConfigError, match=r"^layer 'late': made after the tables of layer\(s\) 'wide', 'deep' were "
                                          r"planned \(at the first use of one\): make every HybridEmbedding of the "
                                          r"model before using any$"):
        features.embedding(features.feature_configs(2, prefix="late_"), name="late")
    small = Features([CategoricalFeature(n, c) for n, c in zip("abc", CARDS)], 3,
                     storage=TableStorage(60_000, 64, slots=2))
    small.embedding(small.feature_configs(1, prefix="wide_"), name="wide")
    small.embedding(small.feature_configs(4), name="deep")
    with pytest.raises(BudgetError, match=r"^layers 'wide', 'deep' \(their tables numbered across them in that "
                                          r"order\): rank 0: an embedding memory budget of 60000 bytes is too small"):
        small.plan()
