"""ModelConfig and the checkpoint signature made of it: manifests written before it existed read."""
import run.assembly as run_assembly
from nn.model_config import ModelConfig, TableShape
from tests.support.configs import tiny_config

# Manifest signatures as main.model_signature wrote them before ModelConfig: tiny_config() (every dot
# kernel), tiny_config(interaction="cross", optimizer="sgd"), and a multi-hot model.
DOT = {"cardinalities": [20, 50, 7, 30], "num_numerical": 3, "max_hotness": [None] * 4, "multi_hot_combiner": None,
       "embedding_dim": [8] * 4, "bottom_mlp_dims": [16, 8], "top_mlp_dims": [16, 1], "interaction": "dot",
       "num_cross_layers": None, "cross_layer_projection_dim": None, "optimizer": "adam"}
CROSS = dict(DOT, interaction="cross", num_cross_layers=2, cross_layer_projection_dim=4, optimizer="sgd")
MULTI_HOT = dict(DOT, max_hotness=[3, None, 2, None], multi_hot_combiner="mean")


def test_runs_write_the_signature_they_wrote_before():
    for overrides, written in (({}, DOT), ({"interaction": "dot_custom"}, DOT),
                               ({"interaction": "dot_tensorflow"}, DOT),
                               ({"interaction": "cross", "optimizer": "sgd"}, CROSS)):
        cfg = tiny_config(**overrides)
        assert run_assembly.model_config(cfg).signature(cfg.training.optimizer) == written, overrides


def test_old_signatures_read_back_unchanged():
    for written in (DOT, CROSS, MULTI_HOT):
        assert ModelConfig.from_signature(written).signature(written["optimizer"]) == written
    model = ModelConfig.from_signature(MULTI_HOT)
    assert model.tables[:2] == (TableShape(cardinality=20, dim=8, max_hotness=3, combiner="mean"),
                                TableShape(cardinality=50, dim=8))
    assert ModelConfig.from_signature(CROSS).num_cross_layers == 2


def test_a_weights_only_signature_has_no_optimizer():
    assert ModelConfig.from_signature(DOT).signature() == {k: v for k, v in DOT.items() if k != "optimizer"}
