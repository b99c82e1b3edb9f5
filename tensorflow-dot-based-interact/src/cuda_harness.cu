// Checks the CUDA kernels (dot_based_interact.cu) against a double-precision CPU reference, for
// float and __half over several shapes, forward and backward. No TensorFlow.
//   nvcc -std=c++17 -O2 dot_based_interact.cu cuda_harness.cu -o cuda_harness && ./cuda_harness
// Exit status: 0 all passed, 1 a mismatch or CUDA error, 77 no CUDA device (nothing checked).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "dot_based_interact_cuda.h"
#include "dot_based_interact_shape.h"

using dot_interact::OutputWidth;

namespace {

struct Shape { int batch, n, d; };

float ToFloat(float x) { return x; }
float ToFloat(__half x) { return __half2float(x); }
template <typename T> T FromFloat(float x);
template <> float FromFloat<float>(float x) { return x; }
template <> __half FromFloat<__half>(float x) { return __float2half(x); }

bool Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) std::printf("CUDA error in %s: %s\n", what, cudaGetErrorString(err));
  return err == cudaSuccess;
}

template <typename T>
std::vector<T> Random(size_t size, std::mt19937* rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<T> v(size);
  for (auto& x : v) x = FromFloat<T>(u(*rng));
  return v;
}

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* p = nullptr;
  cudaMalloc(&p, host.size() * sizeof(T));
  cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

template <typename T>
std::vector<T> ToHost(const T* device, size_t size) {
  std::vector<T> host(size);
  cudaMemcpy(host.data(), device, size * sizeof(T), cudaMemcpyDeviceToHost);
  return host;
}

// |got - want| <= tol * scale, scale the sum of the absolute terms of want (float accumulation
// and the final rounding stay within a few ulps of it); returns the worst ratio.
double WorstError(double got, double want, double scale, double worst, double tol) {
  return std::max(worst, std::fabs(got - want) / (tol * scale + 1e-30));
}

// Runs both kernels on one shape; true when every element is within tolerance.
template <typename T>
bool CheckShape(const Shape& s, double tol, std::mt19937* rng) {
  const int n = s.n, d = s.d, width = static_cast<int>(OutputWidth(n, d));
  const std::vector<T> x = Random<T>(static_cast<size_t>(s.batch) * n * d, rng);
  const std::vector<T> g = Random<T>(static_cast<size_t>(s.batch) * width, rng);
  T *dx = ToDevice(x), *dg = ToDevice(g), *dout = nullptr, *dgrad = nullptr;
  cudaMalloc(&dout, g.size() * sizeof(T));
  cudaMalloc(&dgrad, x.size() * sizeof(T));
  bool ok = Check(dot_interact::LaunchForward(dx, dout, s.batch, n, d, nullptr), "forward launch") &&
            Check(dot_interact::LaunchBackward(dx, dg, dgrad, s.batch, n, d, nullptr), "backward launch") &&
            Check(cudaDeviceSynchronize(), "kernels");
  const std::vector<T> out = ToHost(dout, g.size()), grad = ToHost(dgrad, x.size());
  cudaFree(dx); cudaFree(dg); cudaFree(dout); cudaFree(dgrad);
  if (!ok) return false;
  double worst = 0.0;
  for (int b = 0; b < s.batch; ++b) {
    auto X = [&](int i, int k) { return static_cast<double>(ToFloat(x[(static_cast<size_t>(b) * n + i) * d + k])); };
    auto G = [&](int c) { return static_cast<double>(ToFloat(g[static_cast<size_t>(b) * width + c])); };
    auto O = [&](int c) { return static_cast<double>(ToFloat(out[static_cast<size_t>(b) * width + c])); };
    for (int k = 0; k < d; ++k) worst = WorstError(O(k), X(0, k), std::fabs(X(0, k)) + 1e-30, worst, tol);
    int p = d;
    for (int i = 1; i < n; ++i)
      for (int j = 0; j < i; ++j, ++p) {
        double want = 0.0, scale = 0.0;
        for (int k = 0; k < d; ++k) want += X(i, k) * X(j, k), scale += std::fabs(X(i, k) * X(j, k));
        worst = WorstError(O(p), want, scale, worst, tol);
      }
    for (; p < width; ++p) worst = WorstError(O(p), 0.0, 1.0, worst, tol);
    for (int i = 0; i < n; ++i)
      for (int k = 0; k < d; ++k) {
        double want = i == 0 ? G(k) : 0.0, scale = std::fabs(want);
        for (int j = 0; j < n; ++j) {
          if (j == i) continue;
          const double sij = G(d + (i > j ? i * (i - 1) / 2 + j : j * (j - 1) / 2 + i));
          want += sij * X(j, k), scale += std::fabs(sij * X(j, k));
        }
        const double got = ToFloat(grad[(static_cast<size_t>(b) * n + i) * d + k]);
        worst = WorstError(got, want, scale, worst, tol);
      }
  }
  std::printf("%-6s B=%-5d N=%-3d D=%-4d worst error %.3f of tolerance  %s\n", sizeof(T) == 4 ? "float" : "half",
              s.batch, n, d, worst, worst <= 1.0 ? "ok" : "MISMATCH");
  return worst <= 1.0;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: nothing checked\n");
    return 77;
  }
  // Tensor-core and SIMT paths, shared and global memory, odd N and D, one tile and many.
  const Shape shapes[] = {{1, 2, 1}, {3, 9, 7}, {64, 27, 16}, {64, 27, 128}, {33, 33, 129},
                          {16, 64, 256}, {4, 100, 300}, {4096, 27, 16}, {512, 27, 128}};
  std::mt19937 rng(1234);
  bool ok = true;
  for (const Shape& s : shapes) {
    ok = CheckShape<float>(s, 1e-5, &rng) && ok;
    ok = CheckShape<__half>(s, 4e-3, &rng) && ok;
  }
  std::printf("%s\n", ok ? "all passed" : "FAILED");
  return ok ? 0 : 1;
}
