"""Steps and runs of the API's DLRM: its losses stepped by ranking.Model.step_on in a
tf.function (api_steps), and main.py's run of examples/dlrm.py at small sizes in process (DLRM,
run_losses: its per-step losses)."""
import json

import tensorflow as tf

import run.loop as run_loop
from tests.support.configs import TINY, make_config


def api_steps(model, data):
    """The per-step losses of `model` on `data` (numerical, ids, labels per batch)."""
    step = tf.function(model.step_on)
    return [float(step([n] + ids, labels)[0]) for n, ids, labels in data]


# main.py --model=examples/dlrm.py with --amp, --xla (in process: run.loop.run).
DLRM = dict(TINY, batch_size=96, valid_batch_size=300, max_steps=12, learning_rate=0.01, warmup_steps=2,
            decay_start_step=8, decay_steps=4, seed=7, print_freq=1, synthetic_cardinalities=["300", "50", "7", "30"],
            synthetic_rows=1152, synthetic_eval_rows=500, model="examples/dlrm.py",
            model_param=["embedding_dim=8", "bottom=[16,8]", "top=[16]"])


def run_losses(tmp_path, name, **flags):
    log = tmp_path / f"{name}.json"
    result = run_loop.run(make_config(DLRM, log_path=str(log), **flags))
    records = [json.loads(line) for line in open(log)]
    return [r["loss"] for r in records if r.get("kind") == "step"], result
