// Vector helpers shared by the host loops of offload (sharding/host_loops.cc, engine/
// host_adam.cc): x86-64 AVX2 only, for functions built with a target that includes "avx2".
//
//   const __m256 g = Bf16x8ToFloats(grad_bf16 + i);  // eight bf16 values as floats, exact
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>

namespace fsdp {

// The eight bf16 values at src as floats: each one's bits shifted into a float's high half.
[[gnu::always_inline]] __attribute__((target("avx2"))) inline __m256 Bf16x8ToFloats(
    const uint16_t* src) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

}  // namespace fsdp
#endif
