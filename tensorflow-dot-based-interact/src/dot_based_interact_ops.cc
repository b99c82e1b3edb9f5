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

REGISTER_OP("DotBasedInteract")
    .Attr("T: {float, bfloat16, half}")
    .Input("input: T")
    .Output("output: T")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle in;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &in));
      DimensionHandle n = c->Dim(in, 1), d = c->Dim(in, 2);
      DimensionHandle width = c->UnknownDim();
      if (c->ValueKnown(n) && c->ValueKnown(d))
        width = c->MakeDim(dot_interact::OutputWidth(c->Value(n), c->Value(d)));
      c->set_output(0, c->Matrix(c->Dim(in, 0), width));
      return OkStatus();
    })
    .Doc("input [B, N, D] -> [B, round_up_8(D + N(N-1)/2)]: input[:, 0], the dots of every pair "
         "i > j of the N vectors (row-major), zero padding.");

REGISTER_OP("DotBasedInteractGrad")
    .Attr("T: {float, bfloat16, half}")
    .Input("input: T")
    .Input("grad: T")
    .Output("input_grad: T")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle in, grad;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &in));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &grad));
      c->set_output(0, in);
      return OkStatus();
    })
    .Doc("The gradient of DotBasedInteract with respect to its input, given the output's gradient.");

// Checks the shapes shared by both ops; sets batch, n, d, width.
Status CheckInput(const Tensor& input, int64_t* batch, int* n, int* d, int64_t* width) {
  if (input.dims() != 3) return errors::InvalidArgument("input must be [B, N, D], got ", input.shape().DebugString());
  *batch = input.dim_size(0);
  *n = static_cast<int>(input.dim_size(1));
  *d = static_cast<int>(input.dim_size(2));
  *width = dot_interact::OutputWidth(*n, *d);
  return OkStatus();
}

Status CheckGrad(const Tensor& grad, int64_t batch, int64_t width) {
  if (grad.dims() != 2 || grad.dim_size(0) != batch || grad.dim_size(1) != width)
    return errors::InvalidArgument("grad must be [", batch, ", ", width, "], got ", grad.shape().DebugString());
  return OkStatus();
}

// Runs fn(first_sample, end_sample, scratch) over the batch on the intra-op thread pool.
template <typename Fn>
void ForSamples(OpKernelContext* ctx, int64_t batch, int n, int d, Fn fn) {
  const int64_t cost = 4 * static_cast<int64_t>(n) * n * d + 8 * n * d;  // ~cycles per sample
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  workers->ParallelFor(batch, cost, [&](int64_t begin, int64_t end) {
    dot_interact::Scratch scratch;
    fn(begin, end, scratch);
  });
}

template <typename T>
class DotBasedInteractCpu : public OpKernel {
 public:
  explicit DotBasedInteractCpu(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    int64_t batch, width;
    int n, d;
    OP_REQUIRES_OK(ctx, CheckInput(input, &batch, &n, &d, &width));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({batch, width}), &output));
    const T* in = input.flat<T>().data();
    T* out = output->flat<T>().data();
    ForSamples(ctx, batch, n, d, [&](int64_t begin, int64_t end, dot_interact::Scratch& scratch) {
      for (int64_t b = begin; b < end; ++b)
        dot_interact::ForwardSample(in + b * n * d, out + b * width, n, d, scratch);
    });
  }
};

template <typename T>
class DotBasedInteractGradCpu : public OpKernel {
 public:
  explicit DotBasedInteractGradCpu(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    const Tensor& grad = ctx->input(1);
    int64_t batch, width;
    int n, d;
    OP_REQUIRES_OK(ctx, CheckInput(input, &batch, &n, &d, &width));
    OP_REQUIRES_OK(ctx, CheckGrad(grad, batch, width));
    Tensor* input_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, input.shape(), &input_grad));
    const T* in = input.flat<T>().data();
    const T* g = grad.flat<T>().data();
    T* out = input_grad->flat<T>().data();
    ForSamples(ctx, batch, n, d, [&](int64_t begin, int64_t end, dot_interact::Scratch& scratch) {
      for (int64_t b = begin; b < end; ++b)
        dot_interact::BackwardSample(in + b * n * d, g + b * width, out + b * n * d, n, d, scratch);
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

template <typename T>
class DotBasedInteractGpu : public OpKernel {
 public:
  explicit DotBasedInteractGpu(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    using C = typename CudaType<T>::type;
    const Tensor& input = ctx->input(0);
    int64_t batch, width;
    int n, d;
    OP_REQUIRES_OK(ctx, CheckInput(input, &batch, &n, &d, &width));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({batch, width}), &output));
    if (batch == 0) return;
    OP_REQUIRES_OK(ctx, FromCuda(dot_interact::LaunchForward(
                            reinterpret_cast<const C*>(input.flat<T>().data()),
                            reinterpret_cast<C*>(output->flat<T>().data()), batch, n, d, StreamOf(ctx))));
  }
};

template <typename T>
class DotBasedInteractGradGpu : public OpKernel {
 public:
  explicit DotBasedInteractGradGpu(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    using C = typename CudaType<T>::type;
    const Tensor& input = ctx->input(0);
    const Tensor& grad = ctx->input(1);
    int64_t batch, width;
    int n, d;
    OP_REQUIRES_OK(ctx, CheckInput(input, &batch, &n, &d, &width));
    OP_REQUIRES_OK(ctx, CheckGrad(grad, batch, width));
    Tensor* input_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, input.shape(), &input_grad));
    if (batch == 0) return;
    OP_REQUIRES_OK(ctx, FromCuda(dot_interact::LaunchBackward(
                            reinterpret_cast<const C*>(input.flat<T>().data()),
                            reinterpret_cast<const C*>(grad.flat<T>().data()),
                            reinterpret_cast<C*>(input_grad->flat<T>().data()), batch, n, d, StreamOf(ctx))));
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
