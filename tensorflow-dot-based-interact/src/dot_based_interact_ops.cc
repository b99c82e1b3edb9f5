// TensorFlow ops DotBasedInteract / DotBasedInteractGrad: registration, shape functions, the
// CPU kernels (samples spread over TensorFlow's intra-op thread pool) and, when built with
// GOOGLE_CUDA, the GPU kernels (launched on the op's CUDA stream).
#include "dot_based_interact_cpu.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#if GOOGLE_CUDA
#include "dot_based_interact_cuda.h"
#include "xla/stream_executor/stream.h"
#endif

namespace tensorflow {
namespace {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// Merges the shapes of the n [B, D] vectors into *shape.
Status VectorsShape(InferenceContext* c, int n, ShapeHandle* shape) {
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, shape));
  for (int i = 1; i < n; ++i) {
    ShapeHandle v;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 2, &v));
    TF_RETURN_IF_ERROR(c->Merge(*shape, v, shape));
  }
  return OkStatus();
}

REGISTER_OP("DotBasedInteract")
    .Attr("N: int >= 1")
    .Attr("T: {float, bfloat16, half}")
    .Input("vectors: N * T")
    .Output("output: T")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      ShapeHandle in;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      TF_RETURN_IF_ERROR(VectorsShape(c, n, &in));
      DimensionHandle d = c->Dim(in, 1), width = c->UnknownDim();
      if (c->ValueKnown(d)) width = c->MakeDim(dot_interact::OutputWidth(n, c->Value(d)));
      c->set_output(0, c->Matrix(c->Dim(in, 0), width));
      return OkStatus();
    })
    .Doc("vectors: N x [B, D] -> [B, round_up_8(D + N(N-1)/2)]: vectors[0], the dots of every pair "
         "i > j of the N vectors (row-major), zero padding.");

REGISTER_OP("DotBasedInteractGrad")
    .Attr("N: int >= 1")
    .Attr("T: {float, bfloat16, half}")
    .Input("vectors: N * T")
    .Input("grad: T")
    .Output("vector_grads: N * T")
    .SetShapeFn([](InferenceContext* c) {
      int n;
      ShapeHandle in, grad;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      TF_RETURN_IF_ERROR(VectorsShape(c, n, &in));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(n), 2, &grad));
      for (int i = 0; i < n; ++i) c->set_output(i, in);
      return OkStatus();
    })
    .Doc("The gradients of DotBasedInteract with respect to its N vectors, given the output's gradient.");

// The N vectors of one call: equal [B, D] shapes; sets batch, d, width and the data pointers.
template <typename T>
Status ReadVectors(OpKernelContext* ctx, std::vector<const T*>* data, int64_t* batch, int* d, int64_t* width) {
  OpInputList vectors;
  TF_RETURN_IF_ERROR(ctx->input_list("vectors", &vectors));
  const TensorShape& shape = vectors[0].shape();
  if (shape.dims() != 2) return errors::InvalidArgument("vectors must be [B, D], got ", shape.DebugString());
  for (int i = 1; i < vectors.size(); ++i)
    if (vectors[i].shape() != shape)
      return errors::InvalidArgument("vectors must have one shape: ", shape.DebugString(), " and ",
                                     vectors[i].shape().DebugString(), " (vector ", i, ")");
  *batch = shape.dim_size(0);
  *d = static_cast<int>(shape.dim_size(1));
  *width = dot_interact::OutputWidth(vectors.size(), *d);
  data->clear();
  for (const Tensor& v : vectors) data->push_back(v.flat<T>().data());
  return OkStatus();
}

Status CheckGrad(const Tensor& grad, int64_t batch, int64_t width) {
  if (grad.dims() != 2 || grad.dim_size(0) != batch || grad.dim_size(1) != width)
    return errors::InvalidArgument("grad must be [", batch, ", ", width, "], got ", grad.shape().DebugString());
  return OkStatus();
}

// Allocates the N outputs of DotBasedInteractGrad, [batch, d] each.
template <typename T>
Status AllocateGrads(OpKernelContext* ctx, int n, int64_t batch, int d, std::vector<T*>* data) {
  OpOutputList grads;
  TF_RETURN_IF_ERROR(ctx->output_list("vector_grads", &grads));
  data->clear();
  for (int i = 0; i < n; ++i) {
    Tensor* g = nullptr;
    TF_RETURN_IF_ERROR(grads.allocate(i, TensorShape({batch, d}), &g));
    data->push_back(g->flat<T>().data());
  }
  return OkStatus();
}

// One call's operands, read and checked, its outputs allocated (the same for CPU and GPU).
template <typename T>
struct Call {
  std::vector<const T*> in;   // the N vectors, [batch, d] each
  int64_t batch = 0, width = 0;
  int n = 0, d = 0;
  T* out = nullptr;           // DotBasedInteract: the [batch, width] output
  const T* grad = nullptr;    // DotBasedInteractGrad: the output's gradient ...
  std::vector<T*> grads;      // ... and the N vectors' gradients
};

template <typename T>
Status PrepareForward(OpKernelContext* ctx, Call<T>* c) {
  TF_RETURN_IF_ERROR(ReadVectors(ctx, &c->in, &c->batch, &c->d, &c->width));
  c->n = static_cast<int>(c->in.size());
  Tensor* output = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({c->batch, c->width}), &output));
  c->out = output->flat<T>().data();
  return OkStatus();
}

template <typename T>
Status PrepareBackward(OpKernelContext* ctx, Call<T>* c) {
  TF_RETURN_IF_ERROR(ReadVectors(ctx, &c->in, &c->batch, &c->d, &c->width));
  c->n = static_cast<int>(c->in.size());
  const Tensor& grad = ctx->input(c->n);
  TF_RETURN_IF_ERROR(CheckGrad(grad, c->batch, c->width));
  c->grad = grad.flat<T>().data();
  return AllocateGrads(ctx, c->n, c->batch, c->d, &c->grads);
}

// Runs fn(first_sample, end_sample) over the batch on the intra-op thread pool.
template <typename Fn>
void ForSamples(OpKernelContext* ctx, int64_t batch, int n, int d, Fn fn) {
  const int64_t cost = static_cast<int64_t>(n) * n * d + 8 * n * d;  // ~cycles per sample
  ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(batch, cost, fn);
}

template <typename T>
class DotBasedInteractCpu : public OpKernel {
 public:
  explicit DotBasedInteractCpu(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    Call<T> c;
    OP_REQUIRES_OK(ctx, PrepareForward(ctx, &c));
    ForSamples(ctx, c.batch, c.n, c.d, [&](int64_t begin, int64_t end) {
      dot_interact::Forward(c.in.data(), c.n, c.d, begin, end, c.out);
    });
  }
};

template <typename T>
class DotBasedInteractGradCpu : public OpKernel {
 public:
  explicit DotBasedInteractGradCpu(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    Call<T> c;
    OP_REQUIRES_OK(ctx, PrepareBackward(ctx, &c));
    ForSamples(ctx, c.batch, c.n, c.d, [&](int64_t begin, int64_t end) {
      dot_interact::Backward(c.in.data(), c.grad, c.n, c.d, begin, end, c.grads.data());
    });
  }
};

#define REGISTER_CPU(T)                                                                          \
  REGISTER_KERNEL_BUILDER(Name("DotBasedInteract").Device(DEVICE_CPU).TypeConstraint<T>("T"),     \
                          DotBasedInteractCpu<T>);                                                \
  REGISTER_KERNEL_BUILDER(Name("DotBasedInteractGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          DotBasedInteractGradCpu<T>);
REGISTER_CPU(float)
REGISTER_CPU(bfloat16)
REGISTER_CPU(Eigen::half)
#undef REGISTER_CPU

#if GOOGLE_CUDA
// The storage type the CUDA core uses for each TensorFlow type (same bits).
template <typename T> struct CudaType { using type = T; };
template <> struct CudaType<Eigen::half> { using type = __half; };

cudaStream_t StreamOf(OpKernelContext* ctx) {
  return static_cast<cudaStream_t>(ctx->op_device_context()->stream()->platform_specific_handle().stream);
}

Status FromCuda(cudaError_t err) {
  return err == cudaSuccess ? OkStatus() : errors::Internal("CUDA: ", cudaGetErrorString(err));
}

// Strided device copies between the N [B, D] vectors and one [B, N, D] tensor (the CUDA
// kernels' layout): stacked[:, i] = vectors[i], and the reverse.
template <typename T>
Status Stack(const std::vector<const T*>& vectors, T* stacked, int64_t batch, int d, cudaStream_t stream) {
  const size_t row = d * sizeof(T), pitch = vectors.size() * row;
  for (size_t i = 0; i < vectors.size() && row > 0; ++i)
    TF_RETURN_IF_ERROR(FromCuda(cudaMemcpy2DAsync(stacked + i * d, pitch, vectors[i], row, row, batch,
                                                  cudaMemcpyDeviceToDevice, stream)));
  return OkStatus();
}

template <typename T>
Status Unstack(const T* stacked, const std::vector<T*>& vectors, int64_t batch, int d, cudaStream_t stream) {
  const size_t row = d * sizeof(T), pitch = vectors.size() * row;
  for (size_t i = 0; i < vectors.size() && row > 0; ++i)
    TF_RETURN_IF_ERROR(FromCuda(cudaMemcpy2DAsync(vectors[i], row, stacked + i * d, pitch, row, batch,
                                                  cudaMemcpyDeviceToDevice, stream)));
  return OkStatus();
}

template <typename T>
class DotBasedInteractGpu : public OpKernel {
 public:
  explicit DotBasedInteractGpu(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    using C = typename CudaType<T>::type;
    Call<T> c;
    OP_REQUIRES_OK(ctx, PrepareForward(ctx, &c));
    if (c.batch == 0) return;
    Tensor stacked;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<T>::value, TensorShape({c.batch, c.n, c.d}), &stacked));
    T* st = stacked.flat<T>().data();
    OP_REQUIRES_OK(ctx, Stack(c.in, st, c.batch, c.d, StreamOf(ctx)));
    OP_REQUIRES_OK(ctx, FromCuda(dot_interact::LaunchForward(reinterpret_cast<const C*>(st),
                                                             reinterpret_cast<C*>(c.out), c.batch, c.n, c.d,
                                                             StreamOf(ctx))));
  }
};

template <typename T>
class DotBasedInteractGradGpu : public OpKernel {
 public:
  explicit DotBasedInteractGradGpu(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    using C = typename CudaType<T>::type;
    Call<T> c;
    OP_REQUIRES_OK(ctx, PrepareBackward(ctx, &c));
    if (c.batch == 0) return;
    const TensorShape stacked_shape({c.batch, c.n, c.d});
    Tensor stacked, stacked_grad;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<T>::value, stacked_shape, &stacked));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<T>::value, stacked_shape, &stacked_grad));
    T* st = stacked.flat<T>().data();
    T* sg = stacked_grad.flat<T>().data();
    OP_REQUIRES_OK(ctx, Stack(c.in, st, c.batch, c.d, StreamOf(ctx)));
    OP_REQUIRES_OK(ctx, FromCuda(dot_interact::LaunchBackward(reinterpret_cast<const C*>(st),
                                                              reinterpret_cast<const C*>(c.grad),
                                                              reinterpret_cast<C*>(sg), c.batch, c.n, c.d,
                                                              StreamOf(ctx))));
    OP_REQUIRES_OK(ctx, Unstack<T>(sg, c.grads, c.batch, c.d, StreamOf(ctx)));
  }
};

#define REGISTER_GPU(T)                                                                          \
  REGISTER_KERNEL_BUILDER(Name("DotBasedInteract").Device(DEVICE_GPU).TypeConstraint<T>("T"),     \
                          DotBasedInteractGpu<T>);                                                \
  REGISTER_KERNEL_BUILDER(Name("DotBasedInteractGrad").Device(DEVICE_GPU).TypeConstraint<T>("T"), \
                          DotBasedInteractGradGpu<T>);
REGISTER_GPU(float)
REGISTER_GPU(Eigen::half)
#undef REGISTER_GPU
#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace tensorflow
