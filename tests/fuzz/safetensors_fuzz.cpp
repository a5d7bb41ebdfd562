// The safetensors reader on arbitrary bytes: it must either read every tensor or refuse the
// file with one CheckpointError line. Any other exception, a crash or a sanitizer report is
// a bug.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "checkpoint/safetensors.h"
#include "dtrain/errors.h"

namespace {

// The input as a file; reads past the end are refused as a short file is.
class MemorySource final : public dtrain::checkpoint::ByteSource {
 public:
  MemorySource(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, void* out, size_t n) override {
    if (offset > size_ || n > size_ - offset) {
      throw dtrain::CheckpointError(path_ + ": read past the end of the file");
    }
    if (n > 0) std::memcpy(out, data_ + offset, n);
    bytes_read_ += n;
  }
  const std::string& path() const override { return path_; }
  uint64_t bytes_read() const override { return bytes_read_; }

 private:
  const uint8_t* data_;
  size_t size_;
  std::string path_ = "fuzz.safetensors";
  uint64_t bytes_read_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto reader = dtrain::SafetensorsAccess::open(std::make_unique<MemorySource>(data, size));
    // The reader validated that the data section holds exactly the declared tensors, so
    // reading all of them touches at most `size` bytes.
    for (const auto& t : reader.tensors()) reader.read(t.name);
  } catch (const dtrain::CheckpointError&) {
    // A refusal is the expected outcome for almost every input.
  }
  return 0;
}
