// CRC-32C (Castagnoli), the checksum of every checkpoint file chunk. Hardware (SSE 4.2)
// when the CPU has it, else a slicing-by-8 table; both give the same values.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dtrain::checkpoint {

// Continues `crc` (0 for a fresh checksum) over `n` bytes.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

// The portable table implementation alone (tests compare it with the hardware path).
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);

}  // namespace dtrain::checkpoint
