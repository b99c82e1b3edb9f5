"""deploy.py as the export tests run it, the training-time model's logits on an evaluation batch
(the reference served predictions must equal), and a repository's SavedModels' predictions in a
fresh process."""
import dataclasses
import os
import subprocess

import numpy as np
import tensorflow as tf

import run.loop as run_loop
from dataloading.batches import RankInput, eval_batches
from deployment.repository_format import categorical_matrix
from tests.support.horovod_run import ROOT
from tests.support.warm_python import PYTHON

# A repository's three SavedModels (monolithic, sparse, dense) on saved inputs, in a fresh process.
PREDICT = """
import sys, numpy as np, tensorflow as tf
repo, name, inputs, out = sys.argv[1:]
x = np.load(inputs)
def run(model, **tensors):
    f = tf.saved_model.load(f"{repo}/{model}/1/model.savedmodel").signatures["serving_default"]
    return {k: v.numpy() for k, v in f(**{k: tf.constant(v) for k, v in tensors.items()}).items()}
mono = run(name, numerical_features=x["numerical"], categorical_features=x["categorical"])
sparse = run(name + "_sparse", categorical_features=x["categorical"])
dense = run(name + "_dense", numerical_features=x["numerical"], embeddings=sparse["embeddings"])
np.savez(out, logits=mono["logits"], predictions=mono["predictions"], ensemble_logits=dense["logits"],
         ensemble_predictions=dense["predictions"])
"""


def deploy(*args):
    """deployment/deploy.py with `args`, run to its end (text)."""
    return subprocess.run([*PYTHON, "deployment/deploy.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def reference(cfg, checkpoint, rows):
    """The training-time model restored from `checkpoint`: (eval batch of `rows` rows, its logits)."""
    restored = dataclasses.replace(cfg.checkpoints, restore_checkpoint_path=checkpoint, save_checkpoint_path="")
    r = run_loop.Run(dataclasses.replace(cfg, mode="eval", checkpoints=restored))
    batch = next(eval_batches(r.dataset, RankInput.single_process(cfg.data.num_categorical), rows=rows, batch_size=rows))
    categorical = [c if h is None else tf.RaggedTensor.from_row_splits(c.values, c.row_splits)
                   for c, h in zip(batch["categorical"], cfg.data.max_hotness)]
    return batch, r.trainer.predict(batch["numerical"], categorical).numpy()


def served(repo, batch, layout, tmp_path):
    """Predictions of the repository's SavedModels, loaded in a fresh process."""
    np.savez(tmp_path / "inputs.npz", numerical=batch["numerical"],
             categorical=categorical_matrix(batch["categorical"], layout.max_hotness))
    subprocess.run([*PYTHON, "-c", PREDICT, repo, "m", str(tmp_path / "inputs.npz"),
                    str(tmp_path / "out.npz")], check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    return np.load(tmp_path / "out.npz")
