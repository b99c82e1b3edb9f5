#!/usr/bin/env bash
# The daily loop of continuous training, one day per call (copy it and set the flags to yours):
#   1. preprocess the day's raw Criteo logs; from day 1 on with the earlier day's vocabularies,
#      which grow (new frequent values get the free ids; capacities fixed on day 0)
#   2. train: day 0 from scratch, later days continue from the newest checkpoint (weights and
#      optimizer state, --restore_mode=continue)
#   3. export: day 0 in full (the repository a server starts from), later days as a delta against
#      the day before (the rows updated since, and the dense model) into UPDATES/day_<N>, where a
#      running `deployment/serve.py --updates=UPDATES` applies it without a restart
#
#   tools/continuous_training.sh WORK DAY [RAW_FILE]
#   .venv/bin/python deployment/serve.py --model_repository=WORK/repository --updates=WORK/updates &
#
# Without RAW_FILE the day's logs are generated (preproc.generate, seed DAY: the same value
# distributions, some values new each day). Environment: PYTHON (default .venv/bin/python),
# ROWS (generated lines, default 200000), CAPACITY (--vocab_capacity of day 0, default 1.5),
# TRAIN_FLAGS (model and optimizer flags: the same every day), LAUNCH (what starts the training
# ranks, e.g. "horovodrun -np 2 -H localhost:2 --gloo"; default one process). See
# docs/continuous_training.md.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
WORK=${1:?usage: tools/continuous_training.sh WORK DAY [RAW_FILE]}
DAY=${2:?usage: tools/continuous_training.sh WORK DAY [RAW_FILE]}
RAW=${3:-}
PYTHON=${PYTHON:-.venv/bin/python}
ROWS=${ROWS:-200000}
CAPACITY=${CAPACITY:-1.5}
TRAIN_FLAGS=${TRAIN_FLAGS:---embedding_dim=16 --bottom_mlp_dims=64,16 --top_mlp_dims=64,1 --optimizer=adagrad \
--learning_rate=0.02 --batch_size=2048 --valid_batch_size=8192 --warmup_steps=0 --decay_start_step=0 --print_freq=20}
[[ $DAY =~ ^[0-9]+$ ]] || { echo "error: DAY must be a number, got $DAY" >&2; exit 2; }
mkdir -p "$WORK/raw" "$WORK/updates"
DATA=$WORK/data/day_$DAY
CKPT=$WORK/checkpoints

if [[ -z $RAW ]]; then
  RAW=$WORK/raw/day_$DAY
  [[ -f $RAW ]] || "$PYTHON" -m preproc.generate --output "$RAW" --rows "$ROWS" --seed "$DAY"
fi

# 1. preprocess
rm -rf "$DATA"
if [[ $DAY == 0 ]]; then
  "$PYTHON" -m preproc.criteo --input "$RAW" --output "$DATA" --frequency_threshold=2 --vocab_capacity="$CAPACITY"
else
  "$PYTHON" -m preproc.criteo --input "$RAW" --output "$DATA" --vocab_from "$WORK/data/day_$((DAY - 1))"
fi

# 2. train (any rank count, any day: LAUNCH)
RESTORE=()
[[ $DAY == 0 ]] || RESTORE=(--restore_checkpoint_path="$CKPT" --restore_mode=continue)
# shellcheck disable=SC2086
${LAUNCH:-} "$PYTHON" dlrm.py --mode=train --dataset_type=split_binary --dataset_path="$DATA" $TRAIN_FLAGS \
  --epochs=1 --evals_per_epoch=1 --save_checkpoint_path="$CKPT" "${RESTORE[@]}"

# 3. export
if [[ $DAY == 0 ]]; then
  "$PYTHON" deployment/deploy.py --checkpoint="$CKPT" --output="$WORK/repository" --forms=tables --overwrite
  echo "$WORK/repository" > "$WORK/updates/.base"
else
  BASE=$(cat "$WORK/updates/.base")
  "$PYTHON" deployment/deploy.py --checkpoint="$CKPT" --delta_from="$BASE" --output="$WORK/updates/day_$DAY"
  echo "$WORK/updates/day_$DAY" > "$WORK/updates/.base"
fi
