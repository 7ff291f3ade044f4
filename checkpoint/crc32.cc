#include "checkpoint/crc32.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace fsdp::ckpt {
namespace {

constexpr uint32_t kPoly = 0xEDB88320u;  // reflected: bit 31 is x^0, bit 0 is x^31

// Note [Sliced CRC-32]
// kTables[0][b] is the CRC register's change for byte b (the classic byte-at-a-time table);
// kTables[k][b] is that of byte b followed by k zero bytes. Eight bytes then update the
// register in one step: the register xored into the first four, each byte looked up in the
// table of its distance from the end of the word, the eight values xored. Same checksum as
// the byte loop (zlib's), about 8x fewer dependent steps: a checkpoint's bytes go through it
// once at save time and once at load time.
constexpr std::array<std::array<uint32_t, 256>, 8> MakeTables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? kPoly ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (size_t k = 1; k < t.size(); ++k) {
    for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
  return t;
}
constexpr std::array<std::array<uint32_t, 256>, 8> kTables = MakeTables();

// a(x) * b(x) mod P(x), polynomials in the reflected order above.
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31;
  uint32_t product = 0;
  while (true) {
    if (a & m) {
      product ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(2^k) mod P(x) for k = 0..31: each the square of the one before.
std::array<uint32_t, 32> MakePowers() {
  std::array<uint32_t, 32> p{};
  p[0] = 1u << 30;  // x^1
  for (size_t k = 1; k < p.size(); ++k) p[k] = MultModP(p[k - 1], p[k - 1]);
  return p;
}

// x^(8 n) mod P(x): what appending n zero bytes multiplies a CRC register by. P is
// irreducible, so x^(2^32) = x mod P (the Frobenius map of GF(2^32)) and the powers x^(2^k)
// repeat with period 32: k wraps (zlib's crc32_combine relies on the same fact; the tests
// check it on a length past 2^29 bytes, where k passes 31).
uint32_t ZeroBytesOperator(uint64_t n) {
  static const std::array<uint32_t, 32> powers = MakePowers();
  uint32_t p = 1u << 31;  // x^0
  for (size_t k = 3; n != 0; n >>= 1, k = (k + 1) % powers.size()) {
    if (n & 1) p = MultModP(powers[k], p);
  }
  return p;
}

}  // namespace

uint32_t Crc32(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  if constexpr (std::endian::native == std::endian::little) {
    for (; n >= 8; n -= 8, p += 8) {
      uint64_t word;
      std::memcpy(&word, p, sizeof(word));
      const uint32_t lo = static_cast<uint32_t>(word) ^ crc;
      const uint32_t hi = static_cast<uint32_t>(word >> 32);
      crc = kTables[7][lo & 0xFF] ^ kTables[6][(lo >> 8) & 0xFF] ^
            kTables[5][(lo >> 16) & 0xFF] ^ kTables[4][lo >> 24] ^ kTables[3][hi & 0xFF] ^
            kTables[2][(hi >> 8) & 0xFF] ^ kTables[1][(hi >> 16) & 0xFF] ^ kTables[0][hi >> 24];
    }
  }
  for (; n > 0; --n, ++p) crc = kTables[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t nbytes_b) {
  return MultModP(ZeroBytesOperator(nbytes_b), crc_a) ^ crc_b;
}

uint32_t Crc32Parallel(const void* data, size_t n, int threads) {
  constexpr size_t kBlock = size_t{8} << 20;
  if (threads <= 1 || n < 2 * kBlock) return Crc32(0, data, n);
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<uint32_t> crcs(blocks);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t b = next++; b < blocks; b = next++) {
      crcs[b] = Crc32(0, p + b * kBlock, std::min(kBlock, n - b * kBlock));
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads && static_cast<size_t>(t) < blocks; ++t) helpers.emplace_back(work);
  work();
  for (std::thread& t : helpers) t.join();
  uint32_t crc = crcs[0];
  for (size_t b = 1; b < blocks; ++b) {
    crc = Crc32Combine(crc, crcs[b], std::min(kBlock, n - b * kBlock));
  }
  return crc;
}

std::string CrcHex(uint32_t crc) { return fmt::format("0x{:08x}", crc); }

}  // namespace fsdp::ckpt
