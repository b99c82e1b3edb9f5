"""Storage tiers of the planner (assign_tiers): hand-computed budgets, caches and load factors, the host
threshold, the printout, and a brute-force reference over random small plans."""
import random
from fractions import Fraction

import pytest

from parallel_embedding.planner import (INDEX_BYTES_PER_ROW, SLOT_OVERHEAD_BYTES, BudgetError, Plan, PlanError, Shard,
                                        TablePlacement, Tier, TierOptions, _human_bytes, assign_tiers, plan_tables)
from tests.support.flag_defaults import build
from tests.test_planner import random_configs
from utils.errors import ConfigError
from run.runtime import embedding_plan


def tiers(plan: Plan):
    return {(r, f): (t.kind, t.cache_rows) for r, f, t in plan.tiers}


# One rank, slots 1 (8 bytes an element): f0 1000 x 4 (32 bytes a row, 32,000 in all), f1 500 x 8 (64 a row,
# 32,000: ties f0, which goes first), f2 100 x 2 (16 a row, 1,600). Total 65,600.
ONE_RANK = plan_tables([1000, 500, 100], [4, 8, 2], 1)


def test_a_rank_that_fits_gets_no_tiers():
    for budget in (None, 65_600, 10 ** 12):
        plan = assign_tiers(ONE_RANK, 1, budget, [50] * 3)
        assert plan == ONE_RANK and plan.tiers == ()
        assert plan.tier(0, 0) == Tier() and plan.memory_bytes_on(0, 1) == 65_600 and plan.disk_bytes_on(0, 1) == 0


def test_largest_units_go_to_disk_first():
    # f0 1000 x 8 (32,000 bytes at slots 0), f1 500 x 4 (8,000), f2 300 x 4 (4,800); caches of 10 rows.
    plan = plan_tables([500, 1000, 300], [4, 8, 4], 1)
    assert set(tiers(assign_tiers(plan, 0, 30_000, [10] * 3))) == {(0, 1)}
    # f1 on disk takes 10 x (32 + 32) + 1000 x 4 = 4,640: 17,440 left, above 17,000: f0 too.
    assert set(tiers(assign_tiers(plan, 0, 17_000, [10] * 3))) == {(0, 0), (0, 1)}
    # Equal sizes: the lower feature first.
    twins = plan_tables([100, 100], [4, 4], 1)
    assert set(tiers(assign_tiers(twins, 0, 3_000, [10, 10]))) == {(0, 0)}


def test_load_factor_and_cache_rows_by_hand():
    # Budget 40,000: f0 on disk with 50 cache rows takes 50 x (32 + 32) + 1000 x 4 = 7,200, leaving
    # 65,600 - 32,000 + 7,200 = 40,800 > 40,000; f1 too (50 x 96 + 500 x 4 = 6,800): 15,600. f2 would take
    # 50 x 48 + 100 x 4 = 2,800 > 1,600 on disk: it stays. Fixed: f2 1,600 + the indexes 4,000 + 2,000 =
    # 7,600; the caches get 32,400 = 64 c0 + 96 c1 with c0 = floor(1000 phi), c1 = floor(500 phi).
    # phi = 0.289: 64 x 289 + 96 x 144 = 32,320 fits; the next breakpoint, 0.290: 64 x 290 + 96 x 145 = 32,480.
    plan = assign_tiers(ONE_RANK, 1, 40_000, [50, 50, 50])
    assert tiers(plan) == {(0, 0): ("disk", 289), (0, 1): ("disk", 144)}
    assert plan.tier(0, 2) == Tier("memory", 0)
    assert plan.memory_bytes_on(0, 1) == 7_600 + 32_320
    assert plan.disk_bytes_on(0, 1) == 64_000
    assert plan.tables == ONE_RANK.tables


def test_min_cache_rows_are_respected_and_clamped_to_the_rows():
    # f1's cache at least 200 rows (19,200 bytes): f0's gets 40,000 - 7,600 - 19,200 = 13,200 = 64 c0,
    # c0 = 206 (phi = 0.206; floor(500 x 0.206) = 103 < 200).
    plan = assign_tiers(ONE_RANK, 1, 40_000, [50, 200, 50])
    assert tiers(plan) == {(0, 0): ("disk", 206), (0, 1): ("disk", 200)}
    assert plan.memory_bytes_on(0, 1) == 7_600 + 64 * 206 + 96 * 200
    # f1 with a minimum above its 500 rows: on disk it would cache every row and still keep an index
    # (500 x 96 + 2,000 > 32,000): it stays in memory; f0 goes, with 41,000 - 37,600 = 3,400 = 64 c0: c0 = 53.
    plan = assign_tiers(ONE_RANK, 1, 41_000, [50, 10 ** 9, 50])
    assert tiers(plan) == {(0, 0): ("disk", 53)}
    assert all(t.cache_rows <= plan.tables[f].rows for _, f, t in plan.tiers)


def test_a_budget_below_the_smallest_plan_names_the_rank_and_the_minimum():
    # Rank 0 holds f0 (100 x 4, 1,600 bytes at slots 0), rank 1 f1 (1000 x 4, 16,000). With 10 cache rows,
    # f0 on disk takes 10 x (16 + 32) + 100 x 4 = 880 (fits 1,000); f1 480 + 4,000 = 4,480 (does not).
    plan = plan_tables([100, 1000], [4, 4], 2, "basic")
    with pytest.raises(PlanError) as error:
        assign_tiers(plan, 0, 1_000, [10, 10])
    message = str(error.value)
    assert message.startswith("rank 1: an embedding memory budget of 1000 bytes is too small: the smallest plan "
                              "needs 4480 bytes"), message
    assert "feature 1 on disk 4480 bytes" in message and "10 rows of the batches in flight" in message
    assert "\n" not in message
    assert tiers(assign_tiers(plan, 0, 4_480, [10, 10])) == {(1, 1): ("disk", 10)}   # rank 0 fits whole


def test_the_minimum_counts_replicated_tables():
    # f0 (5 x 4 = 20 elements) replicated: 80 bytes on each rank besides f1's 880 on disk.
    plan = plan_tables([5, 100, 100], [4, 4, 4], 2, "basic", data_parallel_threshold=20)
    assert plan.replicated == [0]
    with pytest.raises(PlanError, match=r"^rank 0: .* needs 960 bytes .*replicated tables 80 bytes"):
        assign_tiers(plan, 0, 959, [10] * 3)
    assert set(tiers(assign_tiers(plan, 0, 960, [10] * 3))) == {(0, 1), (1, 2)}


def test_row_shards_and_two_column_slices_on_one_rank_form_one_unit():
    # f0 10000 x 1 whole on rank 0; f1 1000 x 8 cut in two 4-column slices, both dealt to rank 1 (snake
    # positions 1 and 2); f2 5000 x 4 row-sliced, 2500 rows a rank.
    plan = plan_tables([10000, 1000, 5000], [1, 8, 4], 2, "memory_balanced", column_slice_threshold=5000,
                       row_slice_threshold=15000)
    assert [(s.feature, s.col_start, s.col_end) for s in plan.shards_on(1)] == [(1, 0, 4), (1, 4, 8), (2, 0, 4)]
    assert plan.units_on(0) == [(0, 10000, 1), (2, 2500, 4)]
    assert plan.units_on(1) == [(1, 1000, 8), (2, 2500, 4)]
    # Slots 2 (12 bytes an element), budget 100,000, min cache rows 100, 10, 100:
    # rank 0: f0 120,000 (ties f2, goes first; on disk 100 x 44 + 40,000 = 44,400), f2 120,000 (100 x 80 +
    #   10,000 = 18,000): 62,400. Caches: 100,000 - 50,000 = 50,000 = 44 c0 + 80 c2, c0 = floor(10000 phi),
    #   c2 = floor(2500 phi): phi = 0.0781: 44 x 781 + 80 x 195 = 49,964; at 0.0782: 50,008.
    # rank 1: f2 first (114,000 left), then f1 (width 8: 96 bytes a row; 10 x 128 + 4,000): 23,280. Caches:
    #   100,000 - 14,000 = 86,000 = 80 c2 + 128 c1: phi = 0.262: 80 x 655 + 128 x 262 = 85,936; at 0.2624: 86,016.
    tiered = assign_tiers(plan, 2, 100_000, [100, 10, 100])
    assert tiers(tiered) == {(0, 0): ("disk", 781), (0, 2): ("disk", 195), (1, 1): ("disk", 262),
                             (1, 2): ("disk", 655)}
    assert [tiered.memory_bytes_on(r, 2) for r in range(2)] == [50_000 + 49_964, 14_000 + 85_936]
    assert [tiered.disk_bytes_on(r, 2) for r in range(2)] == [240_000, 216_000]


def test_host_threshold_moves_the_largest_units_left_in_memory():
    # Parameters (no slots): f0 16,000, f1 8,000, f2 1,600 bytes.
    plan = plan_tables([1000, 500, 100], [4, 4, 4], 1)
    assert tiers(assign_tiers(plan, 2, None, [10] * 3, host_threshold_bytes=25_600)) == {}
    assert tiers(assign_tiers(plan, 2, None, [10] * 3, host_threshold_bytes=10_000)) == {(0, 0): ("host", 0)}
    assert tiers(assign_tiers(plan, 2, None, [10] * 3, host_threshold_bytes=9_000)) == {(0, 0): ("host", 0),
                                                                                          (0, 1): ("host", 0)}
    host = assign_tiers(plan, 2, None, [10] * 3, host_threshold_bytes=0)
    assert set(tiers(host).values()) == {("host", 0)} and len(host.tiers) == 3
    assert host.memory_bytes_on(0, 2) == plan.bytes_on(0, slots=2) and host.disk_bytes_on(0, 2) == 0
    # With a budget, disk units are out of the count: f0 on disk leaves 9,600 <= 10,000.
    both = assign_tiers(plan, 0, 20_000, [10] * 3, host_threshold_bytes=10_000)
    assert tiers(both) == {(0, 0): ("disk", both.tier(0, 0).cache_rows)}
    assert tiers(assign_tiers(plan, 0, 20_000, [10] * 3, host_threshold_bytes=5_000)) == {
        (0, 0): ("disk", both.tier(0, 0).cache_rows), (0, 1): ("host", 0)}


def test_host_threshold_counts_replicated_tables_but_never_moves_them():
    # f0 replicated (20 elements: 80 bytes on each rank); f1 on rank 0 (1,600 bytes), f2 on rank 1 (1,600).
    plan = plan_tables([5, 100, 100], [4, 4, 4], 2, "basic", data_parallel_threshold=20)
    assert tiers(assign_tiers(plan, 0, None, [1] * 3, host_threshold_bytes=1_680)) == {}
    assert tiers(assign_tiers(plan, 0, None, [1] * 3, host_threshold_bytes=1_679)) == {(0, 1): ("host", 0),
                                                                                      (1, 2): ("host", 0)}
    assert all(plan.tier(r, 0) == Tier() for r in range(2))


@pytest.mark.parametrize("kwargs,message", [
    (dict(slots=-1), "slots"),
    (dict(budget_bytes=0), "budget_bytes"),
    (dict(budget_bytes=1.5), "budget_bytes"),
    (dict(host_threshold_bytes=-1), "host_threshold_bytes"),
    (dict(min_cache_rows=[10, 10]), "min_cache_rows must have one entry per table"),
    (dict(min_cache_rows=[10, -1, 10]), r"min_cache_rows\[1\] \(feature 1\)"),
])
def test_invalid_arguments_raise_plan_error_naming_them(kwargs, message):
    args = dict(plan=ONE_RANK, slots=0, budget_bytes=1000, min_cache_rows=[10] * 3)
    with pytest.raises(PlanError, match=message):
        assign_tiers(**dict(args, **kwargs))


def test_tiers_are_checked():
    with pytest.raises(PlanError, match="tier kind"):
        Tier("ssd")
    with pytest.raises(PlanError, match="cache_rows"):
        Tier("host", 5)


# The printout ------------------------------------------------------------------------------------

def test_format_with_tiers_gives_each_unit_its_tier_cache_and_bytes():
    # Built by hand: f0 10 x 4 in two column slices on rank 0 (on disk, 3 cache rows), f1 8 x 2 on rank 1 (host),
    # f2 3 x 2 replicated. Slots 1: f0 32 bytes a row: 320 on disk, 3 x (32 + 32) + 10 x 4 = 232 in memory;
    # f1 8 x 16 = 128; f2 3 x 16 = 48 on each rank.
    tables = (TablePlacement(0, 10, 4, "column", (Shard(0, 0, 0, 10, 0, 2), Shard(0, 0, 0, 10, 2, 4))),
              TablePlacement(1, 8, 2, "whole", (Shard(1, 1, 0, 8, 0, 2),)),
              TablePlacement(2, 3, 2, "replicated", ()))
    plan = Plan(2, "basic", tables, ((0, 0, Tier("disk", 3)), (1, 1, Tier("host"))))
    assert [plan.memory_bytes_on(r, 1) for r in range(2)] == [48 + 232, 48 + 128]
    assert [plan.disk_bytes_on(r, 1) for r in range(2)] == [320, 0]
    lines = plan.format(slots=1).splitlines()
    assert lines[0].endswith("1 unit(s) on disk, 1 in host memory")
    assert lines[1].split()[9:] == ["tier", "cache", "rows", "in", "memory", "on", "disk"]
    rows = {tuple(line.split()[:5]): line.split()[5:] for line in lines[2:]}
    assert rows[("on", "every", "rank", "2", "replicated")][-5:] == ["memory", "48", "B", "0", "B"]
    assert rows[("0", "0", "column", "0:10", "0:2")][-6:] == ["disk", "3", "232", "B", "320", "B"]
    assert rows[("0", "0", "column", "0:10", "2:4")][-2:] == ["disk", "3"]   # the unit's bytes are on its first line
    assert rows[("1", "1", "whole", "0:8", "0:2")][-5:] == ["host", "128", "B", "0", "B"]
    totals = {line.split()[0]: line.split()[-4:] for line in lines if line.split()[1] in ("total", "ranks")}
    assert totals == {"0": ["280", "B", "320", "B"], "1": ["176", "B", "0", "B"], "all": ["456", "B", "320", "B"]}


def test_format_totals_match_the_tier_bytes():
    plan = plan_tables([10000, 1000, 5000, 7], [1, 8, 4, 2], 2, "memory_balanced", column_slice_threshold=5000,
                       row_slice_threshold=15000, data_parallel_threshold=14)
    tiered = assign_tiers(plan, 2, 100_000, [100, 10, 100, 1], host_threshold_bytes=10 ** 9)
    lines = tiered.format(slots=2).splitlines()
    assert len(tiered.tiers) == 4
    sums = [0, 0]
    for r in range(2):
        memory, disk = tiered.memory_bytes_on(r, 2), tiered.disk_bytes_on(r, 2)
        line = next(line for line in lines if line.startswith(f"{r} total"))
        assert line.split()[-4:] == _human_bytes(memory).split() + _human_bytes(disk).split()
        sums = [sums[0] + memory, sums[1] + disk]
    assert lines[-1].split()[-4:] == _human_bytes(sums[0]).split() + _human_bytes(sums[1]).split()


def test_format_without_tiers_is_unchanged():
    plan = plan_tables([5, 100, 30, 1000], [4, 8, 8, 16], 3, "memory_optimized", data_parallel_threshold=20,
                       row_slice_threshold=10_000)
    untiered = assign_tiers(plan, 2, None, [1] * 4)
    assert untiered.format(slots=2) == plan.format(slots=2)
    assert "tier" not in plan.format(slots=2) and "on disk" not in plan.format(slots=2)


# Against a brute-force reference ------------------------------------------------------------------

def reference_tiers(plan, slots, budget, minimum):
    """(rank, feature) -> cache rows, by trying every load factor at which some cache changes."""
    result = {}
    for rank in range(plan.world_size):
        units = {}
        for s in plan.shards_on(rank):
            rows, width = units.get(s.feature, (s.num_rows, 0))
            units[s.feature] = (rows, width + s.width)
        row_bytes = {f: 4 * (1 + slots) * w for f, (_, w) in units.items()}
        full = {f: r * row_bytes[f] for f, (r, _) in units.items()}
        low = {f: min(minimum[f], r) for f, (r, _) in units.items()}

        def memory(disk, caches):
            fixed = sum(plan.tables[f].elements for f in plan.replicated) * 4 * (1 + slots)
            return fixed + sum(caches[f] * (row_bytes[f] + SLOT_OVERHEAD_BYTES) + units[f][0] * INDEX_BYTES_PER_ROW
                               if f in disk else full[f] for f in units)

        disk = []
        movable = [f for f in units if memory([f], low) < memory([], low)]
        for f in sorted(movable, key=lambda f: (-full[f], f)):
            if memory(disk, low) <= budget:
                break
            disk.append(f)
        if memory(disk, low) > budget:
            return None
        if not disk:
            continue
        phis = sorted({Fraction(c, units[f][0]) for f in disk for c in range(units[f][0] + 1)})
        caches = {}
        for phi in phis:
            at = {f: min(units[f][0], max(low[f], int(phi * units[f][0]))) for f in disk}
            if memory(disk, at) <= budget:
                caches = at
        result.update({(rank, f): c for f, c in caches.items()})
    return result


def test_assign_tiers_agrees_with_a_brute_force_reference():
    rng = random.Random(11)
    checked = 0
    for config in random_configs(300, seed=17):
        plan = plan_tables(**config)
        slots = rng.randint(0, 2)
        minimum = [rng.randint(0, 8) for _ in plan.tables]
        budget = max(1, int(max(plan.bytes_on(r, slots=slots) for r in range(plan.world_size)) * rng.random()))
        expected = reference_tiers(plan, slots, budget, minimum)
        if expected is None:
            with pytest.raises(PlanError, match="too small"):
                assign_tiers(plan, slots, budget, minimum)
            continue
        tiered = assign_tiers(plan, slots, budget, minimum)
        assert {(r, f): t.cache_rows for r, f, t in tiered.tiers} == expected, config
        assert all(t.kind == "disk" for _, _, t in tiered.tiers)
        assert all(tiered.memory_bytes_on(r, slots) <= budget for r in range(plan.world_size))
        assert all(tiered.memory_bytes_on(r, slots) + tiered.disk_bytes_on(r, slots) >= plan.bytes_on(r, slots=slots)
                   for r in range(plan.world_size))
        checked += bool(expected)
    assert checked > 50


def test_memory_bytes_on_equals_bytes_on_without_tiers():
    for config in random_configs(100, seed=23):
        plan = plan_tables(**config)
        for r in range(plan.world_size):
            assert plan.memory_bytes_on(r, 2) == plan.bytes_on(r, slots=2) and plan.disk_bytes_on(r, 2) == 0


def test_one_planner_call_places_and_tiers():
    """plan_tables with `tiers`: the placement (rules 1-6) with rule 7 applied, as assign_tiers applies it."""
    kinds = set()
    for config in random_configs(60, seed=7):
        placed = plan_tables(**config)
        for slots, budget, host in ((0, None, 0), (2, 3000, None), (1, 1500, 100)):
            options = TierOptions(slots, budget, [2] * len(config["rows"]), host)
            try:
                expected = assign_tiers(placed, slots, budget, options.min_cache_rows, host)
            except BudgetError:
                with pytest.raises(BudgetError):
                    plan_tables(**config, tiers=options)
                continue
            assert plan_tables(**config, tiers=options) == expected
            kinds.update(t.kind for _, _, t in expected.tiers)
    assert kinds == {"host", "disk"}
    with pytest.raises(BudgetError, match="^rank 0: an embedding memory budget of 1000 bytes is too small"):
        plan_tables([1000, 500, 100], [4, 8, 2], 1, tiers=TierOptions(1, 1000, [50] * 3))
    assert issubclass(BudgetError, PlanError)


# From the flags (run.runtime.embedding_plan) -------------------------------------------------------

# Three one-hot tables of width 16 (64 bytes a row at slots 0): f0 100,000 rows (6,400,000 bytes), f1 1,000, f2 10.
FLAGS = dict(synthetic_cardinalities=["100000", "1000", "10"], embedding_dim=["16"], bottom_mlp_dims=["16"],
             batch_size=512, valid_batch_size=256)


def flags_plan(present=None, **overrides):
    """The config of FLAGS with `overrides` (all set explicitly, or those in `present`) and its plan at one rank."""
    cfg = build(present=present, **dict(FLAGS, **overrides))
    return cfg, plan_tables(cfg.data.cardinalities, cfg.model.embedding_dims, 1)


def test_embedding_plan_passes_the_flags_to_the_planner(monkeypatch):
    import run.runtime
    calls = []
    monkeypatch.setattr(run.runtime, "plan_tables", lambda *args, tiers, dynamic: calls.append((args[2:], tiers)) or plan)
    cfg, plan = flags_plan(embedding_memory_budget_gb=1.5, cpu_offloading_threshold_gb=3)
    for on_gpu in (True, False):
        assert embedding_plan(cfg, 1, 2, on_gpu) is plan
    # min cache rows: two training batches (512) and two evaluation batches (256) in flight
    placement = (1, "memory_balanced", None, None, None)
    assert calls == [(placement, TierOptions(2, 3 * 2 ** 29, [1536] * 3, 3 * 2 ** 30)),
                     (placement, TierOptions(2, 3 * 2 ** 29, [1536] * 3, None))]
    calls.clear()
    cfg, _ = flags_plan(synthetic_dataset_hotness=["1", "3", "1"], mode="eval", restore_checkpoint_path="/t",
                        batch_size=64 * 1024, present={"synthetic_dataset_hotness", "mode", "restore_checkpoint_path"})
    embedding_plan(cfg, 1, 0, True)
    # eval: the evaluation batch; multi-hot: 3 ids a row
    assert calls == [(placement, TierOptions(0, None, [512, 1536, 512], None))]
    calls.clear()
    cfg, _ = flags_plan(mode="inference", inference_batch_sizes=["1", "64", "8"],
                        present={"mode", "inference_batch_sizes"})
    embedding_plan(cfg, 1, 0, False)
    assert calls[0][1].min_cache_rows == [128] * 3
    calls.clear()
    cfg, _ = flags_plan(world_size=4, dist_strategy="basic", column_slice_threshold=10, row_slice_threshold=20,
                        data_parallel_threshold=5)
    embedding_plan(cfg, 4, 0, False)
    assert calls == [((4, "basic", 10, 20, 5), TierOptions(0, None, [1536] * 3, None))]


def test_embedding_plan_puts_the_largest_table_on_disk():
    # 0.001 GiB = 1,073,741 bytes. f0 on disk with 1,536 cache rows: 1,536 x (64 + 32) + 400,000 (index) = 547,456,
    # and 64,640 for f1 and f2. The cache then gets 1,073,741 - 464,640 = 609,101 = 96 c0: c0 = 6,344 (phi 0.06344).
    cfg, plan = flags_plan(embedding_memory_budget_gb=0.001, embedding_store_path="/tmp/store")
    tiered = embedding_plan(cfg, 1, 0, False)
    assert tiers(tiered) == {(0, 0): ("disk", 6344)}
    assert tiered.memory_bytes_on(0, 0) == 464_640 + 96 * 6344
    unlimited, _ = flags_plan()
    assert embedding_plan(unlimited, 1, 0, True) == plan


def test_embedding_plan_errors_name_the_flags():
    cfg, plan = flags_plan(embedding_memory_budget_gb=0.0001, embedding_store_path="/tmp/store")
    with pytest.raises(ConfigError) as error:
        embedding_plan(cfg, 1, 0, False)
    # 0.0001 GiB = 107,374 bytes; the smallest plan: f0 547,456 bytes + f1 64,000 + f2 640 = 612,096 (f1 on disk
    # would take 1,000 x 96 + 4,000: more than in memory).
    assert str(error.value).startswith("--embedding_memory_budget_gb=0.0001: rank 0: an embedding memory budget of "
                                       "107374 bytes is too small: the smallest plan needs 612096 bytes")
    cfg, plan = flags_plan(embedding_memory_budget_gb=0.001)
    with pytest.raises(ConfigError, match=r"^--embedding_memory_budget_gb=0.001 puts 1 table shard\(s\) on disk "
                                          r"\(feature 0 on rank 0 first\): give --embedding_store_path"):
        embedding_plan(cfg, 1, 0, False)


def test_the_offloading_threshold_moves_tables_to_host_memory_on_a_gpu_only():
    cfg, plan = flags_plan(cpu_offloading_threshold_gb=0)
    assert tiers(embedding_plan(cfg, 1, 1, on_gpu=True)) == {(0, f): ("host", 0) for f in range(3)}
    assert embedding_plan(cfg, 1, 1, on_gpu=False) == plan
