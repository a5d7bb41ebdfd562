// dtrain's safetensors reader and writer:
//
//   [8 bytes: little-endian u64 N][N bytes: JSON header][data]
//   header = {"__metadata__": {"k": "v", ...},
//             "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
//
// Offsets are relative to the start of the data section. The reader accepts what the
// reference implementation accepts and refuses, with one CheckpointError line
// "<path>: <problem>", every file it would refuse: header size past the end of the file or
// over 100 MB, a header that is not a JSON object, unknown dtypes, negative dimensions,
// offsets out of order, overlapping, leaving gaps or not matching numel x itemsize, a data
// section shorter or longer than the tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/files.h"

namespace dtrain::checkpoint {

constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;  // the reference implementation's limit

// "F32" <-> at::kFloat, ... (F32 F16 BF16 F64 I64 I32 I16 I8 U8 BOOL). The parser throws
// std::invalid_argument for anything else.
const char* safetensors_dtype_name(c10::ScalarType dtype);
c10::ScalarType safetensors_dtype(const std::string& name);

struct SafetensorsTensor {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // absolute byte offsets in the file
  int64_t numel() const;
};

class SafetensorsReader {
 public:
  // Reads and validates the header (and the data section's size) through `source`.
  explicit SafetensorsReader(std::unique_ptr<ByteSource> source);
  // A plain file from anywhere.
  static SafetensorsReader open(const std::string& path);

  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Null when absent.
  const SafetensorsTensor* find(const std::string& name) const;
  // The whole tensor (CPU, contiguous); throws CheckpointError naming a missing tensor.
  at::Tensor read(const std::string& name);
  // Bytes [byte_offset, byte_offset + n) of the tensor's data into `out`.
  void read_bytes(const SafetensorsTensor& t, uint64_t byte_offset, void* out, size_t n);
  ByteSource& source() { return *source_; }
  const std::string& path() const { return source_->path(); }

 private:
  std::unique_ptr<ByteSource> source_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Streams a safetensors file: the constructor writes the header for `layout` (names,
// dtypes, shapes; offsets are assigned back to back in this order), then write() takes the
// tensors' bytes in the same order, in pieces of any size; finish() checks that exactly
// the declared bytes came, fsyncs and returns the digest. The header is padded with spaces
// to a multiple of 8 bytes, so every tensor's data is 8-byte aligned (as the reference
// implementation does). A writer that is destroyed unfinished leaves an incomplete file.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, const std::vector<SafetensorsTensor>& layout,
                    const std::map<std::string, std::string>& metadata = {});
  void write(const void* data, size_t n);
  // The bytes of a CPU tensor (made contiguous first if needed).
  void write(const at::Tensor& t);
  FileDigest finish();
  uint64_t data_bytes() const { return data_bytes_; }

 private:
  FileWriter file_;
  uint64_t data_bytes_ = 0;  // declared
  uint64_t data_start_ = 0;
};

// Writes `tensors` (copied to CPU and made contiguous) in the given order with `metadata`
// to a new file at `path`, fsynced; returns its digest. `on_progress("mid_file")` is called
// once half of the tensors are written (tests kill the writer there).
FileDigest write_safetensors(const std::string& path,
                             const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata = {},
                             const std::function<void(const char*)>& on_progress = {});

}  // namespace dtrain::checkpoint
