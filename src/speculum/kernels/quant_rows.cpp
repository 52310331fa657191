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

#if defined(__AVX512VNNI__) || defined(__AVX2__)
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Sixteen lanes (one per output column of a block) in one 512-bit register.
namespace simd {
constexpr bool kWide = true;  // 32 registers: tiles of up to 8 rows
using Bytes = __m512i;        // a code vector: 4 codes per lane
using Ints = __m512i;
using Floats = __m512;
inline Bytes load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline Bytes low_nibbles(Bytes v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline Bytes high_nibbles(Bytes v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline Bytes add_where(Bytes v, uint64_t mask, int value) {  // value added to the bytes whose mask bit is set
  return _mm512_mask_add_epi8(v, mask, v, _mm512_set1_epi8(char(value)));
}
inline Ints zero() { return _mm512_setzero_si512(); }
// acc + each lane's 4 codes times the 4 activations of quad (unsigned codes, signed activations)
inline Ints dot(Ints acc, Bytes codes, int32_t quad) { return _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(quad)); }
Ints signed_dot(Ints acc, Bytes codes, int32_t quad);  // never used: vpdpbusd has no int16 step to saturate
inline Ints add(Ints a, Ints b) { return _mm512_add_epi32(a, b); }
inline Ints sub(Ints a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline Ints mul(Ints a, Ints b) { return _mm512_mullo_epi32(a, b); }
inline Ints load_int8(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline Floats to_float(Ints v) { return _mm512_cvtepi32_ps(v); }
inline Floats load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Floats v) { _mm512_storeu_ps(p, v); }
inline Floats zero_floats() { return _mm512_setzero_ps(); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats mul(float a, Floats b) { return _mm512_mul_ps(_mm512_set1_ps(a), b); }
inline Floats fma(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats fma(Floats a, float b, Floats c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
}  // namespace simd
#define SPECULUM_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
// Sixteen lanes in two 256-bit registers; the 4-code dot product is vpmaddubsw (pairs to int16: at
// most 2 * 63 * 127, no saturation for codes of up to 6 bits) then vpmaddwd (pairs to int32).
namespace simd {
constexpr bool kWide = false;  // 16 registers: tiles of up to 2 rows
struct Bytes {
  __m256i lo, hi;
};
struct Ints {
  __m256i lo, hi;
};
struct Floats {
  __m256 lo, hi;
};
inline Bytes load_bytes(const uint8_t* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32))};
}
inline __m256i nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline Bytes low_nibbles(Bytes v) { return {nibbles(v.lo), nibbles(v.hi)}; }
inline Bytes high_nibbles(Bytes v) { return {nibbles(_mm256_srli_epi16(v.lo, 4)), nibbles(_mm256_srli_epi16(v.hi, 4))}; }
inline __m256i add_where(__m256i v, uint32_t mask, int value) {
  const __m256i select = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bits = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  const __m256i spread = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(mask)), select), bits);
  return _mm256_add_epi8(v, _mm256_and_si256(_mm256_cmpeq_epi8(spread, bits), _mm256_set1_epi8(char(value))));
}
inline Bytes add_where(Bytes v, uint64_t mask, int value) {
  return {add_where(v.lo, uint32_t(mask), value), add_where(v.hi, uint32_t(mask >> 32), value)};
}
inline Ints zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline __m256i dot(__m256i acc, __m256i codes, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
}
inline Ints dot(Ints acc, Bytes codes, int32_t quad) {
  const __m256i x = _mm256_set1_epi32(quad);
  return {dot(acc.lo, codes.lo, x), dot(acc.hi, codes.hi, x)};
}
// The same sum for 8-bit codes c (which could saturate int16): (c - 128) . x, as |c - 128| times
// x with c - 128's sign; the caller then leaves out the offset it would subtract.
inline __m256i signed_dot(__m256i acc, __m256i codes, __m256i x) {
  const __m256i w = _mm256_xor_si256(codes, _mm256_set1_epi8(char(0x80)));
  const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
}
inline Ints signed_dot(Ints acc, Bytes codes, int32_t quad) {
  const __m256i x = _mm256_set1_epi32(quad);
  return {signed_dot(acc.lo, codes.lo, x), signed_dot(acc.hi, codes.hi, x)};
}
inline Ints add(Ints a, Ints b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline Ints sub(Ints a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline Ints mul(Ints a, Ints b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline Ints load_int8(const int8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)))};
}
inline Floats to_float(Ints v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline Floats load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, Floats v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline Floats zero_floats() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Floats mul(Floats a, Floats b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Floats mul(float a, Floats b) {
  const __m256 v = _mm256_set1_ps(a);
  return {_mm256_mul_ps(v, b.lo), _mm256_mul_ps(v, b.hi)};
}
inline Floats fma(Floats a, Floats b, Floats c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Floats fma(Floats a, float b, Floats c) {
  const __m256 v = _mm256_set1_ps(b);
  return {_mm256_fmadd_ps(a.lo, v, c.lo), _mm256_fmadd_ps(a.hi, v, c.hi)};
}
}  // namespace simd
#define SPECULUM_SIMD 1
#endif

#if defined(SPECULUM_SIMD)
// 8-bit codes take signed_dot where the build has one (the offset is then already in the sum).
template <class F>
constexpr bool kSignedDot = F::BITS == 8 && !simd::kWide;

// Code vectors t of column block nb (k = 8t .. 8t+7): lo holds k = 8t..8t+3, hi k = 8t+4..8t+7.
template <class F>
inline void unpack(const Layer& L, int64_t nb, int64_t t, simd::Bytes& lo, simd::Bytes& hi) {
  if constexpr (F::BITS == 8) {
    const uint8_t* src = L.codes + (nb * (L.K / 4) + 2 * t) * 64;
    _mm_prefetch((const char*)(src + 2 * kAhead * 64), _MM_HINT_T0);
    _mm_prefetch((const char*)(src + (2 * kAhead + 1) * 64), _MM_HINT_T0);
    lo = simd::load_bytes(src);
    hi = simd::load_bytes(src + 64);
  } else {
    const int64_t at = nb * (L.K / 8) + t;
    _mm_prefetch((const char*)(L.codes + (at + kAhead) * 64), _MM_HINT_T0);
    const simd::Bytes v = simd::load_bytes(L.codes + at * 64);
    lo = simd::low_nibbles(v);
    hi = simd::high_nibbles(v);
    for (int p = 0; p < F::BITS - 4; ++p) {
      lo = simd::add_where(lo, L.high[(at * 2) * (F::BITS - 4) + p], 1 << (4 + p));
      hi = simd::add_where(hi, L.high[(at * 2 + 1) * (F::BITS - 4) + p], 1 << (4 + p));
    }
  }
}

inline int32_t quad_at(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, 4);
  return quad;
}

template <class F>
inline simd::Ints dot(simd::Ints acc, simd::Bytes codes, int32_t quad) {
  if constexpr (kSignedDot<F>) return simd::signed_dot(acc, codes, quad);
  return simd::dot(acc, codes, quad);
}

// Units u0..u1 for rows r0..r0+R and column blocks nb0..nb0+NL, added into out (row stride ld).
// R x NL independent dot-product chains keep the multiply unit busy at one row as at many.
template <class F, int R, int NL>
inline void tile(const Layer& L, const Rows& X, int64_t nb0, int64_t u0, int64_t u1, int64_t r0, float* out,
                 int64_t ld) {
  using namespace simd;
  constexpr int H = kUnit / F::G, PAIRS = F::G / 8;  // sub-blocks per unit, code vector pairs per sub-block
  constexpr bool SPLIT = kWide && R * NL <= 2;        // two chains per tile where too few would wait on latency
  static_assert(!F::TWO || F::G == kUnit, "two-scale types keep one sub-block per unit");
  const int64_t nU = L.K / kUnit, nG = L.K / F::G, nS = L.K / F::S;
  Floats y[R][NL];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < NL; ++l) y[r][l] = load(out + (r0 + r) * ld + (nb0 + l) * 16);
  for (int64_t u = u0; u < u1; ++u) {
    for (int l = 0; l < NL; ++l) {  // the scales' streams too: the hardware prefetcher tracks few
      if (F::HAS_A) _mm_prefetch((const char*)(L.a + ((nb0 + l) * nG + (u + 4) * H) * 16), _MM_HINT_T0);
      if (F::HAS_B) _mm_prefetch((const char*)(L.b + ((nb0 + l) * nG + (u + 4) * H) * 16), _MM_HINT_T0);
      if ((u * kUnit) % F::S == 0) {
        _mm_prefetch((const char*)(L.A + ((nb0 + l) * nS + u * kUnit / F::S + 2) * 16), _MM_HINT_T0);
        if (F::TWO) _mm_prefetch((const char*)(L.B + ((nb0 + l) * nS + u * kUnit / F::S + 2) * 16), _MM_HINT_T0);
      }
    }
    Ints d[R][NL];
    for (int h = 0; h < H; ++h) {
      const int64_t g = u * H + h;
      Ints part[R][NL], second[R][NL];
      for (int r = 0; r < R; ++r)
        for (int l = 0; l < NL; ++l) part[r][l] = second[r][l] = zero();
      for (int t = 0; t < PAIRS; ++t) {
        Bytes lo[NL], hi[NL];
        for (int l = 0; l < NL; ++l) unpack<F>(L, nb0 + l, g * PAIRS + t, lo[l], hi[l]);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = X.xq + (r0 + r) * L.K + g * F::G + 8 * t;
          const int32_t x0 = quad_at(x), x1 = quad_at(x + 4);
          for (int l = 0; l < NL; ++l) {
            if constexpr (SPLIT) {
              part[r][l] = dot<F>(part[r][l], lo[l], x0);
              second[r][l] = dot<F>(second[r][l], hi[l], x1);
            } else {
              part[r][l] = dot<F>(dot<F>(part[r][l], lo[l], x0), hi[l], x1);
            }
          }
        }
      }
      if constexpr (SPLIT)  // integer sums: the split changes no bit
        for (int r = 0; r < R; ++r)
          for (int l = 0; l < NL; ++l) part[r][l] = add(part[r][l], second[r][l]);
      for (int l = 0; l < NL; ++l) {
        Ints a = zero();
        if constexpr (!F::TWO && F::HAS_A) a = load_int8(L.a + ((nb0 + l) * nG + g) * 16);
        for (int r = 0; r < R; ++r) {
          Ints p = part[r][l];
          if constexpr (!F::TWO && !kSignedDot<F>) p = sub(p, X.sums[(r0 + r) * nG + g]);
          if constexpr (!F::TWO && F::HAS_A) p = mul(p, a);
          d[r][l] = h == 0 ? p : add(d[r][l], p);
        }
      }
    }
    for (int l = 0; l < NL; ++l) {
      const int64_t nb = nb0 + l, s = u * kUnit / F::S;
      Floats scale = load(L.A + (nb * nS + s) * 16), low = zero_floats();
      if constexpr (F::TWO) low = load(L.B + (nb * nS + s) * 16);
      if constexpr (F::TWO && F::HAS_A) {
        scale = mul(scale, to_float(load_int8(L.a + (nb * nG + u) * 16)));
        low = mul(low, to_float(load_int8(L.b + (nb * nG + u) * 16)));
      }
      for (int r = 0; r < R; ++r) {
        y[r][l] = fma(to_float(d[r][l]), mul(X.dx[(r0 + r) * nU + u], scale), y[r][l]);
        if constexpr (F::TWO) y[r][l] = fma(low, X.mins[(r0 + r) * nU + u], y[r][l]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < NL; ++l) store(out + (r0 + r) * ld + (nb0 + l) * 16, y[r][l]);
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

#if defined(SPECULUM_SIMD)
constexpr int kTileRows = simd::kWide ? 8 : 2;  // rows a tile's registers hold
#else
constexpr int kTileRows = 8;
#endif

// Every row of x through column blocks nb0..nb0+NL, a chunk of units at a time: a chunk's codes are
// read from memory once and from L1 by the later row tiles.
template <class F, int NL>
void columns(const Layer& L, const Rows& X, int64_t M, int64_t nb0, float* out, int64_t ld) {
  constexpr int RMAX = NL == 1 ? kTileRows : NL == 2 ? 2 : 1;
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
