"""An in-process KServe v2 frontend (`deployment/serve.py --frontend=native`): HTTP/REST (JSON
with the binary-tensor extension) and gRPC (Triton's GRPCInferenceService, from the protos that
tritonclient ships) served by this process, which calls the model itself. Triton's frontend
instead hands each request to a Python-backend stub process that passes it over shared memory and
ZeroMQ to the serving process and back, about 3 ms a request (docs/benchmarks.md).

What tritonclient's clients call is served: health (live, ready), server metadata, model
metadata, config and readiness, and inference. Requests are checked as Triton checks them
(input count and names, an input named twice, requested outputs, dtypes, shapes, batch size, byte
sizes and value counts) with Triton's messages and status codes; the model's own refusals
(errors.BadRequest) get 400 / INVALID_ARGUMENT with their message. Only the requested outputs
are returned (all when none is named). A multi-hot feature may come as variable-length ids with
their lengths instead of its padded columns (`RaggedInput`: optional inputs, padded into the
columns before the model sees them). Each gRPC request runs on a thread of a pool, each HTTP
connection on its own thread; requests are not batched together (the model releases Python's
lock while it computes).

Each inference request is counted once (metrics.py: by protocol and status, with the
time the successful ones took in `ServedModel.run`), served as Prometheus metrics on a port of
their own when `serving` is given one.

Both protocols keep `guarded_http.Safeguards` (docs/deployment.md, "What the server trusts"): TLS
and a bearer token when given (HTTP: checked before the body is read; health, live and ready,
open without it), bounds on a request's body after decompression (gzip and deflate are
decompressed as a stream, stopped at the bound: 413 / RESOURCE_EXHAUSTED), on its headers and on
connections or calls in flight, and a read timeout. Every malformed request gets an error status
(never a closed connection without one), counted as refused; an unexpected error answers 500 /
INTERNAL, counted as failed.

A request's values are counted before any Python object or array is made of them, against what
the model's largest request holds (`ServedModel.max_values`: max_batch_size x the sum over inputs
of prod(dims)). gRPC: a message is bounded by the largest ModelInferRequest (`max_message_bytes`:
each value in its widest encoding, 64 KiB more; gRPC stops decompressing there,
RESOURCE_EXHAUSTED); the len() of the inputs' contents fields, summed, past max_values is
RESOURCE_EXHAUSTED, and each is compared with its shape (INVALID_ARGUMENT) before it is read into
an array. HTTP: a request's JSON is bounded by its commas and '[' (at least the values its lists
hold: 413 past `max_json_marks`) before it is parsed, then each input's values, flattened, are
compared with its shape. Values sent as JSON must be of the input's kind: integers in its range
for integer inputs (1.7, "1", 2**64, true refused), numbers for float inputs (true refused),
booleans for BOOL inputs.
"""
import dataclasses
import itertools
import json
import math
import os
import re
import signal
import threading
import time
import zlib
from concurrent import futures
from contextlib import contextmanager, nullcontext
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from deployment.serving.errors import BadRequest
from deployment.serving.guarded_http import GuardedHandler, Safeguards, http_serving
from deployment.serving.metrics import Metrics

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 413, "INTERNAL": 500}
OUTCOME = {"INVALID_ARGUMENT": "refused", "NOT_FOUND": "refused", "RESOURCE_EXHAUSTED": "refused",
           "INTERNAL": "failed"}   # metrics' status
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}   # Content-Encoding -> zlib's wbits
OPEN_GRPC = ("/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady")
DATATYPES = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
             "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64, "FP16": np.float16,
             "FP32": np.float32, "FP64": np.float64}
GRPC_CONTENTS = {   # datatype -> (InferTensorContents' field, the numpy dtype of its values)
    "BOOL": ("bool_contents", np.bool_), "INT8": ("int_contents", np.int32), "INT16": ("int_contents", np.int32),
    "INT32": ("int_contents", np.int32), "INT64": ("int64_contents", np.int64), "UINT8": ("uint_contents", np.uint32),
    "UINT16": ("uint_contents", np.uint32), "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64), "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64)}
JSON_STRUCTURE = 4096      # commas and '[' a request's JSON may hold besides its values' (shapes, parameters)
GRPC_STRUCTURE = 64 << 10  # bytes a ModelInferRequest may hold besides its values (names, shapes, parameters)
SERVER = {"name": "dlrm-native", "version": "1", "extensions": ["binary_tensor_data", "model_configuration"]}
VERSION = "1"


class RequestError(Exception):
    """A refused request: `code` is a gRPC status name (a key of HTTP_STATUS)."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, e: Exception) -> "RequestError":
        """`e` itself if a RequestError, else an unexpected error as INTERNAL, in one line: the
        server goes on, the client gets the line."""
        if isinstance(e, RequestError):
            return e
        lines = [line for line in str(e).splitlines() if line.strip()]
        return cls(f"{type(e).__name__}: {lines[0] if lines else ''}", "INTERNAL")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output: its name, numpy dtype and dims without the batch dimension."""
    name: str
    dtype: type
    dims: Tuple[int, ...]

    @property
    def datatype(self) -> str:
        return next(k for k, v in DATATYPES.items() if v == self.dtype)


@dataclasses.dataclass(frozen=True)
class Values:
    """An input's values in a protobuf repeated field (its len() costs nothing), read as `dtype` once
    their count is checked; `dtype` None: the input's datatype has no such field."""
    field: Sequence
    dtype: Optional[type]


@dataclasses.dataclass(frozen=True)
class RaggedInput:
    """A multi-hot feature that a request may send as variable-length ids instead of its padded
    columns: input `name` [N] INT64 (every sample's ids, concatenated in sample order, each sample's
    oldest first) with input `<name>_lengths` [B] INT64 (each sample's count, 0 to end - start,
    summing to N). They fill columns [start, end) of input `into` (padded with -1), which the
    request then sends without those columns."""
    name: str
    into: str
    start: int
    end: int

    @property
    def lengths(self) -> str:
        return f"{self.name}_lengths"


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A model as served: `infer(*inputs as [B, *dims] arrays, in `inputs` order) -> {output name:
    [B, *dims] array}`, raising BadRequest for a request it refuses. `ragged`: the optional
    variable-length forms of some inputs' columns (RaggedInput)."""
    name: str
    inputs: Sequence[TensorSpec]
    outputs: Sequence[TensorSpec]
    max_batch_size: int
    infer: Callable[..., Dict[str, np.ndarray]]
    ragged: Sequence[RaggedInput] = ()

    def metadata(self) -> dict:
        tensors = lambda specs: [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims]}  # noqa: E731
                                 for t in specs]
        optional = [{"name": n, "datatype": "INT64", "shape": [-1]} for r in self.ragged for n in (r.name, r.lengths)]
        return {"name": self.name, "versions": [VERSION], "platform": "native",
                "inputs": tensors(self.inputs) + optional, "outputs": tensors(self.outputs)}

    def config(self) -> dict:
        """Triton's ModelConfig (its JSON form) of the served model."""
        tensors = lambda specs: [{"name": t.name, "data_type": f"TYPE_{t.datatype}", "dims": list(t.dims)}  # noqa
                                 for t in specs]
        optional = [{"name": r.name, "data_type": "TYPE_INT64", "dims": [-1], "optional": True,
                     "allow_ragged_batch": True} for r in self.ragged]
        optional += [{"name": r.lengths, "data_type": "TYPE_INT64", "dims": [1], "optional": True}
                     for r in self.ragged]
        return {"name": self.name, "platform": "native", "backend": "native", "max_batch_size": self.max_batch_size,
                "input": tensors(self.inputs) + optional, "output": tensors(self.outputs)}

    @property
    def max_values(self) -> int:
        """The values of the largest request: max_batch_size x the sum over inputs of prod(dims), and
        of each ragged input's lengths (its ids take the place of columns)."""
        return self.max_batch_size * (sum(math.prod(t.dims) for t in self.inputs) + len(self.ragged))

    @property
    def max_json_marks(self) -> int:
        """Commas and '[' in the JSON of the largest request, its values nested as their shape (a list of k
        values holds k - 1 commas), a ragged input's lengths, and JSON_STRUCTURE more."""
        shapes = [(self.max_batch_size, *t.dims) for t in self.inputs] + [(self.max_batch_size,)] * len(self.ragged)
        return JSON_STRUCTURE + sum(math.prod(s) + sum(math.prod(s[:k]) for k in range(len(s))) for s in shapes)

    @property
    def max_message_bytes(self) -> int:
        """Bytes of the largest ModelInferRequest, each value in its widest encoding (an integer as a
        10-byte varint), and GRPC_STRUCTURE more."""
        return GRPC_STRUCTURE + self.max_batch_size * (10 * len(self.ragged) + sum(
            math.prod(t.dims) * (10 if np.issubdtype(t.dtype, np.integer) else np.dtype(t.dtype).itemsize)
            for t in self.inputs))

    def run(self, tensors: Sequence[Tuple[str, str, List[int], object]], requested: Optional[Sequence[str]],
            request_id: str = "") -> Dict[str, np.ndarray]:
        """tensors: (name, datatype, shape, data: bytes, Values or a JSON list of values) per input;
        requested: output names (None: all) -> {name: array}, checked as Triton checks a request."""
        prefix = f"[request id: {request_id or '<id_unknown>'}] "
        names = [t[0] for t in tensors]
        expected = [t.name for t in self.inputs]
        optional = {n for r in self.ragged for n in (r.name, r.lengths)}
        for k, name in enumerate(names):
            if name in names[:k]:
                raise RequestError(f"{prefix}input '{name}' already exists in request for model '{self.name}'")
        count = len(expected) + len(optional.intersection(names))
        if len(tensors) != count:
            missing = ",".join(f"'{n}'" for n in expected if n not in names)
            raise RequestError(f"{prefix}expected {count} inputs but got {len(tensors)} inputs for model "
                               f"'{self.name}'. Got input(s) [{','.join(repr(n) for n in names)}], but missing "
                               f"required input(s) [{missing}]. Please provide all required input(s).")
        for name in names:
            if name not in expected and name not in optional:
                raise RequestError(f"unexpected inference input '{name}' for model '{self.name}'")
        ragged = sorted((r for r in self.ragged if r.name in names or r.lengths in names), key=lambda r: r.start)
        for r in ragged:
            if r.name not in names or r.lengths not in names:
                raise RequestError(f"{prefix}input '{r.name}' (variable-length ids) and '{r.lengths}' (each "
                                   f"sample's count) come together, for model '{self.name}'")
        outputs = {t.name for t in self.outputs}
        for name in requested or ():
            if name not in outputs:
                raise RequestError(f"unexpected inference output '{name}' for model '{self.name}'")
        given = {t[0]: t[1:] for t in tensors}
        dims = {t.name: t.dims for t in self.inputs}
        for r in ragged:   # `into` comes without r's columns
            dims[r.into] = (dims[r.into][0] - (r.end - r.start),)
        flat = [TensorSpec(r.name, np.int64, ()) for r in ragged]
        for spec in flat:
            datatype, shape, _ = given[spec.name]
            if datatype != spec.datatype or len(shape) != 1:
                raise RequestError(f"{prefix}inference input '{spec.name}' must be INT64 of shape [N] (every "
                                   f"sample's ids), got {datatype} {shape} for model '{self.name}'")
        batch = None
        for spec in [*self.inputs, *(TensorSpec(r.lengths, np.int64, ()) for r in ragged)]:
            datatype, shape, _ = given[spec.name]
            if datatype != spec.datatype:
                raise RequestError(f"{prefix}inference input '{spec.name}' data-type is '{datatype}', but model "
                                   f"'{self.name}' expects '{spec.datatype}'")
            size = shape[0] if shape else None
            if batch is not None and size != batch:
                raise RequestError(f"{prefix}input '{spec.name}' batch size does not match other inputs for "
                                   f"'{self.name}'")
            batch = size
        if not batch:
            raise RequestError(f"{prefix}inference request batch-size must be >= 1 for '{self.name}'")
        if batch > self.max_batch_size:
            raise RequestError(f"{prefix}inference request batch-size must be <= {self.max_batch_size} for "
                               f"'{self.name}'")
        arrays = {}
        for spec in [*self.inputs, *(TensorSpec(r.lengths, np.int64, (1,)) for r in ragged)]:
            _, shape, data = given[spec.name]
            if tuple(shape[1:]) not in (dims.get(spec.name, spec.dims), () if spec.name in optional else None):
                raise RequestError(f"{prefix}unexpected shape for input '{spec.name}' for model '{self.name}'. "
                                   f"Expected [-1,{','.join(map(str, dims.get(spec.name, spec.dims)))}], got "
                                   f"[{','.join(map(str, shape))}]")
            arrays[spec.name] = _array(spec, shape, data, self.name, prefix)
        for r, spec in zip(ragged, flat):
            _, shape, data = given[r.name]
            arrays[r.into] = _filled(r, arrays[r.into], _array(spec, shape, data, self.name, prefix),
                                     arrays.pop(r.lengths).reshape(-1), f"{prefix}model '{self.name}'")
        arrays = [arrays[t.name] for t in self.inputs]
        try:
            result = self.infer(*arrays)
        except BadRequest as e:
            raise RequestError(str(e))
        except Exception as e:
            raise RequestError.of(e)
        return {t.name: result[t.name] for t in self.outputs if requested is None or t.name in requested}


def _filled(r: RaggedInput, into: np.ndarray, ids: np.ndarray, lengths: np.ndarray, where: str) -> np.ndarray:
    """`into` [B, W - width] with r's ids [N] (lengths [B]) as its columns [start, end), padded with -1."""
    width = r.end - r.start
    if lengths.size and (lengths.min() < 0 or lengths.max() > width):
        raise RequestError(f"{where}: input '{r.lengths}': each sample's count must be 0 to {width} (the "
                           f"feature's columns), got {lengths.min()} to {lengths.max()}")
    if int(lengths.sum()) != ids.size:
        raise RequestError(f"{where}: input '{r.lengths}' sums to {int(lengths.sum())}, but '{r.name}' holds "
                           f"{ids.size} ids")
    columns = np.full((len(lengths), width), -1, np.int64)
    starts = np.cumsum(lengths) - lengths
    columns[np.repeat(np.arange(len(lengths)), lengths), np.arange(ids.size) - np.repeat(starts, lengths)] = ids
    return np.concatenate([into[:, :r.start], columns, into[:, r.start:]], axis=1)


def _array(spec: TensorSpec, shape: List[int], data, model: str, prefix: str) -> np.ndarray:
    """An input's data (raw bytes, Values, or a JSON list of values, nested or not) as an array of
    `shape`, its count compared with the shape's before any array is made."""
    count = math.prod(shape)
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) != count * np.dtype(spec.dtype).itemsize:
            raise RequestError(f"{prefix}input byte size mismatch for input '{spec.name}' for model '{model}'. "
                               f"Expected {count * np.dtype(spec.dtype).itemsize}, got {len(data)}")
        return np.frombuffer(data, spec.dtype).reshape(shape)
    where = f"{prefix}input '{spec.name}' for model '{model}'"
    integers, booleans = np.issubdtype(spec.dtype, np.integer), spec.dtype == np.bool_
    what = f"{where}: values must be " + (f"integers in {spec.datatype}'s range" if integers else
                                          "booleans" if booleans else "numbers")
    if isinstance(data, Values):
        if data.dtype is None:
            raise RequestError(f"{where}: {spec.datatype} values must be sent in raw_input_contents")
        size = len(data.field)
    else:
        data, types = _flattened(data, where)
        if not types <= ({int} if integers else {bool} if booleans else {int, float}):   # type(True) is bool
            raise RequestError(what)
        size = len(data)
    if size != count:
        raise RequestError(f"{prefix}unexpected number of elements for input '{spec.name}' for model '{model}'. "
                           f"Expected {count}, got {size}")
    if isinstance(data, Values):
        data = np.fromiter(data.field, data.dtype, count)
    if integers and count:
        low, high = (data.min(), data.max()) if isinstance(data, np.ndarray) else (min(data), max(data))
        if low < np.iinfo(spec.dtype).min or high > np.iinfo(spec.dtype).max:
            raise RequestError(what)
    try:
        return np.asarray(data, spec.dtype).reshape(shape)
    except OverflowError:   # an integer past a float's range
        raise RequestError(what)


def _flattened(data, where: str) -> Tuple[list, set]:
    """A JSON value's values, nested lists flattened in row-major order, and their types."""
    values = data if type(data) is list else [data]
    types = set(map(type, values))
    while list in types:
        if len(types) > 1:
            raise RequestError(f"{where}: lists and values side by side in a list")
        values = list(itertools.chain.from_iterable(values))
        types = set(map(type, values))
    return values, types


def _run(model: ServedModel, metrics: Metrics, protocol: str, *request) -> Dict[str, np.ndarray]:
    """`model.run(*request)`, counted in `metrics` when it succeeds (its refusals are counted
    where they are caught, with those raised before it)."""
    start = time.perf_counter()
    out = model.run(*request)
    metrics.observe(protocol, "success", time.perf_counter() - start, len(next(iter(out.values()))))
    return out


def _unknown_model(name: str) -> RequestError:
    return RequestError(f"Request for unknown model: '{name}' is not found", "NOT_FOUND")


def _grpc_servicer(model: ServedModel, metrics: Metrics):
    """Triton's GRPCInferenceService over `model` (what is not here answers UNIMPLEMENTED)."""
    import grpc
    from tritonclient.grpc import model_config_pb2 as config_pb2, service_pb2, service_pb2_grpc

    def aborting(method):
        def call(self, request, context):
            try:
                return method(self, request, context)
            except RequestError as e:
                context.abort(grpc.StatusCode[e.code], str(e))
        return call

    def known(request) -> ServedModel:
        if request.name != model.name or request.version not in ("", VERSION):
            raise _unknown_model(request.name)
        return model

    def tensors(specs, kind):
        return [kind(name=t.name, data_type=config_pb2.DataType.Value(f"TYPE_{t.datatype}"), dims=list(t.dims))
                for t in specs]

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            return service_pb2.ServerLiveResponse(live=True)

        def ServerReady(self, request, context):
            return service_pb2.ServerReadyResponse(ready=True)

        def ModelReady(self, request, context):
            return service_pb2.ModelReadyResponse(ready=request.name == model.name and
                                                  request.version in ("", VERSION))

        def ServerMetadata(self, request, context):
            return service_pb2.ServerMetadataResponse(**SERVER)

        @aborting
        def ModelMetadata(self, request, context):
            meta = known(request).metadata()
            tensor = service_pb2.ModelMetadataResponse.TensorMetadata
            return service_pb2.ModelMetadataResponse(
                name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                inputs=[tensor(**t) for t in meta["inputs"]], outputs=[tensor(**t) for t in meta["outputs"]])

        @aborting
        def ModelConfig(self, request, context):
            m = known(request)
            return service_pb2.ModelConfigResponse(config=config_pb2.ModelConfig(
                name=m.name, platform="native", backend="native", max_batch_size=m.max_batch_size,
                input=tensors(m.inputs, config_pb2.ModelInput) + [
                    config_pb2.ModelInput(name=t["name"], data_type=config_pb2.DataType.Value(t["data_type"]),
                                          dims=t["dims"], optional=True, allow_ragged_batch=t.get(
                                              "allow_ragged_batch", False))
                    for t in m.config()["input"][len(m.inputs):]],
                output=tensors(m.outputs, config_pb2.ModelOutput)))

        @aborting
        def ModelInfer(self, request, context):
            try:
                if request.model_name != model.name or request.model_version not in ("", VERSION):
                    raise _unknown_model(request.model_name)
                raw = request.raw_input_contents
                if raw and len(raw) != len(request.inputs):
                    raise RequestError(f"expected {len(request.inputs)} raw input contents, got {len(raw)}")
                given, values = [], 0
                for i, t in enumerate(request.inputs):
                    if raw:
                        data = raw[i]
                    else:
                        field, dtype = GRPC_CONTENTS.get(t.datatype, ("bytes_contents", None))
                        data = Values(getattr(t.contents, field), dtype)
                        values += len(data.field)
                        if values > model.max_values:
                            raise RequestError(f"input '{t.name}' brings the request to {values} values, more than "
                                               f"the {model.max_values} of model '{model.name}''s largest "
                                               f"(max_batch_size {model.max_batch_size})", "RESOURCE_EXHAUSTED")
                    given.append((t.name, t.datatype, list(t.shape), data))
                out = _run(model, metrics, "grpc", given, [o.name for o in request.outputs] or None, request.id)
            except Exception as e:
                error = RequestError.of(e)
                metrics.observe("grpc", OUTCOME[error.code])
                raise error
            specs = {t.name: t for t in model.outputs}
            return service_pb2.ModelInferResponse(
                model_name=model.name, model_version=VERSION, id=request.id,
                outputs=[service_pb2.ModelInferResponse.InferOutputTensor(
                    name=k, datatype=specs[k].datatype, shape=list(v.shape)) for k, v in out.items()],
                raw_output_contents=[np.ascontiguousarray(v, specs[k].dtype).tobytes() for k, v in out.items()])

    return Servicer(), service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server


class _Malformed:
    """What _grpc_guard's deserializer gives for a message that does not parse."""

    def __init__(self, error: Exception):
        self.error = error


def _grpc_guard(safeguards: Safeguards, metrics: Metrics):
    """A gRPC interceptor keeping `safeguards` in front of every method, each of its refusals and
    gRPC's own counted as refused in `metrics`: a call but OPEN_GRPC's whose `authorization`
    metadata is not `Bearer <token>` (with a token) gets UNAUTHENTICATED; one over max_connections
    calls in flight RESOURCE_EXHAUSTED; a message that does not parse INVALID_ARGUMENT; one gRPC
    cancels before its message arrives (a message over max_request_bytes or metadata over
    max_header_bytes: gRPC answers RESOURCE_EXHAUSTED; or the client gave up) is counted too. Each
    method runs as a stream-unary one (the same on the wire), so that it runs even when its message
    never arrives. Refusals run on a thread of their own, not waiting for the calls in flight."""
    import grpc
    lock, in_flight = threading.Lock(), [0]
    refusals = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpc-refusals")

    def refusal(code: str, message: str):
        metrics.observe("grpc", "refused")

        def refuse(requests, context):   # unread
            context.abort(grpc.StatusCode[code], message)
        refuse.experimental_thread_pool = refusals   # grpc's: the pool this method runs on
        return grpc.stream_unary_rpc_method_handler(refuse)

    def parsing(deserialize):
        def parse(data: bytes):
            try:
                return deserialize(data) if deserialize else data
            except Exception as e:   # protobuf's DecodeError, among others
                return _Malformed(e)
        return parse

    def guarded(behavior):
        def call(requests, context):
            try:
                try:
                    request = next(requests)
                except grpc.RpcError:   # cancelled: gRPC has answered the client (or the client left)
                    metrics.observe("grpc", "refused")
                    raise
                except StopIteration:
                    request = _Malformed(ValueError("no request message"))
                if isinstance(request, _Malformed):
                    metrics.observe("grpc", "refused")
                    error = request.error
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"malformed request: {type(error).__name__}: {error}")
                return behavior(request, context)
            finally:
                with lock:
                    in_flight[0] -= 1
        return call

    class Guard(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            if details.method not in OPEN_GRPC and not safeguards.authorized(
                    dict(details.invocation_metadata or ()).get("authorization")):
                return refusal("UNAUTHENTICATED", "missing or wrong bearer token (authorization metadata: Bearer "
                                                  "<token>)")
            handler = continuation(details)
            if handler is None or handler.unary_unary is None:   # an unknown method: UNIMPLEMENTED
                return handler
            with lock:
                full = in_flight[0] >= safeguards.max_connections
                in_flight[0] += not full
            if full:
                return refusal("RESOURCE_EXHAUSTED", f"more than {safeguards.max_connections} calls in flight")
            return grpc.stream_unary_rpc_method_handler(guarded(handler.unary_unary),
                                                        parsing(handler.request_deserializer),
                                                        handler.response_serializer)

    return Guard()


def _decompressed(body: bytes, encoding: Optional[str], limit: int) -> bytes:
    """`body` decoded as its Content-Encoding says (none, gzip or deflate), as a stream stopped at
    `limit` bytes: RequestError (RESOURCE_EXHAUSTED) past it, INVALID_ARGUMENT if it is not whole."""
    if encoding in (None, "", "identity"):
        return body
    if encoding not in ENCODINGS:
        raise RequestError(f"unsupported Content-Encoding {encoding[:40]!r}: gzip, deflate or none")
    stream = zlib.decompressobj(ENCODINGS[encoding])
    try:
        out = stream.decompress(body, limit + 1)
    except zlib.error as e:
        raise RequestError(f"malformed {encoding} body: {e}")
    if len(out) > limit:
        raise RequestError(f"request body exceeds {limit} bytes once decompressed ({encoding})", "RESOURCE_EXHAUSTED")
    if not stream.eof or stream.unused_data:
        raise RequestError(f"malformed {encoding} body: {'truncated' if not stream.eof else 'data after its end'}")
    return out


def _checked_request(request) -> Tuple[dict, list]:
    """A KServe v2 JSON request with its fields of the right types: (the request with every
    `parameters` a dict, the requested outputs); RequestError naming the first field that is not."""
    def check(ok: bool, what: str):
        if not ok:
            raise RequestError(f"malformed inference request: {what}")

    def parameters(doc: dict, where: str) -> dict:
        value = doc.get("parameters")
        check(isinstance(value, (dict, type(None))), f"{where}'s parameters must be an object")
        return dict(doc, parameters=value or {})

    check(isinstance(request, dict), "not a JSON object")
    request = parameters(request, "the request")
    check(isinstance(request.get("inputs"), list), "'inputs' must be a list")
    wanted = [] if request.get("outputs") is None else request["outputs"]
    check(isinstance(wanted, list), "'outputs' must be a list")
    inputs, outputs = [], []
    for kind, tensors, out in (("inputs", request["inputs"], inputs), ("outputs", wanted, outputs)):
        for i, t in enumerate(tensors):
            check(isinstance(t, dict) and isinstance(t.get("name"), str), f"{kind}[{i}] must be an object with "
                                                                           "a string 'name'")
            out.append(parameters(t, f"{kind}[{i}]"))
    for i, t in enumerate(inputs):
        check(isinstance(t.get("datatype"), str), f"inputs[{i}] ('{t['name']}') needs a string 'datatype'")
        shape = t.get("shape")
        check(isinstance(shape, list) and all(type(d) is int and 0 <= d < 1 << 31 for d in shape),
              f"inputs[{i}] ('{t['name']}')'s shape must be a list of non-negative integers")
        n = t["parameters"].get("binary_data_size")
        check(n is None and "data" in t or type(n) is int and n >= 0,
              f"inputs[{i}] ('{t['name']}') needs 'data' or a non-negative integer binary_data_size")
    return dict(request, inputs=inputs), outputs


def _marks(text: bytes) -> int:
    """The commas and '[' in `text`, at least the values its JSON lists hold, counted a MiB at a time
    (~0.3 ms a MiB; json.loads takes ~40)."""
    chars, marks = np.frombuffer(text, np.uint8), 0
    for start in range(0, len(chars), 1 << 20):
        block = chars[start:start + (1 << 20)]
        marks += int(np.count_nonzero(block == ord(","))) + int(np.count_nonzero(block == ord("[")))
    return marks


_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/config|/infer)?$")


class _HttpHandler(GuardedHandler):
    """KServe v2 over HTTP/1.1 (kept-alive connections); `model` and `metrics` are set on a subclass."""
    open_paths = ("/v2/health/live", "/v2/health/ready")
    model: ServedModel = None
    metrics: Metrics = None

    def _json(self, doc: dict, status: int = 200):
        self.reply(status, json.dumps(doc).encode())

    def _route(self, method: str):
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if method == "GET" and path in self.open_paths:
                return self.reply(200)
            if method == "GET" and path == "/v2":
                return self._json(SERVER)
            match = _PATH.match(path)
            if not match or (method == "POST") != (match.group(3) == "/infer"):
                return self._json({"error": "Not Found"}, 404)
            name, version, action = match.groups()
            if name != self.model.name or version not in (None, VERSION):
                if action == "/ready":
                    return self.reply(400)
                raise _unknown_model(name)
            if action == "/ready":
                return self.reply(200)
            if action == "/config":
                return self._json(self.model.config())
            if action is None:
                return self._json(self.model.metadata())
            self._infer(self.body)
        except Exception as e:
            error = RequestError.of(e)
            if method == "POST":   # an inference request, the only POST that gets this far
                self.metrics.observe("http", OUTCOME[error.code])
            self._json({"error": str(error)}, HTTP_STATUS[error.code])

    def _infer(self, body: bytes):
        body = _decompressed(body, self.headers.get("Content-Encoding"), self.server.safeguards.max_request_bytes)
        header = self.headers.get("Inference-Header-Content-Length")
        try:
            size = len(body) if header is None else int(header)
            if not 0 <= size <= len(body):
                raise ValueError(f"Inference-Header-Content-Length {size} is not within the body's {len(body)} bytes")
            text = body[:size]
            marks = _marks(text)
            if marks > self.model.max_json_marks:
                raise RequestError(f"inference request holds up to {marks} JSON values (its commas and '['), more "
                                   f"than the {self.model.max_json_marks} of model '{self.model.name}''s largest "
                                   f"(max_batch_size {self.model.max_batch_size})", "RESOURCE_EXHAUSTED")
            request = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise RequestError(f"malformed inference request: {type(e).__name__}: {e}")
        request, wanted = _checked_request(request)
        binary, offset, given = memoryview(body), size, []
        for t in request["inputs"]:
            n = t["parameters"].get("binary_data_size")
            if n is None:
                data = t["data"]
            else:
                data, offset = binary[offset:offset + n], offset + n
            given.append((t["name"], t["datatype"], t["shape"], data))
        out = _run(self.model, self.metrics, "http", given, [o["name"] for o in wanted] or None,
                   str(request.get("id", "")))
        default = bool(request["parameters"].get("binary_data_output", False))
        as_binary = {o["name"]: bool(o["parameters"].get("binary_data", default)) for o in wanted}
        specs = {t.name: t for t in self.model.outputs}
        tensors, blobs = [], []
        for name, value in out.items():
            tensor = {"name": name, "datatype": specs[name].datatype, "shape": list(value.shape)}
            if as_binary.get(name, default):
                blobs.append(np.ascontiguousarray(value, specs[name].dtype).tobytes())
                tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
            else:
                tensor["data"] = value.reshape(-1).tolist()
            tensors.append(tensor)
        response = {"model_name": self.model.name, "model_version": VERSION, "outputs": tensors}
        if "id" in request:
            response["id"] = request["id"]
        head = json.dumps(response).encode()
        if not blobs:
            return self.reply(200, head)
        self.reply(200, b"".join([head, *blobs]), {"Content-Type": "application/octet-stream",
                                                  "Inference-Header-Content-Length": len(head)})

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")


@contextmanager
def serving(model: ServedModel, address: str, http_port: int, grpc_port: int, threads: int = 8,
            metrics_port: Optional[int] = None, stats: Optional[Callable[[], dict]] = None,
            safeguards: Safeguards = Safeguards()):
    """Serves `model` on HTTP `http_port` and gRPC `grpc_port` of `address` while the block runs, and
    its metrics (metrics.py; `stats` gives the version's step and the lookup tiers'
    counts) on `metrics_port` unless None, each as `safeguards` say; yields a function that blocks
    until interrupted (KeyboardInterrupt)."""
    import grpc
    metrics = Metrics(model.name, stats)
    servicer, add = _grpc_servicer(model, metrics)
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads), interceptors=[_grpc_guard(safeguards, metrics)],
        options=[("grpc.max_receive_message_length", min(safeguards.max_request_bytes, model.max_message_bytes)),
                 ("grpc.max_metadata_size", safeguards.max_header_bytes),
                 ("grpc.max_connection_idle_ms", int(safeguards.read_timeout_s * 1000)),
                 ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)])
    add(servicer, grpc_server)
    if safeguards.tls_cert_file:
        with open(safeguards.tls_key_file, "rb") as key, open(safeguards.tls_cert_file, "rb") as cert:
            pair = (key.read(), cert.read())
        clients = None
        if safeguards.tls_client_ca_file:
            with open(safeguards.tls_client_ca_file, "rb") as ca:
                clients = ca.read()
        credentials = grpc.ssl_server_credentials([pair], root_certificates=clients,
                                                  require_client_auth=clients is not None)
        bound = grpc_server.add_secure_port(f"{address}:{grpc_port}", credentials)
    else:
        bound = grpc_server.add_insecure_port(f"{address}:{grpc_port}")
    if bound == 0:
        raise OSError(f"cannot listen on {address}:{grpc_port} (gRPC)")
    handler = type("Handler", (_HttpHandler,), {"model": model, "metrics": metrics})

    def wait():
        """Blocks until a signal handler raises (serve.py's, on SIGTERM or SIGINT). The kernel may
        hand the signal to any thread, where Python only notes it: the handler runs in this (main)
        thread once it runs Python again, woken by the wakeup fd Python writes to (a sleep would not
        end)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write)
        try:
            while True:
                os.read(read, 1)
        finally:
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
    with http_serving(handler, address, http_port, "http", safeguards, lambda: metrics.observe("http", "refused")), \
            (metrics.serving(address, metrics_port, safeguards) if metrics_port is not None else nullcontext()):
        grpc_server.start()
        try:
            yield wait
        finally:
            grpc_server.stop(grace=2).wait()
