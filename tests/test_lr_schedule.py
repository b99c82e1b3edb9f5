"""Learning-rate schedule values, written out by hand."""
import pytest

from nn.lr_schedule import LearningRateSchedule


@pytest.mark.parametrize("step,expected", [
    (0, 0.25), (1, 0.5), (3, 1.0),            # warmup over 4 steps: (step + 1) / 4
    (4, 1.0), (9, 1.0),                         # constant until decay_start_step = 10
    (10, 1.0), (12, 0.36), (15, 0.0),           # ((10 + 5 - step) / 5) ** 2
    (16, 0.0), (1000, 0.0),                     # held at zero afterwards, never rising
])
def test_warmup_constant_decay_floor(step, expected):
    schedule = LearningRateSchedule(2.0, warmup_steps=4, decay_start_step=10, decay_steps=5)
    assert float(schedule(step)) == pytest.approx(2.0 * expected, abs=1e-6)


def test_no_warmup_no_decay_is_constant():
    schedule = LearningRateSchedule(0.3, 0, 0, 0)
    assert [float(schedule(s)) for s in (0, 1, 10 ** 6)] == pytest.approx([0.3] * 3)


def test_decay_never_negative_or_rising():
    schedule = LearningRateSchedule(1.0, 2, 3, 7)
    values = [float(schedule(s)) for s in range(3, 40)]
    assert all(b <= a for a, b in zip(values, values[1:]))
    assert min(values) == 0.0
