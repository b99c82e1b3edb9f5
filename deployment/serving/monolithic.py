"""Serving a repository's monolithic SavedModel (`<name>/1/model.savedmodel`), the version its
export holds: the backend for repositories without the tables form (no live updates, no lookup
tiers)."""
import os
from typing import Dict

import numpy as np

from deployment.repository_format import export_version, read_export_info
from deployment.serving.backend import check_request, with_version
from deployment.serving.errors import BadRequest


class MonolithicModel:
    """A repository's monolithic SavedModel as a backend.Backend (infer, name, version, stats)."""

    def __init__(self, repository: str):
        import tensorflow as tf
        self.name = read_export_info(repository)["name"]
        self.version = export_version(repository)
        saved = os.path.join(repository, self.name, "1", "model.savedmodel")
        self._serve = tf.saved_model.load(saved).signatures["serving_default"]

    def infer(self, numerical: np.ndarray, categorical: np.ndarray) -> Dict[str, np.ndarray]:
        import tensorflow as tf
        check_request(numerical)
        try:
            out = self._serve(numerical_features=tf.constant(numerical), categorical_features=tf.constant(categorical))
        except tf.errors.InvalidArgumentError as e:   # the SavedModel's id check
            lines = [line.strip() for line in e.message.splitlines() if line.strip()]
            raise BadRequest(next((line for line in lines if line.startswith("assertion failed:")), lines[-1]))
        return with_version({k: v.numpy() for k, v in out.items()}, self.version, len(numerical))

    def stats(self) -> dict:
        return {}
