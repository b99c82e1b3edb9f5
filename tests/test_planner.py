"""The embedding-table planner: placements worked out by hand, and invariants over random configurations."""
import random
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_embedding.planner import STRATEGIES, Plan, PlanError, Shard, plan_tables


def owners(plan: Plan):
    """feature -> the ranks of its shards, in the table's shard order."""
    return {t.feature: [s.rank for s in t.shards] for t in plan.tables}


def cols(plan: Plan, feature: int):
    return [(s.col_start, s.col_end) for s in plan.tables[feature].shards]


def loads(plan: Plan):
    return [sum(s.elements for s in plan.shards_on(r)) for r in range(plan.world_size)]


def random_configs(count, seed=1234):
    """Random small configurations (cells can be enumerated) for every strategy and world size 1..8."""
    rng = random.Random(seed)
    for _ in range(count):
        n_tables = rng.randint(1, 10)
        rows = [rng.choice([1, 2, 3, rng.randint(1, 60)]) for _ in range(n_tables)]
        dims = [rng.choice([1, 2, 3, 4, 8, rng.randint(1, 20)]) for _ in range(n_tables)]
        yield dict(rows=rows, dims=dims, world_size=rng.randint(1, 8), strategy=rng.choice(STRATEGIES),
                   column_slice_threshold=rng.choice([None, rng.randint(1, 400)]),
                   row_slice_threshold=rng.choice([None, rng.randint(1, 400)]),
                   data_parallel_threshold=rng.choice([None, rng.randint(0, 100)]))


# Hand-worked placements ---------------------------------------------------------------------------

def test_basic_is_round_robin_in_feature_order():
    plan = plan_tables([100, 200, 300, 400, 500], [8] * 5, 2, "basic")
    assert owners(plan) == {0: [0], 1: [1], 2: [0], 3: [1], 4: [0]}
    assert all(t.kind == "whole" for t in plan.tables)


def test_memory_balanced_deals_largest_first_in_snake_order():
    # elements 10, 70, 20, 60, 30, 50, 40 -> order f1 f3 f5 f6 f4 f2 f0 dealt to ranks 0 1 2 2 1 0 0
    plan = plan_tables([10, 70, 20, 60, 30, 50, 40], [1] * 7, 3, "memory_balanced")
    assert owners(plan) == {0: [0], 1: [0], 2: [0], 3: [1], 4: [1], 5: [2], 6: [2]}
    assert loads(plan) == [100, 90, 90]


def test_memory_optimized_fills_the_least_loaded_rank():
    # f1 70 -> r0; f3 60 -> r1; f5 50 -> r2; f6 40 -> r2 (90); f4 30 -> r1 (90); f2 20 -> r0 (90);
    # f0 10 -> r0 (all at 90: lowest rank)
    plan = plan_tables([10, 70, 20, 60, 30, 50, 40], [1] * 7, 3, "memory_optimized")
    assert owners(plan) == {0: [0], 1: [0], 2: [0], 3: [1], 4: [1], 5: [2], 6: [2]}
    assert loads(plan) == [100, 90, 90]


@pytest.mark.parametrize("strategy,expected", [
    ("basic", {0: [0], 1: [1], 2: [2, 0]}),             # pieces f0 f1 f2.0 f2.1 -> 0 1 2 0
    ("memory_balanced", {0: [0], 1: [1], 2: [2, 2]}),   # same order by size -> snake 0 1 2 2
    # f2.1 would go to rank 2 (least loaded), which holds f2.0: rank 0 (lowest of the others) instead
    ("memory_optimized", {0: [0], 1: [1], 2: [2, 0]}),
])
def test_each_strategy_places_column_slices(strategy, expected):
    # f2 (10 x 2 = 20 elements > 10) is cut in two 10-element column slices; f0, f1 (dim 1) cannot be cut.
    plan = plan_tables([100, 100, 10], [1, 1, 2], 3, strategy, column_slice_threshold=10)
    assert [t.kind for t in plan.tables] == ["whole", "whole", "column"]
    assert cols(plan, 2) == [(0, 1), (1, 2)]
    assert owners(plan) == expected


def test_memory_optimized_counts_row_shards_in_the_loads():
    # f0 is row-sliced 3334/3333/3333 x 8 over three ranks; f1's two slices go to the lighter ranks 1 and 2.
    plan = plan_tables([10_000, 100], [8, 16], 3, "memory_optimized", row_slice_threshold=2000)
    assert plan.tables[0].kind == "row"
    assert [(s.row_start, s.row_end) for s in plan.tables[0].shards] == [(0, 3334), (3334, 6667), (6667, 10_000)]
    assert cols(plan, 1) == [(0, 8), (8, 16)]
    assert owners(plan)[1] == [1, 2]


def test_uneven_three_ranks_one_huge_table():
    # Two tables on three ranks: the huge one is halved (four slices would pass the 2^k <= 3 cap).
    for strategy in STRATEGIES:
        plan = plan_tables([1_000_000, 100], [64, 16], 3, strategy)
        assert [t.kind for t in plan.tables] == ["column", "whole"]
        assert cols(plan, 0) == [(0, 32), (32, 64)]
        assert owners(plan) == {0: [0, 1], 1: [2]}
        assert loads(plan) == [32_000_000, 32_000_000, 1600]


# Slicing rules ------------------------------------------------------------------------------------

def test_one_rank_holds_every_table_whole():
    for strategy in STRATEGIES:
        plan = plan_tables([5, 1000, 7], [4, 16, 64], 1, strategy, column_slice_threshold=1,
                           row_slice_threshold=1, data_parallel_threshold=10 ** 9)
        assert plan.strategy == strategy and plan.replicated == []
        assert [t.kind for t in plan.tables] == ["whole"] * 3
        assert plan.shards_on(0) == [Shard(0, 0, 0, 5, 0, 4), Shard(1, 0, 0, 1000, 0, 16), Shard(2, 0, 0, 7, 0, 64)]


def test_data_parallel_threshold_replicates_small_tables():
    plan = plan_tables([10, 11, 1000, 3], [4, 4, 8, 2], 2, data_parallel_threshold=40, row_slice_threshold=1)
    assert [t.kind for t in plan.tables] == ["replicated", "row", "row", "replicated"]   # 40 <= 40 < 44
    assert plan.replicated == [0, 3]
    assert plan.tables[0].shards == ()
    assert all(f not in plan.features_on(r) for f in (0, 3) for r in range(2))
    assert plan_tables([1, 1], [1, 1], 2, data_parallel_threshold=0).replicated == []


@pytest.mark.parametrize("rows,world_size,expected", [
    (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (9, 3, [(0, 3), (3, 6), (6, 9)]),
])
def test_row_slices_are_near_equal_contiguous_and_in_rank_order(rows, world_size, expected):
    plan = plan_tables([rows], [5], world_size, row_slice_threshold=1)
    table = plan.tables[0]
    assert table.kind == "row"
    assert [(s.rank, s.row_start, s.row_end, s.col_start, s.col_end) for s in table.shards] == \
        [(r, a, b, 0, 5) for r, (a, b) in enumerate(expected)]


def test_row_slicing_needs_more_elements_than_the_threshold_and_rows_for_every_rank():
    # 3 rows < 4 ranks; 200 is not > 200; 300 > 200; 32 <= 200 (four tables left: no automatic slicing)
    kinds = [t.kind for t in plan_tables([3, 100, 100, 8, 1], [64, 2, 3, 4, 1], 4, row_slice_threshold=200).tables]
    assert kinds == ["whole", "whole", "row", "whole", "whole"]


@pytest.mark.parametrize("rows,dim,threshold,widths", [
    (10, 16, 50, [4, 4, 4, 4]),    # 160 > 50, 80 > 50, 40 <= 50
    (10, 5, 30, [3, 2]),           # 50 > 30, 10 * ceil(5 / 2) = 30 <= 30; the wider slice first
    (10, 16, 160, [16]),           # not above the threshold: whole
    (10, 16, 1, [2] * 8),          # capped at 2^k <= 8 ranks
    (10, 3, 1, [2, 1]),            # capped at 2^k <= dim (and a power of two: not 3)
    (10, 6, 1, [2, 2, 1, 1]),
])
def test_column_slice_threshold(rows, dim, threshold, widths):
    # Eight tables on eight ranks: no automatic slicing.
    plan = plan_tables([rows] + [1] * 7, [dim] + [1] * 7, 8, column_slice_threshold=threshold)
    assert [b - a for a, b in cols(plan, 0)] == widths
    assert plan.tables[0].kind == ("whole" if len(widths) == 1 else "column")
    assert [t.kind for t in plan.tables[1:]] == ["whole"] * 7


def test_column_slices_are_capped_by_world_size():
    plan = plan_tables([10, 10], [16, 16], 2, column_slice_threshold=1)
    assert [len(t.shards) for t in plan.tables] == [2, 2]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_automatic_slicing_spreads_one_table_over_every_rank(strategy):
    plan = plan_tables([1000], [16], 4, strategy)
    assert plan.tables[0].kind == "column"
    assert cols(plan, 0) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert sorted(owners(plan)[0]) == [0, 1, 2, 3]
    assert [len(plan.shards_on(r)) for r in range(4)] == [1, 1, 1, 1]


def test_automatic_slicing_stops_at_the_caps():
    assert cols(plan_tables([1000], [2], 4), 0) == [(0, 1), (1, 2)]               # dim 2
    assert cols(plan_tables([1000], [16], 3), 0) == [(0, 8), (8, 16)]             # 2^k <= 3
    assert len(plan_tables([1000], [16], 8, column_slice_threshold=8000).tables[0].shards) == 8


def test_automatic_slicing_doubles_the_table_with_the_largest_slice():
    # f0 800 -> 2 x 400; then f1 480 > 400 -> 2 x 240: four pieces.
    assert [len(t.shards) for t in plan_tables([100, 60], [8, 8], 4).tables] == [2, 2]
    # f0 800 -> 2 x 400; then f0 400 ties f1 400: the lower feature -> 4 x 200 (five pieces).
    assert [len(t.shards) for t in plan_tables([100, 50], [8, 8], 4).tables] == [4, 1]
    # As many tables as ranks: none is cut.
    assert [t.kind for t in plan_tables([100, 1, 1, 1], [8, 8, 8, 8], 4).tables] == ["whole"] * 4


def test_automatic_slicing_counts_only_tables_left_after_replication_and_row_slicing():
    plan = plan_tables([2, 1000, 10], [2, 4, 16], 4, row_slice_threshold=1000, data_parallel_threshold=4)
    assert [t.kind for t in plan.tables] == ["replicated", "row", "column"]
    assert cols(plan, 2) == [(0, 4), (4, 8), (8, 12), (12, 16)]


# Invariants over random configurations -----------------------------------------------------------

def test_every_table_is_tiled_exactly_once_by_its_shards():
    for config in random_configs(600):
        plan = plan_tables(**config)
        n = config["world_size"]
        assert plan.world_size == n and [t.feature for t in plan.tables] == list(range(len(config["rows"])))
        for t, rows, dim in zip(plan.tables, config["rows"], config["dims"]):
            assert (t.rows, t.dim) == (rows, dim)
            if t.kind == "replicated":
                assert t.shards == () and n > 1
                continue
            cells = [(i, j) for s in t.shards for i in range(s.row_start, s.row_end)
                     for j in range(s.col_start, s.col_end)]
            assert sorted(cells) == [(i, j) for i in range(rows) for j in range(dim)], (config, t)
            assert all(s.feature == t.feature and 0 <= s.rank < n and s.elements > 0 for s in t.shards)
            if t.kind == "whole":
                assert len(t.shards) == 1
            elif t.kind == "row":
                assert rows >= n > 1 and [s.rank for s in t.shards] == list(range(n))
                assert [s.row_start for s in t.shards] == sorted(s.row_start for s in t.shards)
                sizes = [s.num_rows for s in t.shards]
                assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
            else:
                count = len(t.shards)
                assert t.kind == "column" and count in (2, 4, 8) and count <= min(n, dim)
                assert [s.col_start for s in t.shards] == sorted(s.col_start for s in t.shards)
                widths = [s.width for s in t.shards]
                assert widths == sorted(widths, reverse=True) and widths[0] - widths[-1] <= 1


def test_shards_on_and_features_on_agree_with_the_tables():
    for config in random_configs(200, seed=7):
        plan = plan_tables(**config)
        everything = sorted((s for t in plan.tables for s in t.shards), key=lambda s: (s.rank, s.feature, s.col_start))
        mine = [s for r in range(plan.world_size) for s in plan.shards_on(r)]
        assert sorted(mine, key=lambda s: (s.rank, s.feature, s.col_start)) == everything
        for r in range(plan.world_size):
            shards = plan.shards_on(r)
            assert shards == sorted(shards, key=lambda s: (s.feature, s.col_start, s.row_start))
            assert all(s.rank == r for s in shards)
            assert plan.features_on(r) == sorted({s.feature for s in shards})


def test_plans_are_deterministic():
    for config in random_configs(100, seed=99):
        first = plan_tables(**config)
        assert plan_tables(**config) == first
        assert plan_tables(**dict(config, rows=tuple(config["rows"]), dims=tuple(config["dims"]))) == first


def test_memory_balanced_gives_every_rank_the_same_number_of_pieces_within_one():
    for config in random_configs(300, seed=3):
        plan = plan_tables(**dict(config, strategy="memory_balanced", row_slice_threshold=None))
        counts = [len(plan.shards_on(r)) for r in range(plan.world_size)]
        assert max(counts) - min(counts) <= 1, config


def test_memory_optimized_keeps_the_load_spread_within_the_largest_piece():
    for config in random_configs(300, seed=5):
        plan = plan_tables(**dict(config, strategy="memory_optimized", row_slice_threshold=None))
        pieces = [s.elements for t in plan.tables for s in t.shards]
        if pieces:
            assert max(loads(plan)) - min(loads(plan)) <= max(pieces), config


# Reporting ----------------------------------------------------------------------------------------

def test_bytes_on_counts_shards_replicated_tables_and_slots():
    plan = plan_tables([5, 100, 30], [4, 8, 8], 2, "memory_optimized", data_parallel_threshold=20)
    assert plan.replicated == [0]
    assert owners(plan) == {0: [], 1: [0], 2: [1]}               # 800 and 240 elements
    assert plan.bytes_on(0) == (800 + 20) * 4
    assert plan.bytes_on(1) == (240 + 20) * 4
    assert plan.bytes_on(1, bytes_per_element=2, slots=2) == (240 + 20) * 2 * 3


def test_format_lists_every_rank_replicated_tables_and_totals():
    plan = plan_tables([5, 100, 30, 1000], [4, 8, 8, 16], 3, "memory_optimized", data_parallel_threshold=20,
                       row_slice_threshold=10_000)
    text = plan.format(slots=2)
    lines = text.splitlines()
    assert "memory_optimized" in lines[0] and "world size 3" in lines[0]
    replicated = [line for line in lines if line.startswith("on every rank")]
    assert len(replicated) == 1 and "replicated" in replicated[0] and "0:5" in replicated[0]
    for r in range(3):
        assert any(line.split()[:2] == [str(r), "total"] for line in lines)
        for s in plan.shards_on(r):
            assert any(line.split()[:5] == [str(r), str(s.feature), plan.tables[s.feature].kind,
                                            f"{s.row_start}:{s.row_end}", f"{s.col_start}:{s.col_end}"]
                       for line in lines)
    assert lines[-1].startswith("all ranks")
    total = sum(plan.bytes_on(r) for r in range(3)) // 4
    assert f"{total:,}" in lines[-1]
    assert len({len(line) for line in lines[1:]}) == 1   # aligned: the last column is right-aligned


def test_format_gives_bytes_in_binary_units():
    text = plan_tables([262_144], [16], 1).format(bytes_per_element=4, slots=2)
    row = next(line for line in text.splitlines() if line.startswith("0 total"))
    assert row.split()[-6:] == ["16.0", "MiB", "32.0", "MiB", "48.0", "MiB"]
    assert "4,194,304" in row


# Errors and dependencies --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=0), "world_size"),
    (dict(world_size=2.0), "world_size"),
    (dict(rows=[10, 10], dims=[4]), "rows and dims"),
    (dict(rows=[], dims=[]), "rows and dims"),
    (dict(rows=[10, 0]), r"rows\[1\] \(feature 1\)"),
    (dict(dims=[4, -1]), r"dims\[1\] \(feature 1\)"),
    (dict(dims=[4, 1.5]), r"dims\[1\] \(feature 1\)"),
    (dict(strategy="greedy"), "strategy"),
    (dict(column_slice_threshold=0), "column_slice_threshold"),
    (dict(row_slice_threshold=0), "row_slice_threshold"),
    (dict(data_parallel_threshold=-1), "data_parallel_threshold"),
])
def test_invalid_arguments_raise_plan_error_naming_them(kwargs, message):
    args = dict(rows=[10, 10], dims=[4, 4], world_size=2)
    with pytest.raises(PlanError, match=message) as error:
        plan_tables(**dict(args, **kwargs))
    assert "\n" not in str(error.value)
    assert isinstance(error.value, ValueError)


def test_shards_on_rejects_a_rank_outside_the_world():
    with pytest.raises(PlanError, match="rank"):
        plan_tables([10], [4], 2).shards_on(2)


def test_importing_the_planner_does_not_import_tensorflow():
    code = "import sys, parallel_embedding.planner; print('tensorflow' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["False", "False"]
