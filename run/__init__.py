"""The run, on the top floor: its configuration (`config`: flag rules -> `RunConfig`), the absl flags
(`flags`, `data_flags`), TensorFlow's process-wide set-up and the tables' plan (`runtime`), and the
run itself: its parts (`assembly`), its loop (`loop`: `Run`, `run`) and its checkpoint policy
(`checkpoint_policy`)."""
