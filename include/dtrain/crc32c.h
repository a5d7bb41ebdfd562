// dtrain's one checksum: CRC-32C (Castagnoli), of every checkpoint file chunk and manifest,
// and of the files tools and examples write (the GPT-2 example's token cache). Hardware
// (SSE 4.2) when the CPU has it, else a slicing-by-8 table; both give the same values.
//
// clang-format off
//   uint32_t crc = dtrain::crc32c(0, data, n);        // a fresh checksum
//   crc = dtrain::crc32c(crc, more, m);               // continued over more bytes
// clang-format on
#pragma once

#include <cstddef>
#include <cstdint>

namespace dtrain {

// Continues `crc` (0 for a fresh checksum) over `n` bytes.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

// The portable table implementation alone (tests compare it with the hardware path).
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);

}  // namespace dtrain
