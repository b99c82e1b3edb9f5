# The two commands a newcomer needs: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_DIR ?= runs/demo
# make test's pytest-xdist workers, each a test file at a time with its own warm interpreters (~2 GB)
TEST_WORKERS ?= 2
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup demo test bench clean

setup: $(VENV)/.ready

OP_SOURCES := $(wildcard tensorflow-dot-based-interact/setup.py tensorflow-dot-based-interact/src/* \
  tensorflow-dot-based-interact/dot_based_interact/*.py tensorflow-id-map/setup.py tensorflow-id-map/src/* \
  tensorflow-id-map/id_map/*.py)

$(VENV)/.ready: requirements.txt pyproject.toml tools/setup_env.sh $(OP_SOURCES)
	bash tools/setup_env.sh $(VENV)
	touch $@

# Train DLRM on a synthetic dataset with a planted ground truth, evaluate (AUC beside the
# oracle's), checkpoint, then evaluate the checkpoint, time inference from it and export it as a
# Triton model repository (serve it with deployment/serve.py: docs/deployment.md).
DEMO_DATA := --dataset_type=synthetic --synthetic_cardinalities=10,20,50,100,20,50,10,5,1000,200,30,7
DEMO_MODEL := --embedding_dim=16 --bottom_mlp_dims=128,64,16 --top_mlp_dims=256,128,1 --optimizer=adam

demo: setup
	rm -rf $(RUN_DIR)
	$(PY) dlrm.py --mode=train $(DEMO_DATA) $(DEMO_MODEL) --synthetic_rows=819200 --synthetic_eval_rows=100000 \
	  --batch_size=2048 --valid_batch_size=8192 --learning_rate=0.002 --warmup_steps=20 --decay_start_step=200 \
	  --decay_steps=200 --print_freq=50 --evals_per_epoch=2 --save_checkpoint_path=$(RUN_DIR)/checkpoints \
	  --log_path=$(RUN_DIR)/log.json
	$(PY) dlrm.py --mode=eval $(DEMO_DATA) $(DEMO_MODEL) --synthetic_eval_rows=100000 --valid_batch_size=8192 \
	  --restore_checkpoint_path=$(RUN_DIR)/checkpoints
	$(PY) dlrm.py --mode=inference $(DEMO_DATA) $(DEMO_MODEL) --restore_checkpoint_path=$(RUN_DIR)/checkpoints \
	  --inference_batch_sizes=1,64,1024 --inference_steps=50
	$(PY) deployment/deploy.py --checkpoint=$(RUN_DIR)/checkpoints --output=$(RUN_DIR)/model_repository

# The slowest tests printed at the end (docs/setup.md: how the suite runs); PYTEST_ARGS for more
# (.ci/run: a JUnit XML of the run).
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=40 $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf runs $(VENV)
