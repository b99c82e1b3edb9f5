"""A planted-signal run learns: AUC lift over 0.5 reaches 90% of the ground-truth oracle's."""
import pytest

import run.loop as run_loop
from tests.support.configs import tiny_config

PLANTED = dict(synthetic_cardinalities=["10", "20", "50", "100", "20", "50", "10", "5"], synthetic_num_numerical=13,
               synthetic_rows=1024 * 400, synthetic_eval_rows=20000, batch_size=1024, valid_batch_size=4096,
               embedding_dim=["16"], bottom_mlp_dims=["64", "16"], top_mlp_dims=["64", "1"], optimizer="adam",
               learning_rate=0.003, warmup_steps=10, decay_start_step=300, decay_steps=100, evals_per_epoch=0,
               print_freq=100)


@pytest.mark.slow
@pytest.mark.parametrize("interaction", ["dot", "cross"])
def test_planted_signal_reaches_most_of_the_oracle_lift(interaction):
    extra = dict(interaction=interaction, num_cross_layers=2, cross_layer_projection_dim=0) if interaction == "cross" else {}
    result = run_loop.run(tiny_config(**PLANTED, **extra))
    assert result["steps"] == 400 and result["samples"] == 20000
    assert result["oracle_auc"] > 0.78
    assert result["auc"] - 0.5 >= 0.9 * (result["oracle_auc"] - 0.5), result
