"""TINY's synthetic data (tests/support/configs.py) written as split-binary files, as
generate_dataset.py writes them: CARDS' four categorical features, three numericals, ROWS
training rows (12 batches of BATCH), EVAL_ROWS test rows."""
from dataloading.feature_spec import split_binary_spec
from dataloading.generate_dataset import generate
from tests.support.configs import TINY

CARDS = [20, 50, 7, 30]
ROWS, EVAL_ROWS, BATCH = 128 * 12, 500, 128


def write_dataset(path, max_hotness=None, numerical_dtype="float32", eval_rows=EVAL_ROWS, cards=CARDS) -> str:
    """The files under `path` (returned): features multi-hot up to `max_hotness` ({name: hotness}),
    numericals of `numerical_dtype`."""
    spec = split_binary_spec([f"n{k}" for k in range(3)], {f"c{k}": c for k, c in enumerate(cards)},
                             max_hotness=max_hotness, numerical_dtype=numerical_dtype, base_dir=str(path))
    generate(spec, ROWS, eval_rows, seed=TINY["seed"], alpha=TINY["synthetic_alpha"])
    return str(path)
