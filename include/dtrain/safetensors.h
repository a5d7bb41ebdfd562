// Safetensors files (the format of Hugging Face's `safetensors`): a reader that memory-maps
// the file and reads whole tensors or any byte / element range of one, and a writer.
//
// clang-format off
//   dtrain::SafetensorsReader r("model.safetensors");     // maps the file, checks the header
//   for (const auto& t : r.tensors()) names.push_back(t.name);  // also dtype, shape, bytes
//   at::Tensor w = r.read("wte.weight");                   // a whole tensor (CPU, owned)
//   at::Tensor rows = r.read_elements("wte.weight", b, e); // flattened elements [b, e), 1-D
//
//   dtrain::write_safetensors("out.safetensors", {{"w", w}}, {{"format", "pt"}});
// clang-format on
//
// Layout: [8 bytes: little-endian u64 N][N bytes: JSON header][data]; the header maps each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (relative to the data
// section) and may hold "__metadata__" (string to string). dtypes: F32 F16 BF16 F64 I64 I32
// I16 I8 U8 BOOL.
//
// The reader reads only what it is asked for: opening reads the 8-byte size and the header;
// read_bytes / read_elements copy exactly the requested bytes out of the mapping (a rank
// that loads its shard of a tensor never touches the rest of the file). It accepts what the
// reference implementation accepts and refuses, with a CheckpointError whose message is one
// line "<path>: not a valid safetensors file: <problem>" (naming the tensor where one is at
// fault), every file the reference refuses: a header size past the end of the file or over
// 100 MB, a header that is not a JSON object, unknown dtypes, negative dimensions, offsets
// out of order, overlapping, leaving gaps or not matching numel x itemsize, a data section
// shorter or longer than the tensors. A file that changes size while mapped is undefined.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtrain {

struct SafetensorsAccess;  // dtrain's checkpoint code: readers over its checksummed files
// The safetensors name of a dtype ("F32" for at::kFloat, ...) and back; InvalidArgument for
// a dtype the format (as dtrain reads it) has no name for.
const char* safetensors_dtype_name(c10::ScalarType dtype);
c10::ScalarType safetensors_dtype(const std::string& name);

// One tensor of a file.
struct SafetensorsTensor {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // absolute byte range [begin, end) of its data in the file
  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

class SafetensorsReader {
 public:
  // Maps `path` read-only and validates its header and the data section's size. Throws
  // CheckpointError naming the file and the problem (cannot open, not valid).
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&&) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) noexcept;

  const std::string& path() const;
  // The tensors in the order of their data in the file.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Null when absent.
  const SafetensorsTensor* find(const std::string& name) const;
  // The tensor named `name`; CheckpointError "<path>: no tensor named "<name>"" otherwise.
  const SafetensorsTensor& at(const std::string& name) const;

  // The whole tensor (CPU, contiguous, its own memory).
  at::Tensor read(const std::string& name);
  // Elements [begin, end) of the flattened tensor, as a 1-D CPU tensor of its dtype;
  // CheckpointError naming the file and the tensor when the range is not inside it.
  at::Tensor read_elements(const std::string& name, int64_t begin, int64_t end);
  // Bytes [byte_offset, byte_offset + n) of t's data into `out` (any offset, any length
  // inside the tensor; CheckpointError otherwise).
  void read_bytes(const SafetensorsTensor& t, uint64_t byte_offset, void* out, size_t n);

  // Data bytes copied out so far (the header excluded): what the reads touched.
  uint64_t bytes_read() const;
  // The start of t's data in the mapping (valid while the reader lives), for zero-copy use;
  // null for a reader dtrain opened over a checksummed checkpoint file.
  const void* mapped_data(const SafetensorsTensor& t) const;
  // Drops t's mapped pages from this process's resident set once the caller is done with
  // it (the kernel's page cache keeps them; reading t again faults them back). A rank that
  // streams its shards out of a large file calls it after each tensor, so its RSS holds its
  // shards, not every page its strided reads touched. No-op over a checkpoint file.
  void release(const SafetensorsTensor& t);

 private:
  friend struct SafetensorsAccess;
  struct Source;  // where the bytes come from: the mapping, or a checksummed file
  explicit SafetensorsReader(std::unique_ptr<Source> source);

  std::unique_ptr<Source> source_;
  uint64_t header_bytes_ = 0;  // read by the constructor, not counted in bytes_read()
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Streams a safetensors file: the constructor writes the header for `layout` (names, dtypes,
// shapes; the byte ranges are assigned back to back in this order), then write() takes the
// tensors' bytes in the same order, in pieces of any size; finish() checks that exactly the
// declared bytes came and fsyncs. The header is padded with spaces to a multiple of 8 bytes,
// so every tensor's data is 8-byte aligned (as the reference implementation does). A writer
// destroyed unfinished leaves an incomplete file. I/O errors throw CheckpointError naming
// the file; a repeated, reserved ("__metadata__") or unrepresentable tensor, or more or
// fewer bytes than declared, InvalidArgument.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, const std::vector<SafetensorsTensor>& layout,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void write(const void* data, size_t n);
  // The bytes of a tensor (copied to the CPU and made contiguous first if needed).
  void write(const at::Tensor& t);
  // Returns the file's size.
  uint64_t finish();
  uint64_t data_bytes() const { return data_bytes_; }  // declared by the layout

 private:
  friend struct SafetensorsAccess;
  struct File;  // the file and, once finished, its checksums

  std::unique_ptr<File> file_;
  uint64_t data_bytes_ = 0;
  uint64_t data_start_ = 0;
};

// Writes `tensors` (copied to the CPU and made contiguous) in the given order with
// `metadata` to a new file at `path`, fsynced.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace dtrain
