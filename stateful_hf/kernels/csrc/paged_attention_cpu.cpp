// Paged attention on the CPU: packed ragged queries over K/V blocks read in place from the pool.
//
// Work item = (sub-request s, row tile [r0, r1), KV head h): its G = Hq / Hkv query heads of every row in
// the tile share each split of BS keys (the split divides the pool's block size PB; default PB),
// converted to float once per split (K transposed to [D][BS]: 16 x 16 tiles in registers with AVX-512).
// Per query row and head the arithmetic is fixed, whatever else the batch holds: scores over one block
// (a d-ordered sum per key), an online softmax over blocks in ascending order, all in float32, so a
// row's output depends neither on the other rows of its tile or step nor on the thread count.
// Shapes: q [T, Hq, D] (strided rows/heads, unit last stride); caches [NB, BS, Hkv, D] (any strides but
// the last); items [N, 3] int64 (s, r0, r1); q_pos [T], kv_len [S], block_table [S, W] int64.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// expf by Cody-Waite reduction and Cephes' polynomial (about 1 ulp), branch-free so the loops using it
// vectorize; inputs below -87 give ~1e-38 instead of 0 (callers mask with p = 0 where they mean -inf).
inline float exp_f(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// sc[i][j] = sum over d ascending of q[i][d] * kt[d][j], for the n query vectors of a tile and the BS keys
// of a block. Up to four vectors at a time (independent chains hide the FMA latency: a decode's G = 3 heads of
// one KV head go together); every sum is the same sequence of operations whether its vector goes alone or in a
// group.
template <int64_t BS_T, int N>
inline void scores_group(const float* qf, const float* kt, float* sc, int64_t i, int64_t D) {
  float t[N][BS_T] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = kt + d * BS_T;
    for (int g = 0; g < N; ++g) {
      const float a = qf[(i + g) * D + d];
#pragma omp simd
      for (int64_t j = 0; j < BS_T; ++j) t[g][j] += a * kd[j];
    }
  }
  for (int g = 0; g < N; ++g) std::copy(t[g], t[g] + BS_T, sc + (i + g) * BS_T);
}

template <int64_t BS_T>
void scores(const float* qf, const float* kt, float* sc, int64_t n, int64_t D, int64_t BS) {
  int64_t i = 0;
  if constexpr (BS_T > 0) {
    for (; i + 4 <= n; i += 4) scores_group<BS_T, 4>(qf, kt, sc, i, D);
    if (n - i == 3) scores_group<BS_T, 3>(qf, kt, sc, i, D);
    else if (n - i == 2) scores_group<BS_T, 2>(qf, kt, sc, i, D);
    else if (n - i == 1) scores_group<BS_T, 1>(qf, kt, sc, i, D);
  } else {
    for (; i < n; ++i) {
      float* s = sc + i * BS;
      const float* q0 = qf + i * D;
      std::fill(s, s + BS, 0.0f);
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kt + d * BS;
        const float a0 = q0[d];
#pragma omp simd
        for (int64_t j = 0; j < BS; ++j) s[j] += a0 * kd[j];
      }
    }
  }
}

// kt[d][j] = float(k[j][d]) for the BS keys of a block (rows ks1 apart): a copy, so any way of doing it gives the
// same floats. With AVX-512, 16 x 16 tiles are transposed in registers (D and BS multiples of 16); else element
// by element.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {              // bf16 -> f32: the 16 bits become the high half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <typename scalar_t>
constexpr bool kTileable = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;

inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 16; i += 8) {
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
      t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
  }
}
#endif

template <typename scalar_t>
void load_keys(const scalar_t* kb, int64_t ks1, int64_t D, int64_t BS, float* kt) {
#if defined(__AVX512F__)
  if constexpr (kTileable<scalar_t>) {
    if (D % 16 == 0 && BS % 16 == 0) {
      __m512 r[16];
      for (int64_t j0 = 0; j0 < BS; j0 += 16) {
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          for (int i = 0; i < 16; ++i) r[i] = load16(kb + (j0 + i) * ks1 + d0);
          transpose16(r);
          for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d0 + i) * BS + j0, r[i]);
        }
      }
      return;
    }
  }
#endif
  for (int64_t j = 0; j < BS; ++j) {
    const scalar_t* kj = kb + j * ks1;
    for (int64_t d = 0; d < D; ++d) kt[d * BS + j] = static_cast<float>(kj[d]);
  }
}

// BS_T, D_T: the block size and head dim known at compile time (0: read at run time), so the loops over a
// block's keys and a head's dims unroll and keep their accumulators in registers. Same arithmetic either way.
template <typename scalar_t, int64_t BS_T, int64_t D_T>
void attend_item(const scalar_t* q, int64_t qs0, int64_t qs1, const scalar_t* kc, const scalar_t* vc,
                 int64_t ks0, int64_t ks1, int64_t ks2, int64_t vs0, int64_t vs1, int64_t vs2,
                 const int64_t* q_pos, int64_t kv_len, const int64_t* table, scalar_t* out, int64_t os0,
                 int64_t os1, int64_t r0, int64_t r1, int64_t h, int64_t G, int64_t D_rt, int64_t BS_rt,
                 int64_t PB, float scale, int64_t window, float softcap, std::vector<float>& buf) {
  const int64_t BS = BS_T ? BS_T : BS_rt, D = D_T ? D_T : D_rt;
  const int64_t R = r1 - r0, RG = R * G;
  buf.resize(static_cast<size_t>(2 * D * BS + RG * (BS + D + 2 + D)));
  float* kt = buf.data();                  // [D][BS] the block's keys, transposed
  float* vf = kt + D * BS;                 // [BS][D] the block's values
  float* sc = vf + BS * D;                 // [RG][BS] scores of one block
  float* acc = sc + RG * BS;               // [RG][D]
  float* m = acc + RG * D;                 // [RG] running max
  float* l = m + RG;                       // [RG] running sum
  float* qf = l + RG;                      // [RG][D] the queries in float
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;   // keys any row of the tile reads: [lo, hi)
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t end = std::min(q_pos[r] + 1, kv_len);
    const int64_t start = window > 0 ? std::max<int64_t>(0, q_pos[r] - window + 1) : 0;
    lo = std::min(lo, start);
    hi = std::max(hi, end);
    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* src = q + r * qs0 + (h * G + g) * qs1;
      float* dst = qf + ((r - r0) * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
    }
  }
  std::fill(acc, acc + RG * D, 0.0f);
  std::fill(m, m + RG, -std::numeric_limits<float>::infinity());
  std::fill(l, l + RG, 0.0f);
  for (int64_t b = lo / BS; b * BS < hi; ++b) {             // split b: keys [b * BS, (b + 1) * BS)
    const int64_t blk = table[b * BS / PB], off = b * BS % PB; // in pool block blk from row off (PB % BS == 0)
    const scalar_t* kb = kc + blk * ks0 + off * ks1 + h * ks2;
    const scalar_t* vb = vc + blk * vs0 + off * vs1 + h * vs2;
    load_keys(kb, ks1, D, BS, kt);
    for (int64_t j = 0; j < BS; ++j) {
      const scalar_t* vj = vb + j * vs1;
      for (int64_t d = 0; d < D; ++d) vf[j * D + d] = static_cast<float>(vj[d]);
    }
    scores<BS_T>(qf, kt, sc, RG, D, BS);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t end = std::min(q_pos[r] + 1, kv_len);
      const int64_t start = window > 0 ? std::max<int64_t>(0, q_pos[r] - window + 1) : 0;
      const int64_t j0 = std::max<int64_t>(start - b * BS, 0), j1 = std::min<int64_t>(end - b * BS, BS);
      if (j1 <= j0) continue;                                  // this row reads no key of this block
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = (r - r0) * G + g;
        float* s = sc + i * BS;
        float bm = -std::numeric_limits<float>::infinity();
        for (int64_t j = j0; j < j1; ++j) {
          float x = s[j] * scale;
          if (softcap > 0.0f) x = softcap * std::tanh(x / softcap);
          s[j] = x;
          bm = std::max(bm, x);
        }
        const float mn = std::max(m[i], bm);
        const float corr = m[i] == -std::numeric_limits<float>::infinity() ? 0.0f : exp_f(m[i] - mn);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = j0; j < j1; ++j) {
          s[j] = exp_f(s[j] - mn);
          sum += s[j];
        }
        l[i] = l[i] * corr + sum;
        m[i] = mn;
        float* a = acc + i * D;
        if constexpr (D_T > 0) {                               // the same sums, in registers
          float t[D_T];
          for (int64_t d = 0; d < D_T; ++d) t[d] = a[d] * corr;
          for (int64_t j = j0; j < j1; ++j) {
            const float p = s[j];
            const float* v = vf + j * D_T;
#pragma omp simd
            for (int64_t d = 0; d < D_T; ++d) t[d] += p * v[d];
          }
          std::copy(t, t + D_T, a);
        } else {
          for (int64_t d = 0; d < D; ++d) a[d] *= corr;
          for (int64_t j = j0; j < j1; ++j) {
            const float p = s[j];
            const float* v = vf + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
          }
        }
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = (r - r0) * G + g;
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;      // a row that sees no key gives 0
      scalar_t* o = out + r * os0 + (h * G + g) * os1;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[i * D + d] * inv);
    }
  }
}

template <typename scalar_t>
using ItemFn = decltype(&attend_item<scalar_t, 0, 0>);

// The item function with the block's split and the head dim unrolled where they are the common ones: splits
// of 16, 32, 64 keys; head dims of the supported families (64, 80, 96, 128, 256) and of small test models (16,
// 32). Any other shape runs the same arithmetic with both read at run time.
template <typename scalar_t, int64_t BS_T>
ItemFn<scalar_t> pick_dim(int64_t D) {
  switch (D) {
    case 16: return &attend_item<scalar_t, BS_T, 16>;
    case 32: return &attend_item<scalar_t, BS_T, 32>;
    case 64: return &attend_item<scalar_t, BS_T, 64>;
    case 80: return &attend_item<scalar_t, BS_T, 80>;
    case 96: return &attend_item<scalar_t, BS_T, 96>;
    case 128: return &attend_item<scalar_t, BS_T, 128>;
    case 256: return &attend_item<scalar_t, BS_T, 256>;
    default: return &attend_item<scalar_t, BS_T, 0>;
  }
}

template <typename scalar_t>
ItemFn<scalar_t> pick_item(int64_t BS, int64_t D) {
  switch (BS) {
    case 16: return pick_dim<scalar_t, 16>(D);
    case 32: return pick_dim<scalar_t, 32>(D);
    case 64: return pick_dim<scalar_t, 64>(D);
    default: return &attend_item<scalar_t, 0, 0>;
  }
}

torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                              const torch::Tensor& value_cache, const torch::Tensor& items,
                              const torch::Tensor& q_pos, const torch::Tensor& kv_len,
                              const torch::Tensor& block_table, double scale, int64_t window, double softcap,
                              int64_t split) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "shapes");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "the head dim must be contiguous");
  TORCH_CHECK(items.dtype() == torch::kInt64 && q_pos.dtype() == torch::kInt64 && kv_len.dtype() == torch::kInt64 &&
                  block_table.dtype() == torch::kInt64,
              "int64 metadata");
  TORCH_CHECK(items.is_contiguous() && q_pos.is_contiguous() && kv_len.is_contiguous() && block_table.is_contiguous(),
              "contiguous metadata");
  const int64_t hq = query.size(1), D = query.size(2), PB = key_cache.size(1), hkv = key_cache.size(2);
  const int64_t BS = split > 0 ? split : PB;                  // the split: keys per online-softmax step
  TORCH_CHECK(hq % hkv == 0 && key_cache.size(3) == D, "heads");
  TORCH_CHECK(PB % BS == 0, "the split must divide the block size");
  const int64_t G = hq / hkv, W = block_table.size(1), N = items.size(0);
  auto out = torch::zeros({query.size(0), hq, D}, query.options());
  const int64_t* it = items.data_ptr<int64_t>();
  const int64_t* pos = q_pos.data_ptr<int64_t>();
  const int64_t* kvl = kv_len.data_ptr<int64_t>();
  const int64_t* tab = block_table.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_cpu", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const auto item = pick_item<scalar_t>(BS, D);
    at::parallel_for(0, N * hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t w = begin; w < end; ++w) {
        const int64_t n = w / hkv, h = w % hkv, s = it[3 * n];
        item(q, query.stride(0), query.stride(1), kc, vc, key_cache.stride(0), key_cache.stride(1),
             key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), pos, kvl[s],
             tab + s * W, o, out.stride(0), out.stride(1), it[3 * n + 1], it[3 * n + 2], h, G, D, BS, PB,
             static_cast<float>(scale), window, static_cast<float>(softcap), buf);
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention of packed ragged queries over a K/V pool (CPU)");
}
