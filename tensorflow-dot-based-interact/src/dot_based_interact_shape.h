// Output layout of DLRM's dot interaction, shared by the CPU and CUDA kernels.
#ifndef DOT_BASED_INTERACT_SHAPE_H_
#define DOT_BASED_INTERACT_SHAPE_H_

#include <cstdint>

namespace dot_interact {

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
// Pairs i > j of n vectors.
inline int64_t NumPairs(int64_t n) { return n * (n - 1) / 2; }
// Output columns for n vectors of width d: d, the pairs, zero padding to a multiple of 8.
inline int64_t OutputWidth(int64_t n, int64_t d) { return RoundUp(d + NumPairs(n), 8); }

}  // namespace dot_interact

#endif  // DOT_BASED_INTERACT_SHAPE_H_
