"""Learning-rate schedule: linear warmup, constant, polynomial (power 2) decay, then zero."""
import tensorflow as tf


class LearningRateSchedule:
    """lr(step) for the update with 0-based index `step`:

    - step < warmup_steps: lr * (step + 1) / warmup_steps
    - until decay_start_step: lr
    - decay_start_step <= step < decay_start_step + decay_steps:
      lr * ((decay_start_step + decay_steps - step) / decay_steps) ** 2
    - afterwards: 0, held (never negative, never rising again).

    decay_steps = 0 means no decay.
    """

    def __init__(self, learning_rate: float, warmup_steps: int, decay_start_step: int, decay_steps: int):
        self.learning_rate = learning_rate
        self.warmup_steps = warmup_steps
        self.decay_start_step = decay_start_step
        self.decay_steps = decay_steps

    def __call__(self, step) -> tf.Tensor:
        step = tf.cast(step, tf.float32)
        factor = tf.constant(1.0)
        if self.warmup_steps:
            factor = tf.minimum(factor, (step + 1.0) / self.warmup_steps)
        if self.decay_steps:
            remaining = tf.clip_by_value((self.decay_start_step + self.decay_steps - step) / self.decay_steps, 0.0, 1.0)
            factor = tf.minimum(factor, remaining * remaining)
        return self.learning_rate * factor
