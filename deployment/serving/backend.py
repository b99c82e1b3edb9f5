"""What every backend (monolithic.MonolithicModel, live.Model) does alike: the interface a frontend
calls, the request check and the model_version output.

    infer(numerical_features [B, n] float32, categorical_features [B, W] int64)
        -> {predictions [B, 1] float32, logits [B, 1] float32, model_version [B, 1] int64}
           (a model with H heads: predictions and logits [B, H], repository_format.ServingLayout.heads)

raising errors.BadRequest for a request it refuses. The frontend (native.py, or Triton's) has
checked names, dtypes and shapes; the backend checks values.
"""
from typing import Dict, Protocol

import numpy as np

from deployment.repository_format import Version
from deployment.serving.errors import BadRequest

MODEL_VERSION = "model_version"   # the extra output [B, 1] int64: the served version's step


class Backend(Protocol):
    """A served model: its name, the version it serves now, and its requests."""
    name: str
    version: Version

    def infer(self, numerical: np.ndarray, categorical: np.ndarray) -> Dict[str, np.ndarray]:
        """See the module's docstring."""

    def stats(self) -> dict:
        """Its lookup counts (live.Model's lookup tiers), {} without."""


def check_request(numerical: np.ndarray):
    """Refuses numerical_features [B, n] holding NaN or infinite values (BadRequest)."""
    if not np.isfinite(numerical).all():
        raise BadRequest("numerical_features holds NaN or infinite values")


def with_version(outputs: Dict[str, np.ndarray], version: Version, batch: int) -> Dict[str, np.ndarray]:
    """`outputs` and model_version [batch, 1] int64: `version`'s step."""
    return dict(outputs, **{MODEL_VERSION: np.full((batch, 1), version.step, np.int64)})
