"""Synthetic dataset: random access, determinism, id ranges and distribution, planted labels."""
import numpy as np

from dataloading.batches import RankInput, epoch_order, eval_batches, rank_batch, train_batches
from dataloading.synthetic import SyntheticDataset, power_law_ids
from utils.metrics import roc_auc

DATA = SyntheticDataset([7, 100, 5000, 3], num_numerical=5, alpha=1.05, seed=9)
ONE = RankInput.single_process(4)


def test_any_batching_gives_the_same_samples():
    whole = DATA.batch("train", 0, 1000)
    parts = [DATA.batch("train", s, n) for s, n in ((0, 333), (333, 1), (334, 666))]
    for key in ("numerical", "labels", "oracle_logits"):
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
    for f in range(4):
        np.testing.assert_array_equal(np.concatenate([p["categorical"][f] for p in parts]), whole["categorical"][f])


def test_splits_and_seeds_differ():
    a = DATA.batch("train", 0, 100)["categorical"][2]
    b = DATA.batch("eval", 0, 100)["categorical"][2]
    c = SyntheticDataset([7, 100, 5000, 3], 5, 1.05, seed=10).batch("train", 0, 100)["categorical"][2]
    assert not np.array_equal(a, b) and not np.array_equal(a, c)


def test_ids_in_range_and_power_law():
    batch = DATA.batch("train", 0, 20000)
    for ids, card in zip(batch["categorical"], DATA.cardinalities):
        assert ids.min() >= 0 and ids.max() < card
    counts = np.bincount(batch["categorical"][2], minlength=5000)
    assert counts[0] > 20 * counts[1000:1100].mean()     # head much hotter than the tail
    uniform = power_law_ids(np.linspace(0, 1, 10000, endpoint=False), 10, 0.0)
    np.testing.assert_array_equal(np.bincount(uniform), [1000] * 10)


def test_labels_follow_the_oracle():
    batch = DATA.batch("eval", 0, 50000)
    p = 1 / (1 + np.exp(-batch["oracle_logits"]))
    assert abs(batch["labels"].mean() - p.mean()) < 0.01
    assert roc_auc(batch["labels"], batch["oracle_logits"]) > 0.75
    assert abs(batch["numerical"].mean()) < 0.02 and abs(batch["numerical"].std() - 1) < 0.02


def test_train_stream_is_a_reproducible_permutation_per_epoch():
    order = epoch_order(1, 0, 10)
    assert sorted(order) == list(range(10)) and not np.array_equal(order, epoch_order(1, 1, 10))
    full = list(train_batches(DATA, ONE, rows=40, batch_size=4, seed=1, start_step=0, end_step=25))
    resumed = list(train_batches(DATA, ONE, rows=40, batch_size=4, seed=1, start_step=13, end_step=25))
    assert len(resumed) == 12
    for a, b in zip(full[13:], resumed):
        np.testing.assert_array_equal(a["oracle_logits"], b["oracle_logits"])
    epoch0 = np.sort(np.concatenate([b["oracle_logits"] for b in full[:10]]))
    np.testing.assert_array_equal(epoch0, np.sort(DATA.batch("train", 0, 40)["oracle_logits"]))


def test_eval_stream_keeps_the_last_partial_batch():
    sizes = [len(b["labels"]) for b in eval_batches(DATA, ONE, rows=10, batch_size=4)]
    assert sizes == [4, 4, 2]


def test_ranks_read_their_part_of_the_same_global_batches():
    """At N = 2 and 3 each rank reads its b rows of numericals/labels and the ids it is asked for;
    together they are the single-process batch, and padded eval rows are marked invalid."""
    whole = rank_batch(DATA, "train", 60, 12, ONE)
    for n in (2, 3):
        views = [RankInput(r, n, ("global", "local", "none", "global" if r == 0 else "none")) for r in range(n)]
        parts = [rank_batch(DATA, "train", 60, 12, v) for v in views]
        for key in ("numerical", "labels", "oracle_logits"):
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
        for p in parts:
            np.testing.assert_array_equal(p["categorical"][0], whole["categorical"][0])
            assert p["categorical"][2].size == 0
        np.testing.assert_array_equal(np.concatenate([p["categorical"][1] for p in parts]), whole["categorical"][1])
        evals = [list(eval_batches(DATA, v, rows=10, batch_size=4)) for v in views]
        assert [sum(b["valid"] for b in e) for e in evals] == ([5, 5] if n == 2 else [5, 5, 0])
        assert all(len(b["labels"]) == -(-min(4, 10 - 4 * k) // n) for e in evals for k, b in enumerate(e))


def test_tabulated_effects_equal_hashed_effects(monkeypatch):
    import dataloading.synthetic as synthetic
    tabulated = DATA.batch("eval", 5, 300)["oracle_logits"]
    monkeypatch.setattr(synthetic, "_TABLE_CACHE_ELEMENTS", 0)
    np.testing.assert_array_equal(DATA.batch("eval", 5, 300)["oracle_logits"], tabulated)
