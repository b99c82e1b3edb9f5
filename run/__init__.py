"""The run on the top floor: its configuration (`config`: flag rules -> `RunConfig`), the absl flags
(`flags`, `data_flags`), TensorFlow's process-wide set-up (`runtime`)."""
