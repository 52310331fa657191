// Linear layers on a GGUF file's own quantized weights: y = x @ W.T, W in the file's blocks, every
// row's bits independent of the other rows, the row count and the thread count.
//
// Each row of x is quantized to int8 per unit of 32 values (scale = max|x| / 127, round half to
// even): finer than llama.cpp's 256 for K-quants, which keeps the model close to the file's weights
// where activations have outliers. A weight is codes q (unsigned, 4 to 8 bits) in sub-blocks of G
// with small integer scales and one or two float scales per block of S. Each unit's dot product is
// an exact integer (vpdpbusd); float arithmetic starts once per unit, in one fixed order of fused
// multiply-adds (one rounding each), so a row's result is the same whatever else shares the call.
//
//   one-scale types  w = A * a_j * (q - c)        (Q4_0, Q5_0, Q8_0: a = 1; Q6_K: G = 16)
//   two-scale types  w = A * a_j * q - B * b_j    (Q4_1, Q5_1: a = b = 1; Q4_K, Q5_K)
//   per unit u:  d = sum over its sub-blocks j of [a_j *] (q_j . x_j - c * sum(x_j))   (one-scale)
//                d = q_u . x_u                                                          (two-scale)
//                scale = A [* float(a_u)],  low = B [* float(b_u)],  m_u = -(dx_u * float(sum(x_u)))
//                y = fma(float(d), dx_u * scale, y)  [then  y = fma(low, m_u, y)]
//
// Packed layout (speculum.kernels.quant.pack), per block of 16 output columns ("lanes"):
//   codes  [NB][K/8][64] uint8: byte 4*lane+i holds k = 8t+i (low nibble) and 8t+4+i (high nibble);
//          8-bit codes are [NB][K/4][64], byte 4*lane+i holding k = 4t+i
//   high   [NB][K/8][2][BITS-4] uint64: bit 4*lane+i of mask p is bit 4+p of that vector's code
//   a, b   [NB][K/G][16] int8 sub-block scales (b for two-scale K types), A, B [NB][K/S][16] float32
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace {

struct Layer {
  const uint8_t* codes;
  const uint64_t* high;
  const int8_t* a;
  const int8_t* b;
  const float* A;
  const float* B;
  int64_t K, NB;
  int32_t offset;  // c of the one-scale types
};

struct Rows {
  const int8_t* xq;     // [M, K]
  const float* dx;      // [M, K/32]
  const int32_t* sums;  // [M, K/G]: each sub-block's sum of x, times c for one-scale types
  const float* mins;    // [M, K/32]: -(dx * sum) per unit, for two-scale types' low term
};

template <int BITS_, int G_, int S_, bool TWO_, bool HAS_A_, bool HAS_B_>
struct Format {
  static constexpr int BITS = BITS_, G = G_, S = S_;
  static constexpr bool TWO = TWO_, HAS_A = HAS_A_, HAS_B = HAS_B_;
};
using Q4_0 = Format<4, 32, 32, false, false, false>;
using Q4_1 = Format<4, 32, 32, true, false, false>;
using Q5_0 = Format<5, 32, 32, false, false, false>;
using Q5_1 = Format<5, 32, 32, true, false, false>;
using Q8_0 = Format<8, 32, 32, false, false, false>;
using Q4_K = Format<4, 32, 256, true, true, true>;
using Q5_K = Format<5, 32, 256, true, true, true>;
using Q6_K = Format<6, 16, 256, false, true, false>;

constexpr int64_t kAhead = 16;     // code vectors prefetched ahead of the one being read
constexpr int kUnit = 32;          // activation values per int8 scale
constexpr int64_t kChunk = 8;      // units per pass of the row tiles: their codes stay in L1 between passes

// The code of weight (lane, k) of block nb, as the packed layout stores it (the portable path).
template <class F>
inline int code_at(const Layer& L, int64_t nb, int lane, int64_t k) {
  if constexpr (F::BITS == 8) return L.codes[(nb * (L.K / 4) + k / 4) * 64 + lane * 4 + k % 4];
  const int64_t t = k / 8;
  const int h = int(k % 8) / 4, i = int(k % 4);
  int q = (L.codes[(nb * (L.K / 8) + t) * 64 + lane * 4 + i] >> (4 * h)) & 15;
  for (int p = 0; p < F::BITS - 4; ++p) {
    const uint64_t mask = L.high[((nb * (L.K / 8) + t) * 2 + h) * (F::BITS - 4) + p];
    q |= int((mask >> (lane * 4 + i)) & 1) << (4 + p);
  }
  return q;
}

#if defined(__AVX512VNNI__)
// Code vectors t of column block nb (k = 8t .. 8t+7): lo holds k = 8t..8t+3, hi k = 8t+4..8t+7.
template <class F>
inline void unpack(const Layer& L, int64_t nb, int64_t t, __m512i& lo, __m512i& hi) {
  if constexpr (F::BITS == 8) {
    const uint8_t* src = L.codes + (nb * (L.K / 4) + 2 * t) * 64;
    _mm_prefetch((const char*)(src + 2 * kAhead * 64), _MM_HINT_T0);
    _mm_prefetch((const char*)(src + (2 * kAhead + 1) * 64), _MM_HINT_T0);
    lo = _mm512_loadu_si512(src);
    hi = _mm512_loadu_si512(src + 64);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t at = nb * (L.K / 8) + t;
    _mm_prefetch((const char*)(L.codes + (at + kAhead) * 64), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(L.codes + at * 64);
    lo = _mm512_and_si512(v, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    for (int p = 0; p < F::BITS - 4; ++p) {
      const __m512i bit = _mm512_set1_epi8(char(1 << (4 + p)));
      lo = _mm512_mask_add_epi8(lo, L.high[(at * 2) * (F::BITS - 4) + p], lo, bit);
      hi = _mm512_mask_add_epi8(hi, L.high[(at * 2 + 1) * (F::BITS - 4) + p], hi, bit);
    }
  }
}

inline __m512i broadcast4(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, 4);
  return _mm512_set1_epi32(quad);
}

// Units u0..u1 for rows r0..r0+R and column blocks nb0..nb0+NL, added into out (row stride ld).
// R x NL independent dot-product chains keep the VNNI unit busy at one row as at many.
template <class F, int R, int NL>
inline void tile(const Layer& L, const Rows& X, int64_t nb0, int64_t u0, int64_t u1, int64_t r0, float* out,
                 int64_t ld) {
  constexpr int H = kUnit / F::G, PAIRS = F::G / 8;  // sub-blocks per unit, code vector pairs per sub-block
  constexpr bool SPLIT = R * NL <= 2;                 // two chains per tile where too few would wait on latency
  static_assert(!F::TWO || F::G == kUnit, "two-scale types keep one sub-block per unit");
  const int64_t nU = L.K / kUnit, nG = L.K / F::G, nS = L.K / F::S;
  __m512 y[R][NL];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < NL; ++l) y[r][l] = _mm512_loadu_ps(out + (r0 + r) * ld + (nb0 + l) * 16);
  for (int64_t u = u0; u < u1; ++u) {
    for (int l = 0; l < NL; ++l) {  // the scales' streams too: the hardware prefetcher tracks few
      if (F::HAS_A) _mm_prefetch((const char*)(L.a + ((nb0 + l) * nG + (u + 4) * H) * 16), _MM_HINT_T0);
      if (F::HAS_B) _mm_prefetch((const char*)(L.b + ((nb0 + l) * nG + (u + 4) * H) * 16), _MM_HINT_T0);
      if ((u * kUnit) % F::S == 0) {
        _mm_prefetch((const char*)(L.A + ((nb0 + l) * nS + u * kUnit / F::S + 2) * 16), _MM_HINT_T0);
        if (F::TWO) _mm_prefetch((const char*)(L.B + ((nb0 + l) * nS + u * kUnit / F::S + 2) * 16), _MM_HINT_T0);
      }
    }
    __m512i d[R][NL];
    for (int h = 0; h < H; ++h) {
      const int64_t g = u * H + h;
      __m512i part[R][NL], second[R][NL];
      for (int r = 0; r < R; ++r)
        for (int l = 0; l < NL; ++l) part[r][l] = second[r][l] = _mm512_setzero_si512();
      for (int t = 0; t < PAIRS; ++t) {
        __m512i lo[NL], hi[NL];
        for (int l = 0; l < NL; ++l) unpack<F>(L, nb0 + l, g * PAIRS + t, lo[l], hi[l]);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = X.xq + (r0 + r) * L.K + g * F::G + 8 * t;
          const __m512i x0 = broadcast4(x), x1 = broadcast4(x + 4);
          for (int l = 0; l < NL; ++l) {
            if constexpr (SPLIT) {
              part[r][l] = _mm512_dpbusd_epi32(part[r][l], lo[l], x0);
              second[r][l] = _mm512_dpbusd_epi32(second[r][l], hi[l], x1);
            } else {
              part[r][l] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(part[r][l], lo[l], x0), hi[l], x1);
            }
          }
        }
      }
      if constexpr (SPLIT)  // integer sums: the split changes no bit
        for (int r = 0; r < R; ++r)
          for (int l = 0; l < NL; ++l) part[r][l] = _mm512_add_epi32(part[r][l], second[r][l]);
      for (int l = 0; l < NL; ++l) {
        __m512i a = _mm512_setzero_si512();
        if constexpr (!F::TWO && F::HAS_A)
          a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(L.a + ((nb0 + l) * nG + g) * 16)));
        for (int r = 0; r < R; ++r) {
          __m512i p = part[r][l];
          if constexpr (!F::TWO) p = _mm512_sub_epi32(p, _mm512_set1_epi32(X.sums[(r0 + r) * nG + g]));
          if constexpr (!F::TWO && F::HAS_A) p = _mm512_mullo_epi32(p, a);
          d[r][l] = h == 0 ? p : _mm512_add_epi32(d[r][l], p);
        }
      }
    }
    for (int l = 0; l < NL; ++l) {
      const int64_t nb = nb0 + l, s = u * kUnit / F::S;
      __m512 scale = _mm512_loadu_ps(L.A + (nb * nS + s) * 16), low = _mm512_setzero_ps();
      if constexpr (F::TWO) low = _mm512_loadu_ps(L.B + (nb * nS + s) * 16);
      if constexpr (F::TWO && F::HAS_A) {
        const __m128i a = _mm_loadu_si128((const __m128i*)(L.a + (nb * nG + u) * 16));
        const __m128i b = _mm_loadu_si128((const __m128i*)(L.b + (nb * nG + u) * 16));
        scale = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)));
        low = _mm512_mul_ps(low, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 dxs = _mm512_mul_ps(_mm512_set1_ps(X.dx[(r0 + r) * nU + u]), scale);
        y[r][l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][l]), dxs, y[r][l]);
        if constexpr (F::TWO) y[r][l] = _mm512_fmadd_ps(low, _mm512_set1_ps(X.mins[(r0 + r) * nU + u]), y[r][l]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < NL; ++l) _mm512_storeu_ps(out + (r0 + r) * ld + (nb0 + l) * 16, y[r][l]);
}
#else
// The same integer sums and float steps in portable C++, one lane at a time.
template <class F, int R>
inline void lane_rows(const Layer& L, const Rows& X, int64_t nb, int64_t u0, int64_t u1, int64_t r0, float* out,
                      int64_t ld) {
  constexpr int H = kUnit / F::G;
  const int64_t nU = L.K / kUnit, nG = L.K / F::G, nS = L.K / F::S;
  for (int lane = 0; lane < 16; ++lane)
    for (int r = 0; r < R; ++r) {
      float* y = out + (r0 + r) * ld + nb * 16 + lane;
      for (int64_t u = u0; u < u1; ++u) {
        int32_t d = 0;
        for (int h = 0; h < H; ++h) {
          const int64_t g = u * H + h;
          const int8_t* x = X.xq + (r0 + r) * L.K + g * F::G;
          int32_t p = 0;
          for (int i = 0; i < F::G; ++i) p += code_at<F>(L, nb, lane, g * F::G + i) * int32_t(x[i]);
          if constexpr (!F::TWO) p -= X.sums[(r0 + r) * nG + g];
          if constexpr (!F::TWO && F::HAS_A) p *= int32_t(L.a[(nb * nG + g) * 16 + lane]);
          d += p;
        }
        const int64_t s = u * kUnit / F::S;
        float scale = L.A[(nb * nS + s) * 16 + lane], low = 0.0f;
        if constexpr (F::TWO) low = L.B[(nb * nS + s) * 16 + lane];
        if constexpr (F::TWO && F::HAS_A) {
          scale = scale * float(L.a[(nb * nG + u) * 16 + lane]);
          low = low * float(L.b[(nb * nG + u) * 16 + lane]);
        }
        *y = std::fma(float(d), X.dx[(r0 + r) * nU + u] * scale, *y);
        if constexpr (F::TWO) *y = std::fma(low, X.mins[(r0 + r) * nU + u], *y);
      }
    }
}

template <class F, int R, int NL>
inline void tile(const Layer& L, const Rows& X, int64_t nb0, int64_t u0, int64_t u1, int64_t r0, float* out,
                 int64_t ld) {
  for (int l = 0; l < NL; ++l) lane_rows<F, R>(L, X, nb0 + l, u0, u1, r0, out, ld);
}
#endif

// Every row of x through column blocks nb0..nb0+NL, a chunk of units at a time: a chunk's codes are
// read from memory once and from L1 by the later row tiles.
template <class F, int NL>
void columns(const Layer& L, const Rows& X, int64_t M, int64_t nb0, float* out, int64_t ld) {
  constexpr int RMAX = NL == 1 ? 8 : NL == 2 ? 2 : 1;
  const int64_t nU = L.K / kUnit;
  for (int64_t u0 = 0; u0 < nU; u0 += kChunk) {
    const int64_t u1 = std::min(nU, u0 + kChunk);
    for (int64_t r0 = 0; r0 < M;) {
      const int64_t left = M - r0;
      if (RMAX >= 8 && left >= 8) {
        tile<F, RMAX >= 8 ? 8 : 1, NL>(L, X, nb0, u0, u1, r0, out, ld);
        r0 += 8;
      } else if (RMAX >= 4 && left >= 4) {
        tile<F, RMAX >= 4 ? 4 : 1, NL>(L, X, nb0, u0, u1, r0, out, ld);
        r0 += 4;
      } else if (RMAX >= 4 && left == 3) {
        tile<F, RMAX >= 4 ? 3 : 1, NL>(L, X, nb0, u0, u1, r0, out, ld);
        r0 += 3;
      } else if (RMAX >= 2 && left >= 2) {
        tile<F, RMAX >= 2 ? 2 : 1, NL>(L, X, nb0, u0, u1, r0, out, ld);
        r0 += 2;
      } else {
        tile<F, 1, NL>(L, X, nb0, u0, u1, r0, out, ld);
        r0 += 1;
      }
    }
  }
}

// x's rows as int8 per unit of 32 values (round half to even), with each unit's scale.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t u = 0; u < K / kUnit; ++u) {
        const float* v = x + m * K + u * kUnit;
        float amax = 0.0f;
        for (int i = 0; i < kUnit; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        dx[m * (K / kUnit) + u] = amax / 127.0f;
        int8_t* q = xq + m * K + u * kUnit;
        for (int i = 0; i < kUnit; ++i) q[i] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(v[i] * inv))));
      }
  });
}

// Each sub-block's sum of the quantized rows, times c for one-scale types; for two-scale types
// (G = 32) also each unit's -(dx * sum), the low term's row factor.
void sub_block_sums(const int8_t* xq, const float* dx, int64_t M, int64_t K, int G, bool two, int32_t offset,
                    int32_t* sums, float* mins) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / G; ++g) {
      int32_t total = 0;
      for (int i = 0; i < G; ++i) total += xq[m * K + g * G + i];
      sums[m * (K / G) + g] = two ? total : total * offset;
      if (two) mins[m * (K / kUnit) + g] = -(dx[m * (K / kUnit) + g] * float(total));
    }
}

// Column blocks nb .. nb+count of one layer for every row (count <= width).
template <class F>
void column_group(const Layer& L, const Rows& X, int64_t M, int64_t nb, int64_t count, float* y, int64_t ld) {
  if (count == 4) {
    columns<F, 4>(L, X, M, nb, y, ld);
  } else if (count == 2) {
    columns<F, 2>(L, X, M, nb, y, ld);
  } else {
    for (int64_t b = nb; b < nb + count; ++b) columns<F, 1>(L, X, M, b, y, ld);
  }
}

using ColumnGroup = void (*)(const Layer&, const Rows&, int64_t, int64_t, int64_t, float*, int64_t);

struct Kind {
  ColumnGroup group;
  int G;
  bool two;
};

Kind format_of(const std::string& fmt) {
  if (fmt == "Q4_0") return {column_group<Q4_0>, Q4_0::G, Q4_0::TWO};
  if (fmt == "Q4_1") return {column_group<Q4_1>, Q4_1::G, Q4_1::TWO};
  if (fmt == "Q5_0") return {column_group<Q5_0>, Q5_0::G, Q5_0::TWO};
  if (fmt == "Q5_1") return {column_group<Q5_1>, Q5_1::G, Q5_1::TWO};
  if (fmt == "Q8_0") return {column_group<Q8_0>, Q8_0::G, Q8_0::TWO};
  if (fmt == "Q4_K") return {column_group<Q4_K>, Q4_K::G, Q4_K::TWO};
  if (fmt == "Q5_K") return {column_group<Q5_K>, Q5_K::G, Q5_K::TWO};
  if (fmt == "Q6_K") return {column_group<Q6_K>, Q6_K::G, Q6_K::TWO};
  TORCH_CHECK(false, "no kernel for GGUF type ", fmt);
}

const void* data_or_null(const torch::Tensor& t) { return t.numel() ? t.data_ptr() : nullptr; }

}  // namespace

// x: [M, K] float32, through layers that all read it (a model's q/k/v or gate/up projections): one
// quantization of x and one parallel pass over every layer's column blocks. fmts[i]: layer i's GGUF
// type's name; the other lists hold its packed tensors (speculum.kernels.quant.pack). Returns each
// layer's [M, NB*16] float32 product (no bias); every row the same bits as any other call gives it.
std::vector<torch::Tensor> linear_group(torch::Tensor x, std::vector<std::string> fmts, std::vector<torch::Tensor> codes,
                                        std::vector<torch::Tensor> high, std::vector<torch::Tensor> a,
                                        std::vector<torch::Tensor> b, std::vector<torch::Tensor> A,
                                        std::vector<torch::Tensor> B, std::vector<int64_t> offsets, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [M, K] float32");
  const size_t n = fmts.size();
  TORCH_CHECK(n > 0 && codes.size() == n && high.size() == n && a.size() == n && b.size() == n && A.size() == n &&
                  B.size() == n && offsets.size() == n,
              "one entry per layer in every list");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kUnit == 0, "x's width is not a multiple of 32");
  auto as = [&](at::ScalarType type) { return x.options().dtype(type); };
  torch::Tensor xq = torch::empty({M, K}, as(torch::kChar)), dx = torch::empty({M, K / kUnit}, as(torch::kFloat));
  quantize_rows(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>());
  // One column block per tile: its codes are one sequential stream, which memory serves fastest.
  if (width <= 0) width = 1;
  std::vector<Layer> layers;
  std::vector<Kind> kinds;
  std::vector<Rows> rows;
  std::vector<torch::Tensor> outs, keep;
  std::vector<int64_t> first{0};  // each layer's first column group in the pass
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(codes[i].dim() == 3 && codes[i].size(2) == 64 && codes[i].scalar_type() == at::kByte,
                "codes: [NB, *, 64] uint8");
    TORCH_CHECK(A[i].dim() == 3 && A[i].size(0) == codes[i].size(0) && A[i].size(2) == 16, "A: [NB, K/S, 16] float32");
    TORCH_CHECK(codes[i].size(1) * (fmts[i] == "Q8_0" ? 4 : 8) == K, "x's width differs from the packed weights'");
    const Kind kind = format_of(fmts[i]);
    layers.push_back(Layer{codes[i].data_ptr<uint8_t>(), static_cast<const uint64_t*>(data_or_null(high[i])),
                           static_cast<const int8_t*>(data_or_null(a[i])),
                           static_cast<const int8_t*>(data_or_null(b[i])), A[i].data_ptr<float>(),
                           static_cast<const float*>(data_or_null(B[i])), K, codes[i].size(0), int32_t(offsets[i])});
    torch::Tensor sums = torch::empty({M, K / kind.G}, as(torch::kInt));
    torch::Tensor mins = torch::empty({kind.two ? M : 0, K / kUnit}, as(torch::kFloat));
    sub_block_sums(xq.data_ptr<int8_t>(), dx.data_ptr<float>(), M, K, kind.G, kind.two, int32_t(offsets[i]),
                   sums.data_ptr<int32_t>(), kind.two ? mins.data_ptr<float>() : nullptr);
    rows.push_back(Rows{xq.data_ptr<int8_t>(), dx.data_ptr<float>(), sums.data_ptr<int32_t>(),
                        kind.two ? mins.data_ptr<float>() : nullptr});
    keep.push_back(sums);
    keep.push_back(mins);
    kinds.push_back(kind);
    outs.push_back(torch::zeros({M, layers[i].NB * 16}, as(torch::kFloat)));
    first.push_back(first.back() + (layers[i].NB + width - 1) / width);
  }
  if (M == 0) return outs;
  at::parallel_for(0, first.back(), 1, [&](int64_t c0, int64_t c1) {
    size_t i = 0;
    for (int64_t c = c0; c < c1; ++c) {
      while (c >= first[i + 1]) ++i;
      const Layer& L = layers[i];
      const int64_t nb = (c - first[i]) * width;
      kinds[i].group(L, rows[i], M, nb, std::min(width, L.NB - nb), outs[i].data_ptr<float>(), L.NB * 16);
    }
  });
  return outs;
}

// One layer: linear_group of one.
torch::Tensor linear(torch::Tensor x, std::string fmt, torch::Tensor codes, torch::Tensor high, torch::Tensor a,
                     torch::Tensor b, torch::Tensor A, torch::Tensor B, int64_t offset, int64_t width) {
  return linear_group(x, {fmt}, {codes}, {high}, {a}, {b}, {A}, {B}, {offset}, width)[0];
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "GGUF-quantized linear, row-count invariant");
  m.def("linear_group", &linear_group, "GGUF-quantized linear layers reading the same x, in one pass");
}
