// Paged attention on the CPU: packed ragged queries over K/V blocks read in place from the pool.
//
// Work item = (sub-request s, row tile [r0, r1), KV head h): its G = Hq / Hkv query heads of every row in
// the tile share each split of BS keys (the split divides the pool's block size PB; default PB),
// converted to float once per split (K transposed to [D][BS]: 16 x 16 tiles in registers with AVX-512).
// Per query row and head the arithmetic is fixed, whatever else the batch holds: scores over one block
// (a d-ordered sum per key), an online softmax over blocks in ascending order, all in float32, so a
// row's output depends neither on the other rows of its tile or step nor on the thread count.
// Speed without changing a bit: float32 values read in place, the softmax's max and exp on vector lanes (each lane
// exp_f's operations), up to four heads of a row interleaved in the sums and the value FMAs (independent chains),
// and the next split's (and next item's) K/V rows prefetched: the pool's blocks are scattered.
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

// Asks the cache for `rows` rows of D elements, `stride` apart (a block's keys or values of one head), ahead of use:
// the pool's blocks are scattered and each layer's were last read a step ago, so without it every split waits.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* p, int64_t stride, int64_t rows, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t j = 0; j < rows; ++j) {
    const char* r = reinterpret_cast<const char*>(p + j * stride);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(r + o, 0, 3);
  }
}

// vf[j][d] = float(v[j][d]) for the BS values of a block (rows vs1 apart): a copy.
template <typename scalar_t>
void load_values(const scalar_t* vb, int64_t vs1, int64_t D, int64_t BS, float* vf) {
#if defined(__AVX512F__)
  if constexpr (kTileable<scalar_t>) {
    if (D % 16 == 0) {
      for (int64_t j = 0; j < BS; ++j)
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vf + j * D + d, load16(vb + j * vs1 + d));
      return;
    }
  }
#endif
  for (int64_t j = 0; j < BS; ++j)
    for (int64_t d = 0; d < D; ++d) vf[j * D + d] = static_cast<float>(vb[j * vs1 + d]);
}

// s[j] = exp_f(s[j] - mn) for j < n: each element alone, so vector lanes give exp_f's scalar bits.
#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {                               // exp_f on 16 lanes, operation for operation
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                        _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}
#endif

inline void exp_shifted(float* s, int64_t n, float mn) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mn);
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(s + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
#endif
  for (; j < n; ++j) s[j] = exp_f(s[j] - mn);
}

// Up to kMaxHeads query heads of one row go through the softmax's sums and the value accumulation together: their
// chains are independent, so interleaving them hides the add and FMA latency. Each head's sums are the same
// sequence of operations however many go together (and on any number of rows or threads).
constexpr int kMaxHeads = 4;
template <int64_t D_T>
constexpr int64_t heads_together() {
#if defined(__AVX512F__)
  if constexpr (D_T > 0 && D_T % 16 == 0) return D_T <= 64 ? 4 : D_T <= 128 ? 2 : 1;   // t + v in 32 registers
#endif
  return 1;
}

// sum[g] = s[g][j0] + s[g][j0 + 1] + ... + s[g][j1 - 1] (from 0, in ascending order), for the n < kMaxHeads rows
// of s, BS apart.
template <int N>
inline void sums_n(const float* s, int64_t BS, int64_t j0, int64_t j1, float* sum) {
  float t[N] = {};
  for (int64_t j = j0; j < j1; ++j)
    for (int g = 0; g < N; ++g) t[g] += s[g * BS + j];
  std::copy(t, t + N, sum);
}

inline void sums(const float* s, int64_t BS, int64_t n, int64_t j0, int64_t j1, float* sum) {
  switch (n) {
    case 4: return sums_n<4>(s, BS, j0, j1, sum);
    case 3: return sums_n<3>(s, BS, j0, j1, sum);
    case 2: return sums_n<2>(s, BS, j0, j1, sum);
    default: return sums_n<1>(s, BS, j0, j1, sum);
  }
}

// a[g][d] = a[g][d] * corr[g] + sum over j in [j0, j1) ascending of s[g][j] * v[j][d], each term one FMA, for the
// N heads (a's rows D_T apart, s's BS apart; v's rows vstride apart), in registers.
#if defined(__AVX512F__)
template <int64_t D_T, int N>
inline void accumulate_n(float* a, const float* corr, const float* s, int64_t BS, int64_t j0, int64_t j1,
                         const float* v, int64_t vstride) {
  constexpr int K = D_T / 16;
  __m512 t[N][K];
  for (int g = 0; g < N; ++g) {
    const __m512 c = _mm512_set1_ps(corr[g]);
    for (int k = 0; k < K; ++k) t[g][k] = _mm512_mul_ps(_mm512_loadu_ps(a + g * D_T + 16 * k), c);
  }
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + j * vstride;
    if constexpr (N == 1) {                                    // D up to 256: t alone fills 16 registers
      const __m512 p = _mm512_set1_ps(s[j]);
      for (int k = 0; k < K; ++k) t[0][k] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * k), t[0][k]);
    } else {                                                   // each value row loaded once for the N heads
      __m512 vv[K];
      for (int k = 0; k < K; ++k) vv[k] = _mm512_loadu_ps(vj + 16 * k);
      for (int g = 0; g < N; ++g) {
        const __m512 p = _mm512_set1_ps(s[g * BS + j]);
        for (int k = 0; k < K; ++k) t[g][k] = _mm512_fmadd_ps(p, vv[k], t[g][k]);
      }
    }
  }
  for (int g = 0; g < N; ++g)
    for (int k = 0; k < K; ++k) _mm512_storeu_ps(a + g * D_T + 16 * k, t[g][k]);
}
#endif

template <int64_t D_T>
inline void accumulate(float* a, const float* corr, const float* s, int64_t BS, int64_t n, int64_t j0, int64_t j1,
                       const float* v, int64_t vstride, int64_t D) {
#if defined(__AVX512F__)
  if constexpr (D_T > 0 && D_T % 16 == 0) {                  // n <= heads_together<D_T>()
    constexpr int64_t NG = heads_together<D_T>();
    if constexpr (NG >= 4) if (n == 4) return accumulate_n<D_T, 4>(a, corr, s, BS, j0, j1, v, vstride);
    if constexpr (NG >= 3) if (n == 3) return accumulate_n<D_T, 3>(a, corr, s, BS, j0, j1, v, vstride);
    if constexpr (NG >= 2) if (n == 2) return accumulate_n<D_T, 2>(a, corr, s, BS, j0, j1, v, vstride);
    return accumulate_n<D_T, 1>(a, corr, s, BS, j0, j1, v, vstride);
  }
#endif
  for (int64_t g = 0; g < n; ++g) {                           // one head at a time, D read at run time
    float* ag = a + g * D;
    const float* sg = s + g * BS;
    for (int64_t d = 0; d < D; ++d) ag[d] *= corr[g];
    for (int64_t j = j0; j < j1; ++j) {
      const float p = sg[j];
      const float* vj = v + j * vstride;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * vj[d];
    }
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
    if ((b + 1) * BS < hi) {                                   // the next split's keys and values, ahead
      const int64_t nblk = table[(b + 1) * BS / PB], noff = (b + 1) * BS % PB;
      prefetch_rows(kc + nblk * ks0 + noff * ks1 + h * ks2, ks1, BS, D);
      prefetch_rows(vc + nblk * vs0 + noff * vs1 + h * vs2, vs1, BS, D);
    }
    load_keys(kb, ks1, D, BS, kt);
    const float* vrows = vf;                                   // the block's values as float, rows vstride apart
    int64_t vstride = D;
    if constexpr (std::is_same_v<scalar_t, float>) {           // float32: read in place
      vrows = vb;
      vstride = vs1;
    } else {
      load_values(vb, vs1, D, BS, vf);
    }
    scores<BS_T>(qf, kt, sc, RG, D, BS);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t end = std::min(q_pos[r] + 1, kv_len);
      const int64_t start = window > 0 ? std::max<int64_t>(0, q_pos[r] - window + 1) : 0;
      const int64_t j0 = std::max<int64_t>(start - b * BS, 0), j1 = std::min<int64_t>(end - b * BS, BS);
      if (j1 <= j0) continue;                                  // this row reads no key of this block
      constexpr int64_t NG = heads_together<D_T>();
      for (int64_t g0 = 0; g0 < G; g0 += NG) {                // heads g0 .. g0 + n - 1 of row r together
        const int64_t n = std::min(NG, G - g0), i0 = (r - r0) * G + g0;
        float corr[kMaxHeads], sum[kMaxHeads];
        for (int64_t k = 0; k < n; ++k) {
          const int64_t i = i0 + k;
          float* s = sc + i * BS;
          float bm = -std::numeric_limits<float>::infinity();
          if (softcap > 0.0f) {
            for (int64_t j = j0; j < j1; ++j) {
              const float x = softcap * std::tanh(s[j] * scale / softcap);
              s[j] = x;
              bm = std::max(bm, x);
            }
          } else {                                             // a max: the same in any order
#pragma omp simd reduction(max : bm)
            for (int64_t j = j0; j < j1; ++j) {
              const float x = s[j] * scale;
              s[j] = x;
              bm = std::max(bm, x);
            }
          }
          const float mn = std::max(m[i], bm);
          corr[k] = m[i] == -std::numeric_limits<float>::infinity() ? 0.0f : exp_f(m[i] - mn);
          exp_shifted(s + j0, j1 - j0, mn);
          m[i] = mn;
        }
        sums(sc + i0 * BS, BS, n, j0, j1, sum);
        for (int64_t k = 0; k < n; ++k) l[i0 + k] = l[i0 + k] * corr[k] + sum[k];
        accumulate<D_T>(acc + i0 * D, corr, sc + i0 * BS, BS, n, j0, j1, vrows, vstride, D);
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
        if (w + 1 < end && window <= 0) {                      // the next item's first split, ahead
          const int64_t n1 = (w + 1) / hkv, h1 = (w + 1) % hkv, blk = tab[it[3 * n1] * W];
          prefetch_rows(kc + blk * key_cache.stride(0) + h1 * key_cache.stride(2), key_cache.stride(1), BS, D);
          prefetch_rows(vc + blk * value_cache.stride(0) + h1 * value_cache.stride(2), value_cache.stride(1), BS, D);
        }
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
