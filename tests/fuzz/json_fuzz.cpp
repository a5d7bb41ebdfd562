// The JSON parser behind safetensors headers and checkpoint manifests, on arbitrary text: it
// either parses or throws JsonError; what it parses dumps to text that parses to the same
// value (checked through a second dump).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "dtrain/json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  dtrain::Json value;
  try {
    value = dtrain::Json::parse(text);
  } catch (const dtrain::JsonError&) {
    return 0;
  }
  const std::string once = value.dump();
  const std::string twice = dtrain::Json::parse(once).dump();
  if (once != twice) {
    std::fprintf(stderr, "dump is not a fixed point:\n%s\n%s\n", once.c_str(), twice.c_str());
    std::abort();
  }
  return 0;
}
