"""The errors that cross layers: raised in one package, caught by the entry points (main.py, the
tools) or another package. Each message is one line. A leaf: it imports nothing of the project,
so any module can import it. The errors of one package stay in it (parallel_embedding.planner's
PlanError, deployment's ExportError and ServingError)."""


class ConfigError(ValueError):
    """An impossible or meaningless flag combination; its message is one line."""
    # Raised in a Keras layer's call, it passes as it is: Keras would add the call's arguments.
    _keras_call_info_injected = True


class DatasetError(ConfigError):
    """A problem with a dataset or its spec; the message is one line naming what is wrong where
    (a ConfigError: the command line reports it as `error: ...` and exits 2)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read into this model; the message names file and variable."""


class NonFiniteError(RuntimeError):
    """A training step gave a non-finite loss or gradients; the message is one line naming the step."""


class StoreError(RuntimeError):
    """The embedding store or the checkpoint root failed during a run (a file deleted, a cache too
    small for the batches in flight, no space left for a checkpoint); the message is one line naming
    the path or feature."""
