// DLRM's dot interaction on a CUDA GPU, free of TensorFlow (layout as dot_based_interact_cpu.h).
// float and __half storage, float accumulation. Every launch is asynchronous on `stream`; the
// returned error is the launch's.
#ifndef DOT_BASED_INTERACT_CUDA_H_
#define DOT_BASED_INTERACT_CUDA_H_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dot_interact {

// in [batch, n, d] -> out [batch, OutputWidth(n, d)].
cudaError_t LaunchForward(const float* in, float* out, int64_t batch, int n, int d, cudaStream_t stream);
cudaError_t LaunchForward(const __half* in, __half* out, int64_t batch, int n, int d, cudaStream_t stream);

// in [batch, n, d], grad_out [batch, OutputWidth(n, d)] -> grad_in [batch, n, d].
cudaError_t LaunchBackward(const float* in, const float* grad_out, float* grad_in, int64_t batch, int n, int d,
                           cudaStream_t stream);
cudaError_t LaunchBackward(const __half* in, const __half* grad_out, __half* grad_in, int64_t batch, int n, int d,
                           cudaStream_t stream);

}  // namespace dot_interact

#endif  // DOT_BASED_INTERACT_CUDA_H_
