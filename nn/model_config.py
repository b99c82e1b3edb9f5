"""A ranking model's settings (its tables and its dense part) and the checkpoint signature made
of them. No TensorFlow: deployment/ reads a checkpoint's signature before importing it."""
import dataclasses
from typing import List, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableShape:
    """One categorical feature's embedding table: `cardinality` rows x `dim` columns. A multi-hot
    feature (at most `max_hotness` ids per sample; None: one-hot) combines its ids' rows by
    `combiner`, "sum" or "mean"."""
    cardinality: int
    dim: int
    max_hotness: Optional[int] = None
    combiner: str = "sum"


def table_combiners(max_hotness: Sequence[Optional[int]], multi_hot_combiner: Optional[str]) -> List[str]:
    """Per table: `multi_hot_combiner` for multi-hot features (default sum), sum otherwise."""
    return [(multi_hot_combiner or "sum") if h else "sum" for h in max_hotness]


def table_configs(*, cardinalities: Sequence[int], dims: Sequence[int], max_hotness: Sequence[Optional[int]] = None,
                  multi_hot_combiner: Optional[str] = None) -> Tuple[TableShape, ...]:
    """Per feature f: a table of cardinalities[f] x dims[f] (one-hot features without `max_hotness`)."""
    max_hotness = max_hotness or [None] * len(cardinalities)
    return tuple(TableShape(cardinality=c, dim=d, max_hotness=h, combiner=k) for c, d, h, k in
                 zip(cardinalities, dims, max_hotness, table_combiners(max_hotness, multi_hot_combiner)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A DLRM / DCNv2 model: `tables` (one per categorical feature), `num_numerical` numerical
    features into the bottom MLP (`bottom_mlp_dims`, its last width the dot interaction's D),
    the interaction ("dot", "dot_custom", "dot_tensorflow": nn.interaction.DOT_KERNELS; or
    "cross", with `num_cross_layers` and `cross_layer_projection_dim`, 0: full rank) and the
    top MLP (`top_mlp_dims`, ending in 1)."""
    tables: Tuple[TableShape, ...]
    num_numerical: int
    bottom_mlp_dims: Tuple[int, ...]
    top_mlp_dims: Tuple[int, ...]
    interaction: str = "dot"
    num_cross_layers: int = 3
    cross_layer_projection_dim: int = 512

    @property
    def cardinalities(self) -> List[int]:
        return [t.cardinality for t in self.tables]

    @property
    def embedding_dims(self) -> List[int]:
        return [t.dim for t in self.tables]

    @property
    def combiners(self) -> List[str]:
        return [t.combiner for t in self.tables]

    def signature(self, optimizer: Optional[str] = None) -> dict:
        """The settings a checkpoint must share with the model that reads it, named as the flags
        (a checkpoint manifest's "signature"), and `optimizer`, whose state it holds, when given.
        Every dot kernel is the same model."""
        hot = [t.max_hotness for t in self.tables]
        cross = self.interaction == "cross"
        signature = {"cardinalities": self.cardinalities, "num_numerical": self.num_numerical, "max_hotness": hot,
                     "multi_hot_combiner": next((t.combiner for t in self.tables if t.max_hotness), None),
                     "embedding_dim": self.embedding_dims, "bottom_mlp_dims": list(self.bottom_mlp_dims),
                     "top_mlp_dims": list(self.top_mlp_dims), "interaction": "cross" if cross else "dot",
                     "num_cross_layers": self.num_cross_layers if cross else None,
                     "cross_layer_projection_dim": self.cross_layer_projection_dim if cross else None}
        if optimizer is not None:
            signature["optimizer"] = optimizer
        return signature

    @classmethod
    def from_signature(cls, signature: dict) -> "ModelConfig":
        """The model a checkpoint's signature describes (its dot interaction: "dot")."""
        s = signature
        cross = {k: s[k] for k in ("num_cross_layers", "cross_layer_projection_dim")} if s["interaction"] == "cross" \
            else {}
        tables = table_configs(cardinalities=s["cardinalities"], dims=s["embedding_dim"], max_hotness=s["max_hotness"],
                               multi_hot_combiner=s["multi_hot_combiner"])
        return cls(tables=tables, num_numerical=s["num_numerical"], bottom_mlp_dims=tuple(s["bottom_mlp_dims"]),
                   top_mlp_dims=tuple(s["top_mlp_dims"]), interaction=s["interaction"], **cross)
