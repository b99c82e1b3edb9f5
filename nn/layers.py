"""Building blocks of ranking models as Keras 3 layers: MLP, DotInteraction, CrossNetwork,
FactorizationMachine, TargetAttention (DIN's, over a sequence feature's rows), TransformerBlock
(BST's), HSTUBlock (HSTU's pointwise attention); the one implementation of the built-in DLRM /
DCNv2's dense part (nn/model.py) and of the ranking/ API's layers (`ranking.MLP`, ...). Shapes:
`b` local batch, `F` embeddings, `D` a width.

    emb = HybridEmbedding(features)(ids)                                   # F x [b, 16]
    bottom = MLP([64, 16], seed=(3, 0), name="bottom_mlp")(numerical)      # [b, 16]
    x = DotInteraction(name="interaction")([bottom] + emb)                 # [b, round_up_8(16 + (F+1)F/2)]
    logit = MLP([64, 1], linear_output=True, seed=(3, 100), name="top_mlp")(x)    # [b, 1]

Their arithmetic is nn.mlp's (initial values, forward) and nn.interaction's (the dot interaction
with its custom op in training, the cross network's initial values and forward). Each is built
lazily from its input shapes; an input it cannot take is a one-line ConfigError naming the layer,
at build time. Weights are named by Keras path ("bottom_mlp/dense_0/kernel", "cross/layer_0/U"),
which is also their tf.Variable's name and their checkpoint name. Built with `autocast=False`, a
layer computes in its input's dtype. Keras' own layers (Dense, Dropout, BatchNormalization,
Concatenate, Add, ...) go between them.
"""
import random
from typing import List, Optional, Sequence, Tuple

import keras
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from nn import interaction
from nn.mlp import dense_initial_values, mlp_forward
from utils.errors import ConfigError


def _seed(layer: keras.layers.Layer, seed) -> Tuple[int, int]:
    """Two ints: `seed` as given, or drawn from Python's random (keras.utils.set_random_seed seeds it)."""
    if seed is None:
        return random.getrandbits(31), random.getrandbits(31)
    if not isinstance(seed, (list, tuple)) or len(seed) != 2 or not all(isinstance(s, int) for s in seed):
        raise ConfigError(f"layer {layer.name!r}: seed must be two ints, got {seed!r}")
    return int(seed[0]), int(seed[1])


def _constant(value: tf.Tensor):
    """A Keras initializer giving `value` (a float32 tensor of the weight's shape) in the weight's dtype."""
    return lambda shape, dtype=None: tf.cast(value, dtype or value.dtype)


class _WeightGroup(keras.layers.Layer):
    """Weights at Keras paths "<parent>/<name>/<weight>" (a path comes from the layer that makes a
    weight, not from name scopes), made inside the parent's build: (weight name, shape,
    initializer) each. A holder for MLP's and CrossNetwork's weights, never called."""

    def __init__(self, weights: Sequence[Tuple[str, tuple, object]], **kwargs):
        super().__init__(**kwargs)
        self.group = [self.add_weight(shape=shape, initializer=init, name=weight) for weight, shape, init in weights]
        self.built = True


def _in_xla() -> bool:
    """Whether this call is traced inside an XLA-compiled function (tf.function(jit_compile=True))."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _vector_widths(layer: keras.layers.Layer, input_shape, what: str, minimum: int) -> List[int]:
    """The widths of a list of at least `minimum` inputs [b, D_i], or a one-line ConfigError naming the layer."""
    if not isinstance(input_shape, (list, tuple)) or not input_shape or not isinstance(input_shape[0], (list, tuple)):
        raise ConfigError(f"layer {layer.name!r}: takes a list of {what}, got one input of shape {input_shape}")
    if len(input_shape) < minimum:
        raise ConfigError(f"layer {layer.name!r}: takes a list of at least {minimum} {what}, got {len(input_shape)}")
    for i, shape in enumerate(input_shape):
        if len(shape) != 2 or shape[-1] is None:
            raise ConfigError(f"layer {layer.name!r}: input {i} has shape {tuple(shape)}, not [b, D] with D known")
    return [int(shape[-1]) for shape in input_shape]


def _one_width(layer: keras.layers.Layer, widths: Sequence[int], first: str) -> int:
    """The inputs' one width, or a one-line ConfigError naming the layer and the first input that differs."""
    for i, w in enumerate(widths):
        if w != widths[0]:
            raise ConfigError(f"layer {layer.name!r}: its inputs must have one width; input 0 ({first}) has "
                              f"width {widths[0]}, input {i} has width {w}")
    return widths[0]


@keras.saving.register_keras_serializable(package="ranking")
class MLP(keras.layers.Layer):
    """Dense layers: [b, n] -> [b, units[-1]], `activation` after every layer but, when
    `linear_output`, the last (a logit). Weights as nn.mlp.dense_initial_values: kernel i
    Glorot-normal, bias i N(0, 1/units[i]), from `seed` (two ints; None: drawn from Python's
    random, which keras.utils.set_random_seed seeds), at paths "<name>/dense_<i>/kernel",
    ".../bias"; the forward is nn.mlp.mlp_forward. Computes in the layer's compute dtype.
    """

    def __init__(self, units: Sequence[int], activation="relu", linear_output: bool = False, seed=None, **kwargs):
        super().__init__(**kwargs)
        units = list(units)
        if not units or not all(isinstance(u, int) and not isinstance(u, bool) and u > 0 for u in units):
            raise ConfigError(f"layer {self.name!r}: units must be a non-empty list of positive ints, got {units!r}")
        self.units, self.linear_output, self.seed = units, bool(linear_output), _seed(self, seed)
        self.activation = keras.activations.get(activation)

    def build(self, input_shape):
        in_dim = input_shape[-1]
        if len(input_shape) != 2 or in_dim is None:
            raise ConfigError(f"layer {self.name!r}: input shape {tuple(input_shape)}, not [b, n] with n known")
        self.dense = []
        for i, width in enumerate(self.units):
            with tf.init_scope():   # eager values: a first build may run inside a traced call
                kernel, bias = dense_initial_values(in_dim, width, i, self.seed)
            self.dense.append(_WeightGroup([("kernel", (in_dim, width), _constant(kernel)),
                                            ("bias", (width,), _constant(bias))],
                                           name=f"dense_{i}", dtype=self.dtype_policy))
            in_dim = width

    @property
    def kernels(self) -> List[keras.Variable]:
        return [d.group[0] for d in self.dense]

    @property
    def biases(self) -> List[keras.Variable]:
        return [d.group[1] for d in self.dense]

    def call(self, inputs):
        return mlp_forward(inputs, self.kernels, self.biases, self.linear_output, self.activation)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units[-1],)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "linear_output": self.linear_output,
                "activation": keras.activations.serialize(self.activation), "seed": self.seed}


@keras.saving.register_keras_serializable(package="ranking")
class DotInteraction(keras.layers.Layer):
    """DLRM's pairwise dot interaction: [bottom [b, D], e_1 [b, D], ..., e_F [b, D]] ->
    [b, round_up_8(D + (F+1)F/2)]: the bottom output, the dot products of every pair of the F+1
    vectors (strictly lower triangle, row-major: (1,0), (2,0), (2,1), ...), zero padding to a
    multiple of 8 columns. It computes with nn.interaction.DotInteraction (`engine` once
    built): in training, the custom op DotBasedInteract where `kernel` ("auto", "custom", "tf")
    allows it and it loads ("auto" falls back to TensorFlow with one warning line, "custom" is a
    ConfigError at build naming `settings`' first entry, default the layer), except inside an
    XLA-compiled function; inference uses plain TensorFlow ops. Inputs of different widths are a
    ConfigError naming the layer at build.
    """

    def __init__(self, kernel: str = "auto", settings: Optional[Tuple[str, str]] = None, **kwargs):
        super().__init__(**kwargs)
        if kernel not in ("auto", "custom", "tf"):
            raise ConfigError(f"layer {self.name!r}: kernel must be 'auto', 'custom' or 'tf', got {kernel!r}")
        self.kernel = kernel
        self._settings = settings or (f"layer {self.name!r} (kernel='custom')", "kernel='auto'")
        self._dot: Optional[interaction.DotInteraction] = None

    @property
    def engine(self) -> interaction.DotInteraction:
        """The nn.interaction.DotInteraction computing it (its `_op`: the custom op, or None)."""
        return self._dot

    def build(self, input_shape):
        dim = _one_width(self, _vector_widths(self, input_shape, "vectors [b, D] (bottom output, embeddings)", 2),
                         "the bottom output")
        with tf.init_scope():   # its index constants outlive a graph the layer is first built in
            self._dot = interaction.DotInteraction(len(input_shape) - 1, dim, self.kernel, name=self.name,
                                                   settings=self._settings)

    def call(self, inputs, training=None):
        return self._dot(inputs[0], list(inputs[1:]), training=bool(training), xla=_in_xla())

    def compute_output_shape(self, input_shape):
        return input_shape[0][0], interaction.dot_interaction_width(len(input_shape) - 1, input_shape[0][-1])

    def get_config(self):
        return {**super().get_config(), "kernel": self.kernel}


@keras.saving.register_keras_serializable(package="ranking")
class CrossNetwork(keras.layers.Layer):
    """DCNv2's cross network: x0 [b, d] (or a list of [b, d_i], concatenated) -> [b, d], with
    `num_layers` layers x_{l+1} = x0 * (V_l(U_l x_l) + b_l) + x_l, U_l: d -> r, V_l: r -> d for
    `projection_dim` r > 0; full rank x0 * (W_l x_l + b_l) + x_l for r = 0. Weights as
    nn.interaction.cross_initial_values (Glorot-normal, zero biases; `seed` as MLP's), at paths
    "<name>/layer_<l>/U", ".../V" or ".../W", ".../bias"; the forward is
    nn.interaction.cross_forward.
    """

    def __init__(self, num_layers: int, projection_dim: int, seed=None, **kwargs):
        super().__init__(**kwargs)
        for field, value in (("num_layers", num_layers), ("projection_dim", projection_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"layer {self.name!r}: {field} must be a non-negative int, got {value!r}")
        self.num_layers, self.projection_dim, self.seed = num_layers, projection_dim, _seed(self, seed)

    def build(self, input_shape):
        if isinstance(input_shape, (list, tuple)) and input_shape and isinstance(input_shape[0], (list, tuple)):
            dim = sum(_vector_widths(self, input_shape, "vectors [b, d_i]", 1))
        else:
            dim = _vector_widths(self, [input_shape], "vectors [b, d_i]", 1)[0]
        with tf.init_scope():   # eager values: a first build may run inside a traced call
            values = [interaction.cross_initial_values(dim, self.projection_dim, layer, self.seed)
                      for layer in range(self.num_layers)]
        self.cross_layers = [
            _WeightGroup([(matrix, tuple(value.shape), _constant(value)) for matrix, value in values[layer]]
                         + [("bias", (dim,), "zeros")], name=f"layer_{layer}", dtype=self.dtype_policy)
            for layer in range(self.num_layers)]

    @property
    def matrices(self) -> List[List[keras.Variable]]:
        """Per layer its matrices ([W], or [U, V])."""
        return [l.group[:-1] for l in self.cross_layers]

    @property
    def biases(self) -> List[keras.Variable]:
        return [l.group[-1] for l in self.cross_layers]

    def call(self, inputs):
        x0 = tf.concat(list(inputs), axis=1) if isinstance(inputs, (list, tuple)) else inputs
        return interaction.cross_forward(x0, self.matrices, self.biases)

    def compute_output_shape(self, input_shape):
        if isinstance(input_shape, (list, tuple)) and input_shape and isinstance(input_shape[0], (list, tuple)):
            return input_shape[0][0], sum(s[-1] for s in input_shape)
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "num_layers": self.num_layers, "projection_dim": self.projection_dim,
                "seed": self.seed}


@keras.saving.register_keras_serializable(package="ranking")
class FactorizationMachine(keras.layers.Layer):
    """DeepFM's second-order factorization-machine term over F >= 1 embeddings of one width:
    [e_1 [b, D], ..., e_F [b, D]] -> 0.5 * sum_d((sum_f e_fd)^2 - sum_f e_fd^2) [b, 1], the sum
    of <e_f, e_g> over the pairs f < g. No weights. The first-order terms are the features'
    width-1 embeddings (tables with embedding_dim=1) summed, and DeepFM's logit adds the three:

        first = keras.layers.Add()(wide)                      # F x [b, 1] -> [b, 1]
        second = FactorizationMachine()(deep)                 # F x [b, D] -> [b, 1]
        mlp = MLP([400, 400, 1], linear_output=True)(keras.layers.Concatenate()(deep))
        logit = keras.layers.Add()([first, second, mlp])      # [b, 1]

    Inputs of different widths are a ConfigError naming the layer at build.
    """

    def build(self, input_shape):
        _one_width(self, _vector_widths(self, input_shape, "embeddings [b, D]", 1), "the first embedding")

    def call(self, inputs):
        vectors = tf.stack(list(inputs), axis=1)                          # [b, F, D]
        total = tf.reduce_sum(vectors, axis=1)                            # [b, D]
        squares = tf.reduce_sum(tf.square(vectors), axis=1)               # [b, D]
        return 0.5 * tf.reduce_sum(tf.square(total) - squares, axis=1, keepdims=True)

    def compute_output_shape(self, input_shape):
        return input_shape[0][0], 1


@keras.saving.register_keras_serializable(package="ranking")
class TargetAttention(keras.layers.Layer):
    """DIN's attention of a candidate over a history: [q [b, D], k [b, L, D], mask [b, L] bool]
    -> [b, D] = sum_j w_j k_j over the positions the mask keeps.

    The score of position j is DIN's activation unit, an MLP(`units` + [1], `activation`, linear
    output; weights as MLP's from `seed`, at "<name>/unit/...") over [q, k_j, q - k_j, q * k_j]
    ([b, L, 4D]). `normalize` False (DIN's paper: the weights keep the history's intensity): w_j
    the score; True: the scores' softmax over the kept positions. A masked position weighs 0 and
    its item is read as zeros, so whatever it holds (even NaN) changes neither output nor
    gradients; an empty history gives zeros. Outside XLA only the kept positions are computed.

        history = HybridEmbedding(...)(ids)["history"]                        # [b, L, D]
        mask = SequenceMask(L)(ids["history"])                                # [b, L]
        user = TargetAttention(seed=(3, 7))([candidate, history, mask])       # [b, D]
    """

    def __init__(self, units: Sequence[int] = (80, 40), activation="sigmoid", normalize: bool = False,
                 seed=None, **kwargs):
        super().__init__(**kwargs)
        self.units, self.normalize, self.seed = list(units), bool(normalize), _seed(self, seed)
        self.activation = keras.activations.serialize(keras.activations.get(activation))
        self.unit = MLP(self.units + [1], activation=activation, linear_output=True, seed=self.seed, name="unit",
                        dtype=self.dtype_policy)

    def build(self, input_shape):
        if not isinstance(input_shape, (list, tuple)) or len(input_shape) != 3 or \
                not all(isinstance(s, (list, tuple)) for s in input_shape):
            raise ConfigError(f"layer {self.name!r}: takes [candidate [b, D], items [b, L, D], mask [b, L]], "
                              f"got {input_shape}")
        q, k, mask = (tuple(s) for s in input_shape)
        if len(q) != 2 or len(k) != 3 or len(mask) != 2 or q[-1] is None or k[-1] != q[-1] or \
                None not in (k[1], mask[1]) and k[1] != mask[1]:
            raise ConfigError(f"layer {self.name!r}: takes candidate [b, D], items [b, L, D] and mask [b, L] of one "
                              f"D and L, got shapes {q}, {k} and {mask}")
        self.unit.build((None, 4 * q[-1]))

    def call(self, inputs):
        q, k, mask = inputs
        mask = tf.cast(mask, tf.bool)
        if not _in_xla():
            return self._kept_only(q, k, mask)
        k = tf.where(mask[:, :, None], k, tf.zeros([], k.dtype))               # masked items read as zeros
        qq = tf.broadcast_to(q[:, None, :], tf.shape(k))
        x = tf.concat([qq, k, qq - k, qq * k], axis=-1)                      # [b, L, 4D]
        scores = tf.reshape(self.unit(tf.reshape(x, [-1, x.shape[-1]])), tf.shape(mask))   # [b, L]
        if self.normalize:
            scores = tf.nn.softmax(tf.where(mask, scores, tf.constant(-1e4, scores.dtype)), axis=-1)
        weights = tf.where(mask, scores, tf.zeros([], scores.dtype))
        return tf.reduce_sum(weights[:, :, None] * k, axis=1)

    def _kept_only(self, q, k, mask):
        """`call` computed over the n kept positions only ([n, 4D] through the unit, not [b L, 4D]:
        a history's cost is its length, not L's), as outside XLA, whose shapes are static."""
        where = tf.where(mask)                                                 # [n, 2]: sample, position
        sample, samples = where[:, 0], tf.shape(q, out_type=tf.int64)[0]
        kept, qq = tf.gather_nd(k, where), tf.gather(q, sample)                # [n, D] each
        scores = self.unit(tf.concat([qq, kept, qq - kept, qq * kept], axis=-1))[:, 0]   # [n]
        if self.normalize:
            wide = tf.cast(scores, tf.float32)
            e = tf.exp(wide - tf.gather(tf.math.unsorted_segment_max(wide, sample, samples), sample))
            scores = tf.cast(e / tf.gather(tf.math.unsorted_segment_sum(e, sample, samples), sample), scores.dtype)
        return tf.math.unsorted_segment_sum(scores[:, None] * kept, sample, samples)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[0])

    def get_config(self):
        return {**super().get_config(), "units": self.units, "activation": self.activation,
                "normalize": self.normalize, "seed": self.seed}


@keras.saving.register_keras_serializable(package="ranking")
class TransformerBlock(keras.layers.Layer):
    """BST's transformer layer over a sequence: [x [b, L, D], mask [b, L] bool] -> [b, L, D].

    y = LayerNorm(x' + MultiHeadAttention(x', x', x')), out = LayerNorm(y + FFN(y)) (post-norm, as
    BST and the original transformer), FFN = Dense(`ff_units`, relu) -> Dense(D); x' = x plus a
    learned position embedding [L, D] when `max_length` L is given (BST's positions; position 0
    the oldest kept item). Position i attends to the kept positions (and, `causal`, only to those
    at or before i). Masked positions are read as zeros and come out as zeros, so whatever they
    hold changes nothing; `heads` of width D / heads. Weights Glorot-uniform (biases zero) from
    `seed`. Stack blocks, then pool (e.g. TargetAttention with the candidate, or the last
    position).
    """

    def __init__(self, heads: int = 2, ff_units: Optional[int] = None, max_length: Optional[int] = None,
                 causal: bool = False, dropout: float = 0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(heads, int) or heads < 1:
            raise ConfigError(f"layer {self.name!r}: heads must be a positive int, got {heads!r}")
        self.heads, self.ff_units, self.max_length = heads, ff_units, max_length
        self.causal, self.dropout, self.seed = bool(causal), float(dropout), _seed(self, seed)

    def _init(self, k: int):
        return keras.initializers.GlorotUniform(seed=self.seed[0] * 1009 + self.seed[1] * 31 + k)

    def build(self, input_shape):
        if not isinstance(input_shape, (list, tuple)) or len(input_shape) != 2 or \
                not all(isinstance(s, (list, tuple)) for s in input_shape):
            raise ConfigError(f"layer {self.name!r}: takes [x [b, L, D], mask [b, L]], got {input_shape}")
        x, mask = (tuple(s) for s in input_shape)
        dim = x[-1]
        if len(x) != 3 or len(mask) != 2 or dim is None or dim % self.heads or \
                (self.max_length is not None and x[1] not in (None, self.max_length)):
            raise ConfigError(f"layer {self.name!r}: takes x [b, L, D] ({self.heads} heads dividing D"
                              f"{f', L {self.max_length}' if self.max_length else ''}) and mask [b, L], got "
                              f"shapes {x} and {mask}")
        policy = self.dtype_policy
        self.attention = keras.layers.MultiHeadAttention(self.heads, dim // self.heads, dropout=self.dropout,
                                                         kernel_initializer=self._init(0), name="attention",
                                                         dtype=policy)
        self.attention.build(x, x, x)
        self.norms = [keras.layers.LayerNormalization(epsilon=1e-6, name=f"norm_{i}", dtype=policy) for i in (0, 1)]
        for norm in self.norms:
            norm.build(x)
        units = self.ff_units or 4 * dim
        self.ff = [keras.layers.Dense(units, activation="relu", kernel_initializer=self._init(1), name="ff_0",
                                      dtype=policy),
                   keras.layers.Dense(dim, kernel_initializer=self._init(2), name="ff_1", dtype=policy)]
        self.ff[0].build(x)
        self.ff[1].build(x[:-1] + (units,))
        self.positions = None if self.max_length is None else self.add_weight(
            shape=(self.max_length, dim), initializer=self._init(3), name="positions")

    def call(self, inputs, training=None):
        x, mask = inputs
        mask = tf.cast(mask, tf.bool)
        keep = mask[:, :, None]
        x = tf.where(keep, x, tf.zeros([], x.dtype))
        if self.positions is not None:
            x = x + tf.cast(self.positions, x.dtype)[None, :tf.shape(x)[1]]
        allowed = tf.logical_and(keep, mask[:, None, :])                       # [b, L, L]: query, key
        if self.causal:
            length = tf.shape(x)[1]
            allowed = tf.logical_and(allowed, tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0))
        y = self.norms[0](x + self.attention(x, x, x, attention_mask=allowed, training=training))
        out = self.norms[1](y + self.ff[1](self.ff[0](y)))
        return tf.where(keep, out, tf.zeros([], out.dtype))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[0])

    def get_config(self):
        return {**super().get_config(), "heads": self.heads, "ff_units": self.ff_units, "max_length": self.max_length,
                "causal": self.causal, "dropout": self.dropout, "seed": self.seed}


@keras.saving.register_keras_serializable(package="ranking")
class HSTUBlock(keras.layers.Layer):
    """HSTU's layer (Zhai et al., 2024, "Actions Speak Louder than Words"): pointwise aggregated
    attention over a sequence, [x [b, L, D], mask [b, L] bool] or [x, mask, key_bias [b, L, H]]
    -> [b, L, D].

        U, V, Q, K = split(SiLU(LayerNorm(x) W1 + b1))       heads of widths linear_dim, attention_dim
        A = SiLU(Q K^T + rab(j - i) + key_bias[j]) / L  at the allowed (query i, key j), 0 elsewhere
        out = x + (LayerNorm(A V) * U) W2 + b2               (dropout before W2 while training)

    No softmax: the weights are SiLU'd scores divided by `max_length` L (not by the number of
    keys), so a sample's intensity of interest survives. rab is a learned relative position bias
    [2L - 1] shared by the heads (j - i clipped to [-(L - 1), L - 1]). key_bias, when given, is
    added to every query's score of key j, per head (H `heads`, or 1 for all): HSTU's time bias
    as a ranker sees it, from a lookup of each item's time gap to the event (a table of width H,
    as examples/hstu.py does), which is HSTU's bias of the bucketed gap between query and key for
    the candidate's query (its time is the event's); a history item's query sees its keys' gaps
    to the event, not to itself. Position i attends to the kept positions, with `causal` (the
    default, HSTU's) only to those at or before it. Masked positions are read as zeros and come out as zeros. LayerNorms
    without scale and centre, as HSTU's; W1, W2 Glorot-uniform from `seed`, biases zero.
    """

    def __init__(self, max_length: int, heads: int = 2, attention_dim: Optional[int] = None,
                 linear_dim: Optional[int] = None, causal: bool = True, dropout: float = 0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        for name, value in (("max_length", max_length), ("heads", heads), ("attention_dim", attention_dim or 1),
                            ("linear_dim", linear_dim or 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"layer {self.name!r}: {name} must be a positive int, got {value!r}")
        self.max_length, self.heads, self.attention_dim, self.linear_dim = max_length, heads, attention_dim, linear_dim
        self.causal, self.dropout, self.seed = bool(causal), float(dropout), _seed(self, seed)

    def _init(self, k: int):
        return keras.initializers.GlorotUniform(seed=self.seed[0] * 1013 + self.seed[1] * 37 + k)

    def build(self, input_shape):
        if not isinstance(input_shape, (list, tuple)) or len(input_shape) not in (2, 3) or \
                not all(isinstance(s, (list, tuple)) for s in input_shape):
            raise ConfigError(f"layer {self.name!r}: takes [x [b, L, D], mask [b, L]] or [x, mask, key_bias "
                              f"[b, L, heads]], got {input_shape}")
        x, mask = (tuple(s) for s in input_shape[:2])
        bias = tuple(input_shape[2]) if len(input_shape) == 3 else None
        if len(x) != 3 or len(mask) != 2 or x[-1] is None or x[1] not in (None, self.max_length) or \
                (bias is not None and (len(bias) != 3 or bias[1] not in (None, self.max_length) or
                                       bias[2] not in (1, self.heads))):
            raise ConfigError(f"layer {self.name!r}: takes x [b, L, D] (L {self.max_length}) and mask [b, L] (and "
                              f"key_bias [b, L, {self.heads} or 1]), got shapes "
                              f"{', '.join(str(tuple(s)) for s in input_shape)}")
        dim = x[-1]
        self.qk_dim = self.attention_dim or max(dim // self.heads, 1)
        self.v_dim = self.linear_dim or max(dim // self.heads, 1)
        policy = self.dtype_policy
        self.norms = [keras.layers.LayerNormalization(epsilon=1e-6, center=False, scale=False, name=f"norm_{i}",
                                                      dtype=policy) for i in (0, 1)]
        self.norms[0].build(x)
        self.norms[1].build(x[:-1] + (self.heads * self.v_dim,))
        self.uvqk = keras.layers.Dense(2 * self.heads * (self.v_dim + self.qk_dim), kernel_initializer=self._init(0),
                                       name="uvqk", dtype=policy)
        self.uvqk.build(x)
        self.out = keras.layers.Dense(dim, kernel_initializer=self._init(1), name="out", dtype=policy)
        self.out.build(x[:-1] + (self.heads * self.v_dim,))
        self.bias = self.add_weight(shape=(2 * self.max_length - 1,), initializer="zeros", name="relative_bias")
        self.drop = keras.layers.Dropout(self.dropout, seed=self.seed[0] * 7 + self.seed[1], dtype=policy)

    def call(self, inputs, training=None):
        x, mask = inputs[:2]
        mask = tf.cast(mask, tf.bool)
        keep = mask[:, :, None]
        x = tf.where(keep, x, tf.zeros([], x.dtype))
        length, h = self.max_length, self.heads
        u, v, q, k = tf.split(tf.nn.silu(self.uvqk(self.norms[0](x))),
                              [h * self.v_dim, h * self.v_dim, h * self.qk_dim, h * self.qk_dim], axis=-1)

        def by_head(t, width):   # [b, L, h w] -> [b, h, L, w]
            return tf.transpose(tf.reshape(t, [-1, length, h, width]), [0, 2, 1, 3])
        scores = tf.matmul(by_head(q, self.qk_dim), by_head(k, self.qk_dim), transpose_b=True)   # [b, h, L, L]
        offsets = tf.range(length)[None, :] - tf.range(length)[:, None] + length - 1            # j - i + L - 1
        scores = scores + tf.cast(tf.gather(self.bias, offsets), scores.dtype)
        if len(inputs) == 3:   # key_bias [b, L, H or 1] -> [b, H or 1, 1 (every query), L]
            scores = scores + tf.cast(tf.transpose(inputs[2], [0, 2, 1]), scores.dtype)[:, :, None, :]
        allowed = tf.logical_and(keep, mask[:, None, :])                                       # [b, L, L]
        if self.causal:
            allowed = tf.logical_and(allowed, tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0))
        weights = tf.where(allowed[:, None], tf.nn.silu(scores), tf.zeros([], scores.dtype)) / length
        attended = tf.reshape(tf.transpose(tf.matmul(weights, by_head(v, self.v_dim)), [0, 2, 1, 3]),
                              [-1, length, h * self.v_dim])
        out = x + self.out(self.drop(self.norms[1](attended) * u, training=training))
        return tf.where(keep, out, tf.zeros([], out.dtype))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[0])

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length, "heads": self.heads,
                "attention_dim": self.attention_dim, "linear_dim": self.linear_dim, "causal": self.causal,
                "dropout": self.dropout, "seed": self.seed}
