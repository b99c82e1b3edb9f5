"""The DotBasedInteract op (tensorflow-dot-based-interact/): forward and gradient against NumPy
and the TensorFlow implementation, numerical gradients, the fallback and dot_custom paths,
training and checkpoints with it, export without it, and the CUDA harness's build."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import run.loop as run_loop
import nn.interaction as interaction
from nn.interaction import DotInteraction, dot_interaction_width
from tests.support.configs import tiny_config
from utils.errors import ConfigError
from tests.support.warm_python import PYTHON

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OP_DIR = os.path.join(ROOT, "tensorflow-dot-based-interact")
dot_based_interact = pytest.importorskip("dot_based_interact")

# Every B, F+1 and D value of the issue appears at least once.
SHAPES = [(1, 2, 1), (3, 9, 7), (64, 27, 16), (3, 33, 129), (1, 64, 256), (64, 2, 128), (4096, 27, 16),
          (3, 64, 1), (64, 9, 256), (1, 33, 7), (4096, 9, 128), (64, 64, 16)]


def numpy_forward(x):
    """x [B, N, D] float64 -> (output, the sum of |terms| of each output element)."""
    b, n, d = x.shape
    rows, cols = np.tril_indices(n, -1)
    width = dot_interaction_width(n - 1, d)
    dots = np.einsum("bik,bjk->bij", x, x)[:, rows, cols]
    scale = np.einsum("bik,bjk->bij", np.abs(x), np.abs(x))[:, rows, cols]
    pad = np.zeros((b, width - d - len(rows)))
    return np.concatenate([x[:, 0], dots, pad], 1), np.concatenate([np.abs(x[:, 0]), scale, pad + 1], 1)


def numpy_backward(x, g):
    """d(sum(output * g))/dx and the sum of |terms| of each element."""
    b, n, d = x.shape
    s = np.zeros((b, n, n))
    rows, cols = np.tril_indices(n, -1)
    s[:, rows, cols] = s[:, cols, rows] = g[:, d:d + len(rows)]
    grad, scale = s @ x, np.abs(s) @ np.abs(x)
    grad[:, 0] += g[:, :d]
    scale[:, 0] += np.abs(g[:, :d])
    return grad, scale


def assert_close(got, want, scale, tol):
    """|got - want| <= tol * (sum of the absolute terms of want), elementwise."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want) / np.maximum(tol * scale, 1e-30)
    assert err.max() <= 1.0, f"worst error {err.max():.2f} x tolerance at {np.unravel_index(err.argmax(), err.shape)}"


def run_op(x, g):
    """Forward and gradient of the op (given the N vectors as a list) for x [B, N, D] and output
    gradient g; the gradient stacked back to [B, N, D]."""
    vectors = tf.unstack(tf.constant(x), axis=1)
    with tf.GradientTape() as tape:
        tape.watch(vectors)
        out = dot_based_interact.dot_based_interact(vectors)
    return out, tf.stack(tape.gradient(out, vectors, output_gradients=tf.constant(g)), 1)


def run_tf(x, g):
    """The same through DotInteraction's TensorFlow implementation (XLA forward/backward pair)."""
    vectors = [tf.constant(v) for v in np.moveaxis(x, 1, 0)]
    layer = DotInteraction(x.shape[1] - 1, x.shape[2], kernel="tf")
    with tf.GradientTape() as tape:
        tape.watch(vectors)
        out = layer(vectors[0], vectors[1:], training=True)
    return out, np.stack(tape.gradient(out, vectors, output_gradients=tf.constant(g)), 1)


@pytest.mark.parametrize("batch,n,dim", SHAPES)
def test_float32_matches_numpy_and_tensorflow(batch, n, dim):
    rng = np.random.default_rng(batch * 10000 + n * 100 + dim)
    x = rng.standard_normal((batch, n, dim)).astype(np.float32)
    g = rng.standard_normal((batch, dot_interaction_width(n - 1, dim))).astype(np.float32)
    want, scale = numpy_forward(x.astype(np.float64))
    want_grad, grad_scale = numpy_backward(x.astype(np.float64), g.astype(np.float64))
    out, grad = run_op(x, g)
    tf_out, tf_grad = run_tf(x, g)
    for got, got_grad in ((out, grad), (tf_out, tf_grad)):
        assert_close(got, want, scale, 1e-5)
        assert_close(got_grad, want_grad, grad_scale, 1e-5)
    assert out.dtype == tf.float32 and out.shape == tf_out.shape


@pytest.mark.parametrize("batch,n,dim", [(3, 9, 7), (64, 27, 16), (3, 33, 129), (64, 64, 16), (1, 64, 256)])
def test_bfloat16_to_its_precision(batch, n, dim):
    rng = np.random.default_rng(n + dim)
    x = tf.cast(rng.standard_normal((batch, n, dim)), tf.bfloat16)
    g = tf.cast(rng.standard_normal((batch, dot_interaction_width(n - 1, dim))), tf.bfloat16)
    out, grad = run_op(x, g)
    assert out.dtype == grad.dtype == tf.bfloat16
    x64, g64 = tf.cast(x, tf.float64).numpy(), tf.cast(g, tf.float64).numpy()
    # float32 accumulation, one bfloat16 rounding (relative 2^-8) of the result
    assert_close(tf.cast(out, tf.float64), *numpy_forward(x64), 2.0 ** -8)
    assert_close(tf.cast(grad, tf.float64), *numpy_backward(x64, g64), 2.0 ** -8)


@pytest.mark.parametrize("shape", [(2, 3, 4), (1, 5, 7), (3, 2, 1)])
def test_gradient_matches_numerical(shape):
    x = tf.constant(np.random.default_rng(sum(shape)).uniform(-1, 1, shape), tf.float32)
    theoretical, numerical = tf.test.compute_gradient(dot_based_interact.dot_based_interact, [x], delta=1e-2)
    np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-3, atol=1e-3)


def test_stacked_input_equals_the_list():
    x = tf.constant(np.random.default_rng(5).standard_normal((6, 9, 16)), tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = dot_based_interact.dot_based_interact(x)
    grad = tape.gradient(out, x)
    want, want_grad = run_op(x.numpy(), np.ones(out.shape, np.float32))
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(grad, want_grad)


def test_static_shape_and_invalid_input():
    fn = tf.function(dot_based_interact.dot_based_interact).get_concrete_function(
        tf.TensorSpec([None, 27, 16], tf.float32))
    assert fn.output_shapes.as_list() == [None, 368]
    fn = tf.function(lambda *v: dot_based_interact.dot_based_interact(list(v))).get_concrete_function(
        *[tf.TensorSpec([None, 16], tf.float32)] * 27)
    assert fn.output_shapes.as_list() == [None, 368]
    with pytest.raises(ValueError, match="expected a list"):
        dot_based_interact.dot_based_interact(tf.zeros([4, 16]))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        dot_based_interact.dot_based_interact([tf.zeros([4, 16]), tf.zeros([4, 8])])
    with pytest.raises(tf.errors.InvalidArgumentError, match="grad must be"):
        dot_based_interact.load().dot_based_interact_grad([tf.zeros([2, 4])] * 3, tf.zeros([2, 9]))


ISA_CHECK = """
import numpy as np
import tensorflow as tf
from tests.test_dot_interact_op import SHAPES, assert_close, numpy_backward, numpy_forward, run_op
for batch, n, dim in SHAPES[:6]:
    rng = np.random.default_rng(n + dim)
    x = rng.standard_normal((batch, n, dim))
    g = rng.standard_normal((batch, -(-(dim + n * (n - 1) // 2) // 8) * 8))
    out, grad = run_op(x.astype(np.float32), g.astype(np.float32))
    assert_close(out, *numpy_forward(x), 1e-5)
    assert_close(grad, *numpy_backward(x, g), 1e-5)
print("ok")
"""


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_other_instruction_sets(isa):
    """The kernels this CPU would not pick (DOT_INTERACT_ISA chooses them; a CPU without AVX2
    runs the portable ones either way)."""
    p = subprocess.run([*PYTHON, "-c", ISA_CHECK], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", DOT_INTERACT_ISA=isa))
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


@pytest.fixture
def op_missing(monkeypatch):
    """Makes `import dot_based_interact` fail, as on a machine where it was never built."""
    monkeypatch.setitem(sys.modules, "dot_based_interact", None)
    for cached in (interaction._load_op, interaction._warn_fallback):
        cached.cache_clear()
    yield
    for cached in (interaction._load_op, interaction._warn_fallback):
        cached.cache_clear()


def test_training_uses_the_op_and_matches_tensorflow():
    cfg = tiny_config(max_steps=6, evals_per_epoch=0)
    runs = []
    for kernel in ("auto", "tf"):
        r = run_loop.Run(cfg)
        if kernel == "tf":
            r.model.keras_model.get_layer("interaction").engine._op = None
        assert (r.model.keras_model.get_layer("interaction").engine._op is dot_based_interact) == (kernel == "auto")
        r.train()
        runs.append({e.name: e.variable.numpy() for e in r.trainer.checkpoint_entries()})
    assert runs[0].keys() == runs[1].keys()
    for name in runs[0]:
        np.testing.assert_allclose(runs[0][name], runs[1][name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_fallback_warns_once_and_trains(op_missing, capsys):
    layers = [DotInteraction(4, 8), DotInteraction(4, 8)]
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and len(err.strip().splitlines()) == 1
    assert "dot interaction op cannot load" in err and "TensorFlow implementation" in err
    assert all(layer._op is None for layer in layers)
    result = run_loop.run(tiny_config(max_steps=10, evals_per_epoch=0, learning_rate=0.01))
    assert np.isfinite(result["logloss"]) and result["steps"] == 10


def test_dot_custom_without_the_library_is_a_config_error(op_missing):
    with pytest.raises(ConfigError, match="--interaction=dot_custom: the dot interaction op cannot load"):
        run_loop.run(tiny_config(interaction="dot_custom", max_steps=2))


def test_dot_custom_cli_error_line(tmp_path):
    """Exit code 2 and one `error:` line, as every configuration error (library hidden)."""
    code = ("import sys, runpy; sys.modules['dot_based_interact'] = None; sys.argv[0] = 'dlrm.py'; "
            "runpy.run_path('dlrm.py', run_name='__main__')")
    args = ["--interaction=dot_custom", "--dataset_type=synthetic", "--synthetic_cardinalities=5,6",
            "--embedding_dim=4", "--bottom_mlp_dims=8,4", "--top_mlp_dims=8,1", "--batch_size=64", "--synthetic_rows=128"]
    p = subprocess.run([*PYTHON, "-c", code] + args, cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: --interaction=dot_custom: the dot interaction op")


@pytest.fixture
def gpu_visible(monkeypatch):
    """A GPU this process sees, faked (the op's GPU check reads tf.config.get_visible_devices)."""
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    real = tf.config.get_visible_devices
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind=None: [gpu] if kind == "GPU" else real(kind))
    interaction._warn_fallback.cache_clear()
    yield
    interaction._warn_fallback.cache_clear()


@pytest.fixture
def no_gpu_kernels(monkeypatch):
    """TensorFlow's kernel registry without its GPU kernels, as where the library was built without nvcc."""
    real = interaction.kernels.get_registered_kernels_for_op

    def cpu_only(name):
        registered = real(name)
        cpu = [k for k in registered.kernel if k.device_type != "GPU"]
        del registered.kernel[:]
        registered.kernel.extend(cpu)
        return registered
    monkeypatch.setattr(interaction.kernels, "get_registered_kernels_for_op", cpu_only)


def test_gpu_kernels_registered_exactly_when_the_library_has_cuda_code(gpu_visible):
    """The registry check against the library file: a CUDA fat binary (magic 0xBA55ED50) is in it
    exactly when the op pair has GPU kernels; CPU kernels for every CPU type either way."""
    dot_based_interact.load()
    with open(dot_based_interact.LIBRARY, "rb") as f:
        has_cuda = b"\x50\xed\x55\xba" in f.read()
    assert (interaction._gpu_kernels_missing() is None) == has_cuda
    for name in ("DotBasedInteract", "DotBasedInteractGrad"):
        cpu_types = {t for k in interaction.kernels.get_registered_kernels_for_op(name).kernel
                     if k.device_type == "CPU" for t in k.constraint[0].allowed_values.list.type}
        assert cpu_types == {tf.float32.as_datatype_enum, tf.bfloat16.as_datatype_enum, tf.float16.as_datatype_enum}


def test_no_gpu_kernels_on_a_gpu_falls_back_with_one_warning(gpu_visible, no_gpu_kernels, capsys):
    layers = [DotInteraction(4, 8), DotInteraction(4, 8)]
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and len(err.strip().splitlines()) == 1
    assert "dot interaction op has no GPU kernels" in err and "TensorFlow implementation" in err
    assert all(layer._op is None for layer in layers)


def test_no_gpu_kernels_without_a_gpu_uses_the_op(no_gpu_kernels, capsys):
    assert DotInteraction(4, 8)._op is dot_based_interact and capsys.readouterr().err == ""


def test_dot_custom_without_gpu_kernels_on_a_gpu_is_a_config_error(gpu_visible, no_gpu_kernels):
    with pytest.raises(ConfigError, match="--interaction=dot_custom: the dot interaction op has no GPU kernels"):
        DotInteraction(4, 8, kernel="custom")


def test_dot_custom_with_xla_is_a_config_error():
    with pytest.raises(ConfigError, match="no XLA kernel"):
        tiny_config(interaction="dot_custom", xla=True)


def test_checkpoints_move_between_dot_and_dot_custom(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    trained = run_loop.run(tiny_config(interaction="dot_custom", max_steps=4, evals_per_epoch=0,
                                   save_checkpoint_path=ckpt))
    evaluated = run_loop.run(tiny_config(mode="eval", interaction="dot", restore_checkpoint_path=ckpt))
    assert evaluated["auc"] == pytest.approx(trained["auc"], abs=1e-6)


SERVE = """
import sys
import numpy as np
import tensorflow as tf
sys.modules["dot_based_interact"] = None    # no op library in this process
loaded = tf.saved_model.load(sys.argv[1])
data = np.load(sys.argv[2])
out = loaded.signatures["serving_default"](numerical_features=tf.constant(data["numerical"]),
                                           categorical_features=tf.constant(data["categorical"]))["logits"]
np.save(sys.argv[3], out.numpy()[:, 0])
"""


def test_saved_model_serves_without_the_op(tmp_path):
    """The model trained with the op, exported by deployment/ (the monolithic SavedModel), runs
    in a process that cannot load the op library."""
    from deployment.exporter.repository import write_repository
    r = run_loop.Run(tiny_config(save_checkpoint_path=str(tmp_path / "ckpt")))
    r.train()   # trained with the op
    assert r.model.keras_model.get_layer("interaction").engine._op is dot_based_interact
    write_repository(str(tmp_path / "ckpt"), str(tmp_path / "repo"), "dlrm", forms=("monolithic",))
    model_dir = tmp_path / "repo" / "dlrm" / "1" / "model.savedmodel"
    with open(model_dir / "saved_model.pb", "rb") as f:
        assert b"DotBasedInteract" not in f.read()
    rng = np.random.default_rng(0)
    numerical = rng.standard_normal((50, 3)).astype(np.float32)
    categorical = np.stack([rng.integers(0, c, 50) for c in (20, 50, 7, 30)], 1)
    np.savez(tmp_path / "batch.npz", numerical=numerical, categorical=categorical)
    subprocess.run([*PYTHON, "-c", SERVE, str(model_dir), str(tmp_path / "batch.npz"),
                    str(tmp_path / "out.npy")], check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    expected = r.trainer.predict(tf.constant(numerical), list(tf.unstack(categorical.astype(np.int32), axis=1))).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def cuda_harness(tmp_path_factory):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    binary = str(tmp_path_factory.mktemp("cuda") / "cuda_harness")
    src = os.path.join(OP_DIR, "src")
    subprocess.run([nvcc, "-std=c++17", "-O2", os.path.join(src, "dot_based_interact.cu"),
                    os.path.join(src, "cuda_harness.cu"), "-o", binary], check=True)
    return binary


def test_cuda_harness_compiles(cuda_harness):
    assert os.access(cuda_harness, os.X_OK)


def test_cuda_kernels_match_cpu_reference(cuda_harness):
    p = subprocess.run([cuda_harness], capture_output=True, text=True)
    if p.returncode == 77:
        pytest.skip("no CUDA device")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all passed" in p.stdout


def test_the_caller_chooses_the_op_outside_xla_only():
    """Training uses the op unless the caller says it compiles with XLA (where the op has no kernel)."""
    layer = DotInteraction(4, 8)
    vectors = [tf.TensorSpec([None, 8], tf.float32)] * 5

    def ops(**options):
        graph = tf.function(lambda *v: layer(v[0], list(v[1:]), **options)).get_concrete_function(*vectors).graph
        return {node.op for node in graph.as_graph_def().node}
    assert "DotBasedInteract" in ops(training=True)
    assert "DotBasedInteract" not in ops(training=True, xla=True) | ops(training=False)
