// bfloat16 linear layer for CPUs with AVX-512 BF16: y = x @ W.T + b, exact in every row whatever the
// row count. Each output element is one float32 sum in a fixed order, in one thread, never split:
// k runs in chunks of kChunk pairs, each chunk summed from zero (one vdpbf16ps per pair of k) and
// added to the running sum, so a row's bits never depend on the rows beside it, on how many there
// are, or on the thread count; the two-level sum keeps a long row's rounding error near oneDNN's
// (a single running sum over thousands of k drifts where activations have outliers). Weights
// stream once a call: a register tile covers up to 4 rows by 64 columns, and over more rows each
// chunk's weights are reused from L1 by every row tile.
//
// Weight layout (speculum.kernels.pack_rows): [N/16][K/2][16][2] bfloat16, N padded to a multiple
// of 64 and K to an even count with zeros: for each block of 16 columns, each pair of k, the 16
// columns' two values side by side, one 64-byte vector.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int kBlocks = 4;        // 16-column blocks per tile: 64 columns
constexpr int kRows = 4;          // rows per register tile (4 x 4 accumulators)
constexpr int64_t kChunk = 64;    // k pairs per chunk: summed from zero, then added to the running sum

struct Call {
  const int32_t* x;     // [M, Kp]: bfloat16 pairs
  int64_t M, Kp, N;     // N: the padded output width
  const uint16_t* w;    // packed weights
  const float* bias;    // [N] float32, or null
  uint16_t* out;        // [M, N] bfloat16
};

#if defined(__AVX512BF16__)
template <int R>
inline void tile(const Call& c, int64_t block, int64_t m0, int64_t k0, int64_t k1, float* partial, bool first,
                 bool last) {
  __m512 acc[R][kBlocks];  // this chunk's sums, from zero
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < kBlocks; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t stride = c.Kp * 32;  // one block's weights, in bfloat16 values
  const uint16_t* w = c.w + block * stride;
  const int32_t* x = c.x + m0 * c.Kp;
  for (int64_t kp = k0; kp < k1; ++kp) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * 32);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + stride + kp * 32);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2 * stride + kp * 32);
    __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 3 * stride + kp * 32);
    for (int m = 0; m < R; ++m) {
      __m512bh xm = (__m512bh)_mm512_set1_epi32(x[m * c.Kp + kp]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xm);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xm);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, xm);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, xm);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < kBlocks; ++j) {
      float* sum = partial + (m0 + m) * 64 + j * 16;
      __m512 v = first ? acc[m][j] : _mm512_add_ps(_mm512_loadu_ps(sum), acc[m][j]);
      if (!last) {
        _mm512_storeu_ps(sum, v);
        continue;
      }
      if (c.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(c.bias + (block + j) * 16));
      __m256bh y = _mm512_cvtneps_pbh(v);
      _mm256_storeu_si256((__m256i*)(c.out + (m0 + m) * c.N + (block + j) * 16), (__m256i)y);
    }
}
#else
// The same sums in portable C++ (CPUs without AVX-512 BF16; speculum runs bfloat16 there on other
// kernels, so this path serves the tests): float32 products of bfloat16 pairs, accumulated in order.
inline float as_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t round_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x7fffffu)) return uint16_t((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return uint16_t(bits >> 16);
}

template <int R>
inline void tile(const Call& c, int64_t block, int64_t m0, int64_t k0, int64_t k1, float* partial, bool first,
                 bool last) {
  const int64_t stride = c.Kp * 32;
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < kBlocks; ++j)
      for (int n = 0; n < 16; ++n) {
        float* slot = partial + (m0 + m) * 64 + j * 16 + n;
        float acc = 0.0f;  // this chunk's sum, from zero
        const uint16_t* w = c.w + (block + j) * stride + n * 2;
        const uint16_t* x = reinterpret_cast<const uint16_t*>(c.x + (m0 + m) * c.Kp);
        for (int64_t kp = k0; kp < k1; ++kp) {
          acc += as_float(x[2 * kp]) * as_float(w[kp * 32]);
          acc += as_float(x[2 * kp + 1]) * as_float(w[kp * 32 + 1]);
        }
        if (!first) acc = *slot + acc;
        if (!last) {
          *slot = acc;
          continue;
        }
        if (c.bias) acc += c.bias[(block + j) * 16 + n];
        c.out[(m0 + m) * c.N + (block + j) * 16 + n] = round_bf16(acc);
      }
}
#endif

// One tile of 64 columns over every row, k in chunks: each chunk's weights stay in L1 while each
// row tile passes over them.
void columns(const Call& c, int64_t block, float* partial) {
  for (int64_t k0 = 0; k0 < c.Kp; k0 += kChunk) {
    const int64_t k1 = std::min(c.Kp, k0 + kChunk);
    const bool first = k0 == 0, last = k1 == c.Kp;
    for (int64_t m0 = 0; m0 < c.M; m0 += kRows) {
      switch (std::min<int64_t>(kRows, c.M - m0)) {
        case 1: tile<1>(c, block, m0, k0, k1, partial, first, last); break;
        case 2: tile<2>(c, block, m0, k0, k1, partial, first, last); break;
        case 3: tile<3>(c, block, m0, k0, k1, partial, first, last); break;
        default: tile<4>(c, block, m0, k0, k1, partial, first, last); break;
      }
    }
  }
}

}  // namespace

// x: [M, K] bfloat16, K even; packed: [N/16, K/2, 16, 2] bfloat16 with N a multiple of 64;
// bias: [N] float32 or empty. Returns [M, N] bfloat16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.size(0) % kBlocks == 0,
              "packed: [N/16, K/2, 16, 2] with N a multiple of 64");
  TORCH_CHECK(x.size(1) == packed.size(1) * 2, "x's width differs from the packed weights'");
  const int64_t M = x.size(0), N = packed.size(0) * 16;
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == at::kFloat), "bias: [N] float32");
  Call c{reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>()), M, packed.size(1), N,
         reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
         bias.numel() ? bias.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>())};
  const int64_t tiles = N / 64;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> partial(M * 64);
    for (int64_t t = t0; t < t1; ++t) columns(c, t * kBlocks, partial.data());
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("linear", &linear, "bfloat16 linear, row-count invariant"); }
