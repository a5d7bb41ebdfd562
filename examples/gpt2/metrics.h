// Metrics of the GPT-2 trainer: process memory, and the JSON lines it writes.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace gpt2 {

// Peak resident set size of this process in MiB (VmHWM in /proc/self/status); -1 when it
// cannot be read (not Linux).
double peak_rss_mib();

constexpr double kMiB = 1024.0 * 1024.0;

// One flat JSON object, built field by field in insertion order. Non-finite numbers and
// empty optionals are written as null.
class JsonLine {
 public:
  JsonLine& add(const std::string& key, double value);
  JsonLine& add(const std::string& key, int64_t value);
  JsonLine& add(const std::string& key, bool value);  // true / false
  JsonLine& add(const std::string& key, int value) { return add(key, int64_t{value}); }
  JsonLine& add(const std::string& key, const std::string& value);
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonLine& add(const std::string& key, std::optional<double> value);
  JsonLine& add(const std::string& key, const std::vector<double>& values);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(const std::string& k);
  std::string body_;
};

// Appends JSON lines to a file, flushing each so that a crash keeps what was written.
// Opening truncates the file, or appends to it (a resumed run continues the file of the runs
// before). Throws dtrain::Error when the file cannot be written.
class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path, bool append = false);
  void write(const JsonLine& line);

 private:
  std::string path_;
  std::ofstream out_;
};

}  // namespace gpt2
