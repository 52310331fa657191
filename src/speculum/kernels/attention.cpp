// Exact mode's attention: each query's output is computed from that query and the keys and values
// it sees, in their order, by one fixed sequence of float32 operations. Nothing about the forward
// around it (other queries, tree nodes, batch rows, where its keys sit in the cache, the thread
// count) enters the arithmetic, so a query has the same bits in every layout by construction.
//
// Built with -ffp-contract=off and without fast-math: the compiler neither fuses nor reorders
// anything but the explicit fused multiply-adds, so the vectorized builds and the portable one give
// the same bits (GCC's 16-lane vector type is lowered to whatever registers the build has; lane l is
// the same operations on the same values in each).
//
// Per query head, over its n keys k_i (increasing cache columns):
//   s_i = lane_sum(fma over the head dimension, 16 lanes) * scale   lane_sum: one fixed tree
//   e_i = exp(s_i - max_i s_i)               a Cephes-style exp of multiplies and adds, lane-wise
//   sum = lane_sum over i of e_i (lane i % 16)
//   out = (fma over i, in order, of e_i * v_i) / sum
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;
typedef float v16 __attribute__((vector_size(64)));  // lane-wise IEEE operations in every build

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The 16 lanes added in one fixed tree: l + (l + 8), then + (l + 4), then (0 + 2) + (1 + 3).
[[gnu::always_inline]] inline float lane_sum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

typedef int32_t i16 __attribute__((vector_size(64)));

// exp(x) lane by lane for x <= 0 (Cephes expf: 2^n times a polynomial on the remainder), 0 below -87.
[[gnu::always_inline]] inline v16 exp_nonpositive(v16 x) {
  const i16 under = x < -87.0f;
  x = under ? v16{} : x;
  const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // rounded to nearest
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r;
  p = p + 1.0f;
  const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
  const v16 result = p * reinterpret_cast<const v16&>(bits);
  return under ? v16{} : result;
}

[[gnu::always_inline]] inline v16 fmadd(v16 a, v16 b, v16 c) {  // one rounding per lane, as vfmadd
  v16 r;
  for (int l = 0; l < kLanes; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
}

[[gnu::always_inline]] inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Shape {
  int64_t batch, heads, queries, dim, kv_heads;
  int64_t key_strides[3], value_strides[3];  // batch, head, position (the dimension is contiguous)
};

// Keys and values of one row and key/value head, as float32 rows of `padded` values (zeros beyond
// the head dimension): read in place for a float32 cache whose dimension needs no padding, else copied.
template <typename T>
struct Rows {
  std::vector<float> held;
  const float* first = nullptr;
  int64_t stride = 0;

  void read(const T* base, int64_t position_stride, const int64_t* columns, int64_t count, int64_t dim,
            int64_t padded) {
    if constexpr (std::is_same_v<T, float>) {
      if (dim == padded && count > 0 && columns[count - 1] - columns[0] == count - 1) {  // one run
        first = base + columns[0] * position_stride, stride = position_stride;
        return;
      }
    }
    held.assign(count * padded, 0.0f);
    for (int64_t u = 0; u < count; ++u) {
      const T* src = base + columns[u] * position_stride;
      for (int64_t d = 0; d < dim; ++d) held[u * padded + d] = static_cast<float>(src[d]);
    }
    first = held.data(), stride = padded;
  }
  const float* row(int64_t u) const { return first + u * stride; }
};

// One (row, key/value head): the scores of every query head of the row's queries against every key
// any of them sees (16 lanes of fused multiply-adds over the head dimension, then lane_sum); then per
// query head, over its own keys in order, the softmax and the weighted sum of values.
template <typename T>
void attend_items(const T* query, const T* key, const T* value, const int64_t* row_columns,
                  const int64_t* row_offsets, const int64_t* counts, const int64_t* offsets, const int64_t* local,
                  float scale, const Shape& s, float* out) {
  const int64_t groups = s.heads / s.kv_heads, dim = s.dim;
  const int64_t vectors = (dim + kLanes - 1) / kLanes, padded = vectors * kLanes;
  const int64_t heads_of_row = s.queries * groups;
  at::parallel_for(0, s.batch * s.kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> q((heads_of_row + 3) / 4 * 4 * padded, 0.0f), scores, weights;
    std::vector<v16> acc(vectors);
    Rows<T> keys, values;
    for (int64_t item = first; item < last; ++item) {
      const int64_t g = item % s.kv_heads, b = item / s.kv_heads;
      const int64_t* columns = row_columns + row_offsets[b];
      const int64_t seen = row_offsets[b + 1] - row_offsets[b], width = (seen + kLanes - 1) / kLanes * kLanes;
      keys.read(key + b * s.key_strides[0] + g * s.key_strides[1], s.key_strides[2], columns, seen, dim, padded);
      values.read(value + b * s.value_strides[0] + g * s.value_strides[1], s.value_strides[2], columns, seen, dim,
                   padded);
      for (int64_t j = 0; j < s.queries; ++j)
        for (int64_t r = 0; r < groups; ++r) {
          const T* src = query + ((b * s.heads + g * groups + r) * s.queries + j) * dim;
          float* dst = &q[(j * groups + r) * padded];
          for (int64_t d = 0; d < padded; ++d) dst[d] = d < dim ? static_cast<float>(src[d]) : 0.0f;
        }
      scores.assign(heads_of_row * width, 0.0f);
      for (int64_t u = 0; u < seen; ++u) {
        const float* k = keys.row(u);
        for (int64_t h = 0; h < heads_of_row; h += 4) {  // four heads side by side, each its own sums
          v16 dot[4] = {};
          const float* qh = &q[h * padded];
          for (int64_t c = 0; c < padded; c += kLanes) {
            const v16 kc = load16(k + c);
            for (int t = 0; t < 4; ++t) dot[t] = fmadd(load16(qh + t * padded + c), kc, dot[t]);
          }
          for (int t = 0; t < 4 && h + t < heads_of_row; ++t) scores[(h + t) * width + u] = lane_sum(dot[t]) * scale;
        }
      }
      for (int64_t j = 0; j < s.queries; ++j) {
        const int64_t pair = b * s.queries + j, n = counts[pair];
        const int64_t* mine = local + offsets[pair];
        for (int64_t r = 0; r < groups; ++r) {
          float* target = out + ((pair * s.heads) + g * groups + r) * dim;
          if (n == 0) {
            std::fill(target, target + dim, 0.0f);
            continue;
          }
          const float* sh = &scores[(j * groups + r) * width];
          const int64_t own = (n + kLanes - 1) / kLanes * kLanes;
          weights.assign(own, 0.0f);
          float top = sh[mine[0]];
          for (int64_t i = 1; i < n; ++i) top = std::max(top, sh[mine[i]]);
          for (int64_t i = 0; i < n; ++i) weights[i] = sh[mine[i]] - top;
          v16 lanes{};
          for (int64_t c = 0; c < own; c += kLanes) {
            v16 e = exp_nonpositive(load16(&weights[c]));
            for (int64_t l = std::max<int64_t>(0, n - c); l < kLanes; ++l) e[l] = 0.0f;  // beyond the keys
            std::memcpy(&weights[c], &e, sizeof e);
            lanes = lanes + e;
          }
          const float total = lane_sum(lanes);
          std::fill(acc.begin(), acc.end(), v16{});
          for (int64_t i = 0; i < n; ++i) {
            const float* v = values.row(mine[i]);
            const v16 w = v16{} + weights[i];
            for (int64_t c = 0; c < vectors; ++c) acc[c] = fmadd(w, load16(v + c * kLanes), acc[c]);
          }
          const float* o = reinterpret_cast<const float*>(acc.data());
          for (int64_t d = 0; d < dim; ++d) target[d] = o[d] / total;
        }
      }
    }
  });
}

// query [B, H, Q, D] contiguous; key, value [B, KVH, T, D] with D contiguous. Row b's queries see,
// among `row_columns[row_offsets[b]:row_offsets[b+1]]` (cache columns, increasing), the `counts[p]`
// listed in `local` from `offsets[p]` (positions in that list, in order), p = b * Q + j.
// Returns [B, Q, H, D] float32.
torch::Tensor attend(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor row_columns,
                     torch::Tensor row_offsets, torch::Tensor counts, torch::Tensor offsets, torch::Tensor local,
                     double scale) {
  TORCH_CHECK(query.is_contiguous() && key.stride(3) == 1 && value.stride(3) == 1, "attend: layout");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(), "attend: dtypes");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "attend: heads");
  TORCH_CHECK(query.scalar_type() != torch::kDouble, "attend: float64 keeps the model's own attention");
  Shape s{query.size(0), query.size(1), query.size(2), query.size(3), key.size(1),
          {key.stride(0), key.stride(1), key.stride(2)}, {value.stride(0), value.stride(1), value.stride(2)}};
  auto out = torch::empty({s.batch, s.queries, s.heads, s.dim}, query.options().dtype(torch::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "attend", [&] {
    attend_items<scalar_t>(query.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
                           row_columns.data_ptr<int64_t>(), row_offsets.data_ptr<int64_t>(),
                           counts.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), local.data_ptr<int64_t>(),
                           static_cast<float>(scale), s, out.data_ptr<float>());
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "exact mode's attention: each query in one fixed order of float32 operations");
}
