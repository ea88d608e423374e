// The loops of the native decode layers (cpu_decode.cpp): dot products, linears over fp32, bf16
// or block-FP8 weights, norms, rotary, and the bf16 / e4m3 conversions of the KV cache.
//
// Every output element is one dot product computed the same way wherever it falls: steps of 16
// lanes in input order (a masked step for the tail), even steps into one accumulator and odd
// ones into another (two chains of fused multiply-adds, so a single weight row streams at twice
// what one chain's latency allows), their sum, then one fixed reduction tree. So a result never
// depends on the batch's size, the blocking, or how the threads split the work (1, 2 or 3
// threads give the same bits).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dsa {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t v) { return float_of(static_cast<uint32_t>(v) << 16); }

// Round to nearest even, as torch's float -> bfloat16.
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = bits_of(f);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// float -> float8_e4m3fn as torch's (c10/util/Float8_e4m3fn.h): round to nearest even,
// NaN past the largest finite value (the callers clamp to +-448 first).
inline uint8_t float_to_e4m3(float f) {
  uint32_t u = bits_of(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint8_t out;
  if (u >= (1087u << 20)) {
    out = 0x7F;
  } else if (u < (121u << 23)) {
    const uint32_t denorm = 141u << 23;
    out = static_cast<uint8_t>(bits_of(float_of(u) + float_of(denorm)) - denorm);
  } else {
    const uint32_t odd = (u >> 20) & 1;
    u += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF;
    u += odd;
    out = static_cast<uint8_t>(u >> 20);
  }
  return out | static_cast<uint8_t>(sign >> 24);
}

// e4m3 -> float, exactly: the byte's exponent and mantissa bits, moved into a half float, are
// the value times 2^-8 (normals and subnormals alike); `mul` folds the 2^8 in with the scale.
inline float e4m3_to_float(uint8_t v) {
  const int e = (v >> 3) & 0xF, m = v & 7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                           : std::ldexp(1.0f + m / 8.0f, e - 7);
  return v & 0x80 ? -mag : mag;
}

constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

#if defined(__AVX512F__)
inline __m512 load_bf16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// 16 e4m3 bytes (as 16-bit words) -> 16 floats times 2^-8 (see e4m3_to_float): the byte moved
// to the high half, then one arithmetic shift right puts sign | exponent | mantissa where a half
// float has them (the copy of the sign it leaves in bit 14 cleared). Exact for every value.
inline __m512 e4m3_words_scaled(__m256i words) {
  const __m256i high = _mm256_srai_epi16(_mm256_slli_epi16(words, 8), 1);
  return _mm512_cvtph_ps(_mm256_and_si256(high, _mm256_set1_epi16(static_cast<int16_t>(0xBFFF))));
}

inline __m512 load_e4m3_scaled(const uint8_t* p) {
  return e4m3_words_scaled(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 load_e4m3_scaled(const uint8_t* p, __mmask16 m) {
  return e4m3_words_scaled(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p)));
}

// 8 bytes of e2m1 codes -> their 16 values, low nibble first (a 16-entry table lookup).
inline __m512 load_e2m1(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));
  return _mm512_permutexvar_ps(codes, _mm512_loadu_ps(kE2M1));
}

// One fixed tree: lanes i + 8, then + 4, + 2, + 1.
inline float hsum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#endif

// The fixed tree of 16 partial sums (hsum's): lanes i + 8, then + 4, + 2, + 1.
inline float tree16(float* acc) {
  for (int j = 0; j < 8; ++j) acc[j] += acc[j + 8];
  for (int j = 0; j < 4; ++j) acc[j] += acc[j + 4];
  for (int j = 0; j < 2; ++j) acc[j] += acc[j + 2];
  return acc[0] + acc[1];
}

// sum_i a[i] * b[i], the lane order and tree of every dot product here.
inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    even = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), even);
    odd = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), odd);
  }
  __m512* last = &even;  // the accumulator of the masked step, if any
  if (i + 16 <= n) {
    even = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), even);
    i += 16;
    last = &odd;
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    *last = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i),
                            *last);
  }
  return hsum(_mm512_add_ps(even, odd));
#else
  float acc[2][16] = {};
  for (int64_t i = 0; i < n; ++i) acc[(i / 16) % 2][i % 16] += a[i] * b[i];
  for (int j = 0; j < 16; ++j) acc[0][j] += acc[1][j];
  return tree16(acc[0]);
#endif
}

// A weight [rows, cols], row-major, with an optional fp32 bias [rows]: fp32, bf16, or block FP8
// as the checkpoint stores it (kernels/block_fp8.py): e4m3 bytes, each times the fp32 scale of
// its block, scale[(row / scale_rows) * scale_cols + col / 128] (scale_rows 128, or 1 where rows
// of several weights were stacked: one scale row per weight row). The FP8 value is made in
// registers as e4m3 * scale in fp32, one rounding, as `dequantize_block_fp8` makes it, so a dot
// over FP8 weights is the dot over the dequantised fp32 weights, bit for bit.
// Or NVFP4 (kernels/nvfp4.py): e2m1 codes, two a byte (element 2i in the low nibble), each 16 of a
// row times its e4m3 scale times the row's global scale: code * (float(scale8) * scale2[row]),
// made as the loader's dequantisation makes it.
enum Kind { kF32, kBF16, kFP8, kNVFP4 };

struct Mat {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  Kind kind = kF32;
  const float* scale = nullptr;
  int64_t scale_rows = 128, scale_cols = 0;
  const uint8_t* scale8 = nullptr;  // NVFP4: e4m3 [rows, cols / 16]
  const float* scale2 = nullptr;  // NVFP4: [rows]
  const float* bias = nullptr;
  int64_t elem_bytes() const { return kind == kFP8 ? 1 : kind == kBF16 ? 2 : 4; }
  const float* scales_of(int64_t row) const { return scale + row / scale_rows * scale_cols; }
  float group_scale(int64_t row, int64_t col) const;
};

constexpr int64_t kScaleBlock = 128;  // the columns one FP8 scale covers

inline float Mat::group_scale(int64_t row, int64_t col) const {
  return e4m3_to_float(scale8[row * (cols / 16) + col / 16]) * scale2[row];
}

#if defined(__AVX512F__)
// The scales of NVFP4 row `row`'s 16 groups from column `col`: e4m3 * 2^-8 times scale2 * 2^8,
// so float(scale) * scale2 with one rounding, as group_scale and the loader make it.
inline __m512 group_scales(const Mat& w, int64_t row, int64_t col) {
  const int64_t groups = w.cols / 16, first = col / 16;
  const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, groups - first)) - 1);
  const __m512 raw = load_e4m3_scaled(w.scale8 + row * groups + first, m);
  return _mm512_mul_ps(raw, _mm512_set1_ps(w.scale2[row] * 256.0f));
}

// One block: OB weight rows (from o) x TB input rows (from t), OB x TB accumulators in registers
// (the block sizes are template arguments so that the compiler keeps them there).
template <Kind K, int OB, int TB>
void linear_tile(const float* const* x, const Mat& w, int64_t o, int64_t t, float* const* y) {
  const int64_t cols = w.cols, tail = cols % 16, body = cols - tail;
  const __mmask16 m = static_cast<__mmask16>((1u << tail) - 1);
  __m512 acc[OB][TB][2], scale[OB];  // [.][.][0]: even steps, [1]: odd ones (see dot)
  for (int a = 0; a < OB; ++a)
    for (int b = 0; b < TB; ++b) acc[a][b][0] = acc[a][b][1] = _mm512_setzero_ps();
  const auto step = [&](int64_t i, bool masked, auto chain) {
    constexpr int k = decltype(chain)::value;
    __m512 wv[OB], xv[TB];
    for (int a = 0; a < OB; ++a) {
      if constexpr (K == kBF16) {
        const uint16_t* wr = static_cast<const uint16_t*>(w.data) + (o + a) * cols + i;
        wv[a] = masked ? load_bf16(wr, m) : load_bf16(wr);
      } else if constexpr (K == kNVFP4) {  // 16 columns: one group, one scale (cols % 16 == 0)
        if (i % (16 * 16) == 0) scale[a] = group_scales(w, o + a, i);
        const uint8_t* wr = static_cast<const uint8_t*>(w.data) + ((o + a) * cols + i) / 2;
        const __m512 s = _mm512_permutexvar_ps(_mm512_set1_epi32((i / 16) % 16), scale[a]);
        wv[a] = _mm512_mul_ps(load_e2m1(wr), s);
      } else if constexpr (K == kFP8) {
        const uint8_t* wr = static_cast<const uint8_t*>(w.data) + (o + a) * cols + i;
        if (i % kScaleBlock == 0)  // 2^8 undoes load_e4m3_scaled's 2^-8 (exact)
          scale[a] = _mm512_set1_ps(w.scales_of(o + a)[i / kScaleBlock] * 256.0f);
        wv[a] = _mm512_mul_ps(masked ? load_e4m3_scaled(wr, m) : load_e4m3_scaled(wr), scale[a]);
      } else {
        const float* wr = static_cast<const float*>(w.data) + (o + a) * cols + i;
        wv[a] = masked ? _mm512_maskz_loadu_ps(m, wr) : _mm512_loadu_ps(wr);
      }
    }
    for (int b = 0; b < TB; ++b)
      xv[b] = masked ? _mm512_maskz_loadu_ps(m, x[t + b] + i) : _mm512_loadu_ps(x[t + b] + i);
    for (int a = 0; a < OB; ++a)
      for (int b = 0; b < TB; ++b) acc[a][b][k] = _mm512_fmadd_ps(wv[a], xv[b], acc[a][b][k]);
  };
  const std::integral_constant<int, 0> even;
  const std::integral_constant<int, 1> odd;
  int64_t i = 0;
  for (; i + 32 <= body; i += 32) {
    step(i, false, even);
    step(i + 16, false, odd);
  }
  if (i < body) {
    step(i, false, even);
    if (tail) step(body, true, odd);
  } else if (tail) {
    step(body, true, even);
  }
  for (int a = 0; a < OB; ++a)
    for (int b = 0; b < TB; ++b) {
      const float s = hsum(_mm512_add_ps(acc[a][b][0], acc[a][b][1]));
      y[t + b][o + a] = w.bias ? s + w.bias[o + a] : s;
    }
}

// Input rows 4 at a time against 1 weight row, 2 at a time against more (the accumulators, two
// per output, fill the registers).
template <Kind K, int OB>
void linear_tiles(const float* const* x, int64_t rows, const Mat& w, int64_t o, float* const* y) {
  constexpr int TB = OB == 1 ? 4 : 2;
  int64_t t = 0;
  for (; t + TB <= rows; t += TB) linear_tile<K, OB, TB>(x, w, o, t, y);
  switch (rows - t) {
    case 3: linear_tile<K, OB, 3>(x, w, o, t, y); break;
    case 2: linear_tile<K, OB, 2>(x, w, o, t, y); break;
    case 1: linear_tile<K, OB, 1>(x, w, o, t, y); break;
    default: break;
  }
}
#endif

// Weight row o as fp32 (the portable path's copy; the same values the registers hold above).
inline const float* weight_row(const Mat& w, int64_t o, std::vector<float>& row) {
  const int64_t cols = w.cols;
  if (w.kind == kF32) return static_cast<const float*>(w.data) + o * cols;
  row.resize(cols);
  if (w.kind == kBF16) {
    const uint16_t* wb = static_cast<const uint16_t*>(w.data) + o * cols;
    for (int64_t i = 0; i < cols; ++i) row[i] = bf16_to_float(wb[i]);
  } else if (w.kind == kNVFP4) {
    const uint8_t* wb = static_cast<const uint8_t*>(w.data) + o * cols / 2;
    for (int64_t i = 0; i < cols; ++i)
      row[i] = kE2M1[(wb[i / 2] >> (4 * (i % 2))) & 0xF] * w.group_scale(o, i);
  } else {
    const uint8_t* wb = static_cast<const uint8_t*>(w.data) + o * cols;
    const float* scale = w.scales_of(o);
    for (int64_t i = 0; i < cols; ++i) row[i] = e4m3_to_float(wb[i]) * scale[i / kScaleBlock];
  }
  return row.data();
}

// Up to this many input rows, a weight is read one row at a time (tiles of 1 weight row): its
// bytes stream in address order, which the hardware prefetcher follows at close to the DRAM
// rate; 4 rows read side by side (4 streams a row's length apart) reached about half of it. With
// more input rows, the 4-row tile's reuse of each loaded input matters more.
constexpr int64_t kStreamRows = 2;

// y[t][o] = x[t] . w[o] (+ bias[o]) for o in [o0, o1) and every row t < rows, in tiles of 4
// weight rows x 2 input rows (1 weight row x 4 for a batch of up to kStreamRows): each weight
// row is read once for all the rows. The tile shape changes no result: every output element is
// the same two chains of fused multiply-adds (see dot).
template <Kind K>
void linear_block(const float* const* x, int64_t rows, const Mat& w, int64_t o0, int64_t o1,
                  float* const* y) {
#if defined(__AVX512F__)
  int64_t o = o0;
  if (rows <= kStreamRows) {
    for (; o < o1; ++o) linear_tiles<K, 1>(x, rows, w, o, y);
    return;
  }
  for (; o + 4 <= o1; o += 4) linear_tiles<K, 4>(x, rows, w, o, y);
  switch (o1 - o) {
    case 3: linear_tiles<K, 3>(x, rows, w, o, y); break;
    case 2: linear_tiles<K, 2>(x, rows, w, o, y); break;
    case 1: linear_tiles<K, 1>(x, rows, w, o, y); break;
    default: break;
  }
#else
  std::vector<float> row;
  for (int64_t o = o0; o < o1; ++o) {
    const float* wr = weight_row(w, o, row);
    for (int64_t t = 0; t < rows; ++t) {
      const float s = dot(wr, x[t], w.cols);
      y[t][o] = w.bias ? s + w.bias[o] : s;
    }
  }
#endif
}

inline void linear_rows(const float* const* x, int64_t rows, const Mat& w, int64_t o0, int64_t o1,
                        float* const* y) {
  if (o0 >= o1 || rows == 0) return;
  switch (w.kind) {
    case kBF16: linear_block<kBF16>(x, rows, w, o0, o1, y); break;
    case kFP8: linear_block<kFP8>(x, rows, w, o0, o1, y); break;
    case kNVFP4: linear_block<kNVFP4>(x, rows, w, o0, o1, y); break;
    default: linear_block<kF32>(x, rows, w, o0, o1, y); break;
  }
}

// RMSNorm of n values (as torch.rms_norm in fp32: mean of squares, rsqrt, times the weight).
inline void rms_norm(const float* x, int64_t n, const float* w, double eps, float* out) {
  float ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / n + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// Rotary as dsaserve/layers/rotary.py `rotation`: out[j] = x[f] cos - x[s] sin,
// out[j + half] = x[s] cos + x[f] sin, with (f, s) = (2j, 2j + 1) interleaved, else (j, j + half).
inline void rotate(const float* x, const float* cos, const float* sin, int64_t half,
                   bool interleave, float* out) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = interleave ? x[2 * j] : x[j];
    const float b = interleave ? x[2 * j + 1] : x[j + half];
    out[j] = a * cos[j] - b * sin[j];
    out[j + half] = b * cos[j] + a * sin[j];
  }
}

inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

}  // namespace dsa
