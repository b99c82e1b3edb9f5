"""The names the package's interface takes, importable without TensorFlow (the run checks its
flags before TensorFlow is imported):
    OPTIMIZERS   the tables' sparse optimizers (optimizers.py; DistributedEmbedding.set_optimizer)
    COMBINERS    how a multi-hot input's rows become one [D] row (DistributedEmbedding's combiners)
The planner's strategies are planner.STRATEGIES."""
OPTIMIZERS = ("sgd", "adagrad", "adam")
COMBINERS = ("sum", "mean")
