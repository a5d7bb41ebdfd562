#include "metrics.h"

#include <cmath>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "dtrain/json.h"

namespace gpt2 {
namespace {

// The shortest text that reads back as the same double: metrics compare bit for bit (a
// resumed run against an uninterrupted one), which rounding to a few digits would hide.
std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  return fmt::format("{}", v);
}

// Strings are written by dtrain's JSON writer (escapes included).
std::string quoted(const std::string& s) { return dtrain::Json(s).dump(); }

}  // namespace

double peak_rss_mib() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  double kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, "VmHWM:", 6) == 0) {
      kib = std::strtod(line + 6, nullptr);
      break;
    }
  }
  std::fclose(f);
  return kib < 0 ? -1 : kib / 1024.0;
}

void JsonLine::key(const std::string& k) {
  if (!body_.empty()) body_ += ", ";
  body_ += quoted(k) + ": ";
}

JsonLine& JsonLine::add(const std::string& k, double value) {
  key(k);
  body_ += number(value);
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, int64_t value) {
  key(k);
  body_ += std::to_string(value);
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, bool value) {
  key(k);
  body_ += value ? "true" : "false";
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, const std::string& value) {
  key(k);
  body_ += quoted(value);
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, std::optional<double> value) {
  key(k);
  body_ += value ? number(*value) : "null";
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, const std::vector<double>& values) {
  key(k);
  body_ += "[";
  for (size_t i = 0; i < values.size(); ++i) body_ += (i ? ", " : "") + number(values[i]);
  body_ += "]";
  return *this;
}

MetricsWriter::MetricsWriter(const std::string& path, bool append)
    : path_(path), out_(path, append ? std::ios::app : std::ios::trunc) {
  if (!out_) throw dtrain::Error("cannot write metrics file " + path);
}

void MetricsWriter::write(const JsonLine& line) {
  out_ << line.str() << '\n';
  out_.flush();
  if (!out_) throw dtrain::Error("writing metrics file " + path_ + " failed");
}

}  // namespace gpt2
