// DLRM's dot interaction on the CPU, one sample at a time, free of TensorFlow.
//
// A sample is T [N, D] (N = F + 1 vectors: the bottom-MLP output, then the F embeddings).
// Forward:  out [W] = T[0, :], then dot(T[i], T[j]) for i > j in row-major order
//           ((1,0), (2,0), (2,1), ...), then zeros; W = round_up_8(D + N(N-1)/2).
// Backward: dT = S T, with S the symmetric N x N matrix of the pairs' gradients (zero
//           diagonal), plus the output gradient's first D columns on row 0.
// Both accumulate in float32 whatever the storage type (float, bfloat16, half).
#ifndef DOT_BASED_INTERACT_CPU_H_
#define DOT_BASED_INTERACT_CPU_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dot_based_interact_shape.h"

namespace dot_interact {

// Width of a register block: one AVX-512 or two AVX2 float registers.
constexpr int kLanes = 16;
// Floats of a [depth x padded N] slab of the transposed sample kept in L1 while its rows are used.
constexpr int kL1Floats = 8192;


// The target clones compile each micro-kernel for AVX-512, AVX2+FMA and plain x86-64; the
// loader picks the best one this CPU runs.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DOT_INTERACT_MULTIVERSION __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define DOT_INTERACT_MULTIVERSION
#endif

// gram [n, np] += the lower triangle (and some of the diagonal block) of cols^T cols, where
// cols [d, np] is the sample transposed, zero-padded to np = RoundUp(n, kLanes) columns.
// Blocked: a 16-column block of cols, `depth` rows deep, stays in L1 while every row i uses it;
// each (i, block) accumulates in registers.
DOT_INTERACT_MULTIVERSION
inline void GramLower(const float* __restrict cols, int n, int np, int d, float* __restrict gram) {
  const int depth = std::max(kLanes, kL1Floats / np);
  for (int jb = 0; jb < n - 1; jb += kLanes) {
    for (int k0 = 0; k0 < d; k0 += depth) {
      const int k1 = std::min(d, k0 + depth);
      for (int i = jb + 1; i < n; ++i) {
        float acc[kLanes];
        float* g = gram + static_cast<int64_t>(i) * np + jb;
        for (int l = 0; l < kLanes; ++l) acc[l] = g[l];
        for (int k = k0; k < k1; ++k) {
          const float* c = cols + static_cast<int64_t>(k) * np;
          const float a = c[i];
          for (int l = 0; l < kLanes; ++l) acc[l] += a * c[jb + l];
        }
        for (int l = 0; l < kLanes; ++l) g[l] = acc[l];
      }
    }
  }
}

// out [n, dp] = s [n, n] rows [n, dp], 16 columns at a time: the rows' 16-column slab and s
// stay in L1, each (i, slab) accumulates in registers.
DOT_INTERACT_MULTIVERSION
inline void SymmetricTimesRows(const float* __restrict s, const float* __restrict rows, int n, int dp,
                               float* __restrict out) {
  for (int k0 = 0; k0 < dp; k0 += kLanes) {
    for (int i = 0; i < n; ++i) {
      float acc[kLanes] = {};
      const float* si = s + static_cast<int64_t>(i) * n;
      for (int j = 0; j < n; ++j) {
        const float* r = rows + static_cast<int64_t>(j) * dp + k0;
        const float sij = si[j];
        for (int l = 0; l < kLanes; ++l) acc[l] += sij * r[l];
      }
      float* o = out + static_cast<int64_t>(i) * dp + k0;
      for (int l = 0; l < kLanes; ++l) o[l] = acc[l];
    }
  }
}

// One thread's working buffers, reused across its samples.
struct Scratch {
  std::vector<float> a;  // forward: the sample transposed [D, Np]; backward: the sample [N, Dp]
  std::vector<float> b;  // forward: Gram rows [N, Np]; backward: dT [N, Dp]
  std::vector<float> s;  // backward: the symmetric pair-gradient matrix [N, N]
};

// in [n, d] -> out [OutputWidth(n, d)].
template <typename T>
void ForwardSample(const T* in, T* out, int n, int d, Scratch& scratch) {
  const int np = static_cast<int>(RoundUp(n, kLanes));
  scratch.a.assign(static_cast<size_t>(d) * np, 0.0f);
  scratch.b.assign(static_cast<size_t>(n) * np, 0.0f);
  float* cols = scratch.a.data();
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < d; ++k) cols[static_cast<int64_t>(k) * np + i] = static_cast<float>(in[i * d + k]);
  GramLower(cols, n, np, d, scratch.b.data());
  std::copy(in, in + d, out);
  T* pairs = out + d;
  for (int i = 1; i < n; ++i) {
    const float* g = scratch.b.data() + static_cast<int64_t>(i) * np;
    for (int j = 0; j < i; ++j) *pairs++ = static_cast<T>(g[j]);
  }
  std::fill(pairs, out + OutputWidth(n, d), static_cast<T>(0.0f));
}

// in [n, d], grad_out [OutputWidth(n, d)] -> grad_in [n, d].
template <typename T>
void BackwardSample(const T* in, const T* grad_out, T* grad_in, int n, int d, Scratch& scratch) {
  const int dp = static_cast<int>(RoundUp(d, kLanes));
  scratch.a.assign(static_cast<size_t>(n) * dp, 0.0f);
  scratch.b.resize(static_cast<size_t>(n) * dp);
  scratch.s.resize(static_cast<size_t>(n) * n);
  float* rows = scratch.a.data();
  float* s = scratch.s.data();
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < d; ++k) rows[static_cast<int64_t>(i) * dp + k] = static_cast<float>(in[i * d + k]);
  const T* pair_grad = grad_out + d;
  for (int i = 0; i < n; ++i) {
    s[i * n + i] = 0.0f;
    for (int j = 0; j < i; ++j) s[i * n + j] = s[j * n + i] = static_cast<float>(*pair_grad++);
  }
  SymmetricTimesRows(s, rows, n, dp, scratch.b.data());
  for (int i = 0; i < n; ++i) {
    const float* o = scratch.b.data() + static_cast<int64_t>(i) * dp;
    for (int k = 0; k < d; ++k)
      grad_in[i * d + k] = static_cast<T>(i == 0 ? o[k] + static_cast<float>(grad_out[k]) : o[k]);
  }
}

}  // namespace dot_interact

#endif  // DOT_BASED_INTERACT_CPU_H_
