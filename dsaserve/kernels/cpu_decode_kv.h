// The KV pool's stored forms for the native decode layers: fp32, bf16, or FP8 in FlashMLA's
// layout (dsaserve/kernels/kv_quant.py, which this mirrors bit for bit):
//
// - an MLA entry: [latent as e4m3 (rank B) | an fp32 scale per `group` latent values | rope
//   as bf16 (2 B each)]; an index key: [key as e4m3 (dim B) | one fp32 scale].
// - scale = amax / 448 (1 for an all-zero group); value = e4m3(clamp(x / scale, +-448)).
//
// Writes quantise the new token's entry and key in the layer loop; reads dequantise in the inner
// loop (a row's selected entries, a block of index keys at a time), into the same fp32 values
// the layered path's dequantisation gives.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_decode_math.h"

namespace dsa {

enum class Kv : int { kF32 = 0, kBF16 = 1, kFP8 = 2 };

constexpr float kFp8Max = 448.0f;

inline float fp8_scale(const float* x, int64_t n) {
  float amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax > 0 ? amax / kFp8Max : 1.0f;
}

inline void quantize(const float* x, int64_t n, float scale, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = float_to_e4m3(std::min(std::max(x[i] / scale, -kFp8Max), kFp8Max));
}

// out[i] = e4m3(q[i]) * scale for n values.
inline void dequantize(const uint8_t* q, int64_t n, float scale, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale * 256.0f);  // 2^8: see load_e4m3_scaled
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(load_e4m3_scaled(q + i), s));
#endif
  for (; i < n; ++i) out[i] = e4m3_to_float(q[i]) * scale;
}

inline void bf16_to_floats(const uint16_t* v, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(v[i]);
}

// One layer's rows of the pool: MLA entries (rank + rope values) or index keys (dim values).
struct Rows {
  uint8_t* base = nullptr;
  int64_t row_bytes = 0;
  Kv kind = Kv::kF32;
  int64_t rank = 0;  // entries: the latent part; keys: 0
  int64_t width = 0;  // values per row: rank + rope, or the key's dim
  int64_t group = 0;  // FP8 entries: latent values per scale

  uint8_t* row(int64_t slot) const { return base + slot * row_bytes; }

  void store(int64_t slot, const float* x) const {
    uint8_t* r = row(slot);
    if (kind == Kv::kF32) {
      std::memcpy(r, x, width * 4);
    } else if (kind == Kv::kBF16) {
      uint16_t* b = reinterpret_cast<uint16_t*>(r);
      for (int64_t i = 0; i < width; ++i) b[i] = float_to_bf16(x[i]);
    } else if (rank == 0) {  // an FP8 index key
      const float scale = fp8_scale(x, width);
      quantize(x, width, scale, r);
      std::memcpy(r + width, &scale, 4);
    } else {  // an FP8 MLA entry
      const int64_t groups = rank / group;
      float* scales = reinterpret_cast<float*>(r + rank);
      for (int64_t g = 0; g < groups; ++g) {
        const float scale = fp8_scale(x + g * group, group);
        quantize(x + g * group, group, scale, r + g * group);
        std::memcpy(scales + g, &scale, 4);
      }
      uint16_t* rope = reinterpret_cast<uint16_t*>(r + rank + 4 * groups);
      for (int64_t i = rank; i < width; ++i) rope[i - rank] = float_to_bf16(x[i]);
    }
  }

  // The row's values as fp32: in place for an fp32 pool, else dequantised into buf [width].
  const float* load(int64_t slot, float* buf) const {
    const uint8_t* r = row(slot);
    if (kind == Kv::kF32) return reinterpret_cast<const float*>(r);
    if (kind == Kv::kBF16) {
      bf16_to_floats(reinterpret_cast<const uint16_t*>(r), width, buf);
    } else if (rank == 0) {
      float scale;
      std::memcpy(&scale, r + width, 4);
      dequantize(r, width, scale, buf);
    } else {
      const int64_t groups = rank / group;
      for (int64_t g = 0; g < groups; ++g) {
        float scale;
        std::memcpy(&scale, r + rank + 4 * g, 4);
        dequantize(r + g * group, group, scale, buf + g * group);
      }
      bf16_to_floats(reinterpret_cast<const uint16_t*>(r + rank + 4 * groups), width - rank,
                     buf + rank);
    }
    return buf;
  }
};

}  // namespace dsa
