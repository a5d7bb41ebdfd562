// The checkpoint's side of the public safetensors reader and writer (dtrain/safetensors.h):
// readers over its checksummed files (or any ByteSource, for the fuzzer), and writers that
// return the digest the manifest records.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/files.h"
#include "dtrain/safetensors.h"

namespace dtrain::checkpoint {

constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;  // the reference implementation's limit

// write_safetensors that returns the file's digest. `on_progress("mid_file")` is called
// once half of the tensors are written (tests kill the writer there).
FileDigest write_safetensors(const std::string& path,
                             const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata = {},
                             const std::function<void(const char*)>& on_progress = {});

}  // namespace dtrain::checkpoint

namespace dtrain {

struct SafetensorsAccess {
  // A reader over `source` (e.g. a VerifiedFile: every chunk a read touches is checked).
  static SafetensorsReader open(std::unique_ptr<checkpoint::ByteSource> source);
  static checkpoint::ByteSource& source(SafetensorsReader& reader);
  // finish() that returns the file's digest (size and chunk checksums).
  static checkpoint::FileDigest finish(SafetensorsWriter& writer);
};

}  // namespace dtrain
