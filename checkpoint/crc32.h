// CRC-32 as zlib computes it (IEEE 802.3, reflected polynomial 0xEDB88320): the checksum of
// every checkpoint chunk and file.
//
//   uint32_t crc = Crc32(0, a, na);
//   crc = Crc32(crc, b, nb);          // == Crc32(0, a + b, na + nb)
//   Crc32Combine(Crc32(0, a, na), Crc32(0, b, nb), nb)   // the same, without reading a or b
//   std::string shown = CrcHex(crc);  // "0x1c291ca3"
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdp::ckpt {

// Like zlib's crc32(crc, data, n): Crc32(Crc32(0, a), b) == Crc32(0, a + b).
uint32_t Crc32(uint32_t crc, const void* data, size_t n);

// Like zlib's crc32_combine: the CRC of a + b from the CRCs of a and of b and b's length,
// without reading either (O(log nbytes_b)):
//   Crc32Combine(Crc32(0, a), Crc32(0, b), nb) == Crc32(0, a + b).
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t nbytes_b);

// Crc32(0, data, n) computed on `threads` threads (the calling one included), blocks of a few
// MiB each, combined in order: the same value, several times faster on a large buffer (a
// checkpoint chunk); one thread or a small buffer: Crc32 itself.
uint32_t Crc32Parallel(const void* data, size_t n, int threads);

// "0x%08x", for messages.
std::string CrcHex(uint32_t crc);

}  // namespace fsdp::ckpt
