// CUDA kernels of DLRM's dot interaction (see dot_based_interact_cuda.h); no TensorFlow here.
//
// One thread block per sample. float (and __half where the tensor-core kernels do not fit) use
// SIMT kernels with float accumulation, the sample staged in shared memory when it fits and read
// from global memory otherwise, so any N and D work. __half uses WMMA tensor-core kernels when
// the zero-padded sample fits in shared memory: the Gram matrix T T^T tile by tile (forward) and
// S T (backward).
#include <mma.h>

#include "dot_based_interact_cuda.h"
#include "dot_based_interact_shape.h"

namespace dot_interact {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kSharedBytes = 48 * 1024;
constexpr int kTile = 16;  // WMMA tile edge

__device__ inline float ToFloat(float x) { return x; }
__device__ inline float ToFloat(__half x) { return __half2float(x); }
template <typename T> __device__ inline T FromFloat(float x);
template <> __device__ inline float FromFloat<float>(float x) { return x; }
template <> __device__ inline __half FromFloat<__half>(float x) { return __float2half(x); }

// p = i(i-1)/2 + j with i > j (the output's pair order) -> (i, j).
__device__ inline void PairIndex(int p, int* i, int* j) {
  int r = static_cast<int>((1.0f + sqrtf(1.0f + 8.0f * p)) * 0.5f);
  while (r * (r - 1) / 2 > p) --r;
  while ((r + 1) * r / 2 <= p) ++r;
  *i = r;
  *j = p - r * (r - 1) / 2;
}

__device__ inline int PairOf(int i, int j) { return i > j ? i * (i - 1) / 2 + j : j * (j - 1) / 2 + i; }

// Copies the sample x [n, d] into staged [n, d | 1] floats (an odd row stride avoids bank conflicts).
template <typename T>
__device__ void StageRows(const T* x, int n, int d, float* staged) {
  for (int e = threadIdx.x; e < n * d; e += blockDim.x) staged[(e / d) * (d | 1) + e % d] = ToFloat(x[e]);
}

template <typename T, bool kShared>
__global__ void __launch_bounds__(kThreads) ForwardSimt(const T* __restrict__ in, T* __restrict__ out, int n, int d,
                                                      int width) {
  extern __shared__ float staged[];
  const T* x = in + static_cast<int64_t>(blockIdx.x) * n * d;
  T* y = out + static_cast<int64_t>(blockIdx.x) * width;
  const int stride = d | 1, pairs = n * (n - 1) / 2;
  if (kShared) {
    StageRows(x, n, d, staged);
    __syncthreads();
  }
  for (int k = threadIdx.x; k < d; k += blockDim.x) y[k] = x[k];
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    int i, j;
    PairIndex(p, &i, &j);
    float acc = 0.0f;
    for (int k = 0; k < d; ++k)
      acc += kShared ? staged[i * stride + k] * staged[j * stride + k] : ToFloat(x[i * d + k]) * ToFloat(x[j * d + k]);
    y[d + p] = FromFloat<T>(acc);
  }
  for (int k = d + pairs + threadIdx.x; k < width; k += blockDim.x) y[k] = FromFloat<T>(0.0f);
}

template <typename T, bool kShared>
__global__ void __launch_bounds__(kThreads) BackwardSimt(const T* __restrict__ in, const T* __restrict__ grad_out,
                                                       T* __restrict__ grad_in, int n, int d, int width) {
  extern __shared__ float staged[];  // the sample [n, d | 1], then the pair gradients
  const int64_t b = blockIdx.x;
  const T* x = in + b * n * d;
  const T* g = grad_out + b * width;
  T* dx = grad_in + b * n * d;
  const int stride = d | 1, pairs = n * (n - 1) / 2;
  float* pair_grad = staged + n * stride;
  if (kShared) {
    StageRows(x, n, d, staged);
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) pair_grad[p] = ToFloat(g[d + p]);
    __syncthreads();
  }
  for (int e = threadIdx.x; e < n * d; e += blockDim.x) {
    const int i = e / d, k = e % d;
    float acc = i == 0 ? ToFloat(g[k]) : 0.0f;
    for (int j = 0; j < n; ++j) {
      if (j == i) continue;
      const int p = PairOf(i, j);
      acc += kShared ? pair_grad[p] * staged[j * stride + k] : ToFloat(g[d + p]) * ToFloat(x[j * d + k]);
    }
    dx[e] = FromFloat<T>(acc);
  }
}

// Copies x [n, d] into a [np, dp] half matrix, zero-padded.
__device__ void StagePadded(const __half* x, int n, int d, int np, int dp, __half* a) {
  for (int e = threadIdx.x; e < np * dp; e += blockDim.x) {
    const int i = e / dp, k = e % dp;
    a[e] = i < n && k < d ? x[i * d + k] : __float2half(0.0f);
  }
}

using namespace nvcuda;
using FragA = wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, __half, wmma::row_major>;
using FragAcc = wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float>;

int64_t ForwardTensorCoreBytes(int n, int d) {
  const int64_t np = RoundUp(n, kTile), dp = RoundUp(d, kTile);
  return np * dp * 2 + np * np * 4;
}

// Warps take the 16 x 16 tiles of the Gram matrix on or below the diagonal.
__global__ void __launch_bounds__(kThreads) ForwardTensorCore(const __half* __restrict__ in, __half* __restrict__ out,
                                                            int n, int d, int width) {
  extern __shared__ __align__(32) unsigned char shared[];
  const int np = (n + kTile - 1) / kTile * kTile, dp = (d + kTile - 1) / kTile * kTile;
  __half* a = reinterpret_cast<__half*>(shared);        // [np, dp]
  float* gram = reinterpret_cast<float*>(a + np * dp);  // [np, np]
  const __half* x = in + static_cast<int64_t>(blockIdx.x) * n * d;
  __half* y = out + static_cast<int64_t>(blockIdx.x) * width;
  StagePadded(x, n, d, np, dp, a);
  __syncthreads();
  const int nt = np / kTile;
  for (int t = threadIdx.x / 32; t < nt * (nt + 1) / 2; t += kWarps) {
    int ti, tj;  // t = ti(ti-1)/2 + tj, tj < ti <= nt: the tile at row ti - 1, column tj
    PairIndex(t, &ti, &tj);
    ti -= 1;
    FragA fa;
    wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, __half, wmma::col_major> fb;
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < dp; k += kTile) {
      wmma::load_matrix_sync(fa, a + ti * kTile * dp + k, dp);
      wmma::load_matrix_sync(fb, a + tj * kTile * dp + k, dp);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(gram + ti * kTile * np + tj * kTile, acc, np, wmma::mem_row_major);
  }
  __syncthreads();
  const int pairs = n * (n - 1) / 2;
  for (int k = threadIdx.x; k < d; k += blockDim.x) y[k] = x[k];
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    int i, j;
    PairIndex(p, &i, &j);
    y[d + p] = __float2half(gram[i * np + j]);
  }
  for (int k = d + pairs + threadIdx.x; k < width; k += blockDim.x) y[k] = __float2half(0.0f);
}

int64_t BackwardTensorCoreBytes(int n, int d) {
  const int64_t np = RoundUp(n, kTile), dp = RoundUp(d, kTile);
  return np * dp * 2 + np * np * 2 + kWarps * kTile * kTile * 4;
}

// Warps take the 16 x 16 tiles of dT = S T; each tile goes through a per-warp float staging tile.
__global__ void __launch_bounds__(kThreads) BackwardTensorCore(const __half* __restrict__ in,
                                                             const __half* __restrict__ grad_out,
                                                             __half* __restrict__ grad_in, int n, int d, int width) {
  extern __shared__ __align__(32) unsigned char shared[];
  const int np = (n + kTile - 1) / kTile * kTile, dp = (d + kTile - 1) / kTile * kTile;
  __half* a = reinterpret_cast<__half*>(shared);  // the sample [np, dp]
  __half* s = a + np * dp;                         // pair gradients, symmetric [np, np]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* stage = reinterpret_cast<float*>(s + np * np) + warp * kTile * kTile;
  const int64_t b = blockIdx.x;
  const __half* x = in + b * n * d;
  const __half* g = grad_out + b * width;
  __half* dx = grad_in + b * n * d;
  StagePadded(x, n, d, np, dp, a);
  for (int e = threadIdx.x; e < np * np; e += blockDim.x) {
    const int i = e / np, j = e % np;
    s[e] = i < n && j < n && i != j ? g[d + PairOf(i, j)] : __float2half(0.0f);
  }
  __syncthreads();
  const int nt = np / kTile, kt = dp / kTile;
  for (int t = warp; t < nt * kt; t += kWarps) {
    const int ti = t / kt, tk = t % kt;
    FragA fa;
    wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, __half, wmma::row_major> fb;
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int tj = 0; tj < nt; ++tj) {
      wmma::load_matrix_sync(fa, s + ti * kTile * np + tj * kTile, np);
      wmma::load_matrix_sync(fb, a + tj * kTile * dp + tk * kTile, dp);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(stage, acc, kTile, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < kTile * kTile; e += 32) {
      const int i = ti * kTile + e / kTile, k = tk * kTile + e % kTile;
      if (i < n && k < d) dx[i * d + k] = __float2half(stage[e] + (i == 0 ? __half2float(g[k]) : 0.0f));
    }
    __syncwarp();
  }
}

int64_t StagedFloats(int n, int d) { return static_cast<int64_t>(n) * (d | 1); }

template <typename T>
cudaError_t ForwardSimtLaunch(const T* in, T* out, int64_t batch, int n, int d, cudaStream_t stream) {
  const int width = static_cast<int>(OutputWidth(n, d));
  const int64_t bytes = StagedFloats(n, d) * 4;
  if (bytes <= kSharedBytes)
    ForwardSimt<T, true><<<static_cast<unsigned>(batch), kThreads, bytes, stream>>>(in, out, n, d, width);
  else
    ForwardSimt<T, false><<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(in, out, n, d, width);
  return cudaGetLastError();
}

template <typename T>
cudaError_t BackwardSimtLaunch(const T* in, const T* grad_out, T* grad_in, int64_t batch, int n, int d,
                               cudaStream_t stream) {
  const int width = static_cast<int>(OutputWidth(n, d));
  const int64_t bytes = (StagedFloats(n, d) + NumPairs(n)) * 4;
  if (bytes <= kSharedBytes)
    BackwardSimt<T, true><<<static_cast<unsigned>(batch), kThreads, bytes, stream>>>(in, grad_out, grad_in, n, d, width);
  else
    BackwardSimt<T, false><<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(in, grad_out, grad_in, n, d, width);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchForward(const float* in, float* out, int64_t batch, int n, int d, cudaStream_t stream) {
  return batch ? ForwardSimtLaunch(in, out, batch, n, d, stream) : cudaSuccess;
}

cudaError_t LaunchForward(const __half* in, __half* out, int64_t batch, int n, int d, cudaStream_t stream) {
  if (!batch) return cudaSuccess;
  const int64_t bytes = ForwardTensorCoreBytes(n, d);
  if (bytes > kSharedBytes) return ForwardSimtLaunch(in, out, batch, n, d, stream);
  ForwardTensorCore<<<static_cast<unsigned>(batch), kThreads, bytes, stream>>>(in, out, n, d, static_cast<int>(OutputWidth(n, d)));
  return cudaGetLastError();
}

cudaError_t LaunchBackward(const float* in, const float* grad_out, float* grad_in, int64_t batch, int n, int d,
                                  cudaStream_t stream) {
  return batch ? BackwardSimtLaunch(in, grad_out, grad_in, batch, n, d, stream) : cudaSuccess;
}

cudaError_t LaunchBackward(const __half* in, const __half* grad_out, __half* grad_in, int64_t batch, int n,
                                   int d, cudaStream_t stream) {
  if (!batch) return cudaSuccess;
  const int64_t bytes = BackwardTensorCoreBytes(n, d);
  if (bytes > kSharedBytes) return BackwardSimtLaunch(in, grad_out, grad_in, batch, n, d, stream);
  BackwardTensorCore<<<static_cast<unsigned>(batch), kThreads, bytes, stream>>>(in, grad_out, grad_in, n, d,
                                                         static_cast<int>(OutputWidth(n, d)));
  return cudaGetLastError();
}

}  // namespace dot_interact
