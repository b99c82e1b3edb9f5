"""Run under `horovodrun -np N`: each rank evaluates its rows of tests/support/evaluator_rows.py
(rank r: `rank_rows(r)`, in batches with padding) and gathers them onto rank 0. Prints, per rank, one line
`RESULT {json}` with what `gather` returned on it and the metrics `evaluate` shared."""
import json

import numpy as np

from nn.evaluator import evaluate
from parallel_embedding.collectives import make_collectives
from tests.support.evaluator_rows import batches, rank_rows


def main():
    comm = make_collectives()
    logits, labels, oracle = rank_rows(comm.rank)
    mine = np.stack([logits, labels], axis=1)
    gathered = comm.gather(mine, "test_gather")
    metrics = evaluate(lambda numerical, categorical: numerical[:, 0], batches(logits, labels, oracle), comm,
                       oracle=True)
    print("RESULT", json.dumps({"rank": comm.rank, "gathered": gathered.tolist(), "metrics": metrics}), flush=True)


if __name__ == "__main__":
    main()
