#include "dtrain/json.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <unordered_set>

#include <fmt/format.h>

namespace dtrain {

const char* to_string(Json::Type type) {
  switch (type) {
    case Json::Type::kNull:
      return "null";
    case Json::Type::kBool:
      return "boolean";
    case Json::Type::kInt:
      return "integer";
    case Json::Type::kDouble:
      return "number";
    case Json::Type::kString:
      return "string";
    case Json::Type::kArray:
      return "array";
    case Json::Type::kObject:
      return "object";
  }
  return "?";
}

namespace {

[[noreturn]] void wrong_type(Json::Type want, Json::Type got) {
  throw JsonError(fmt::format("expected a JSON {}, got {}", to_string(want), to_string(got)));
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

void dump_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void dump_to(std::string& out, const Json& j) {
  switch (j.type()) {
    case Json::Type::kNull:
      out += "null";
      break;
    case Json::Type::kBool:
      out += j.as_bool() ? "true" : "false";
      break;
    case Json::Type::kInt:
      out += std::to_string(j.as_int());
      break;
    case Json::Type::kDouble: {
      const double d = j.as_double();
      if (!std::isfinite(d)) throw JsonError("JSON cannot hold a non-finite number");
      std::string text = fmt::format("{}", d);  // shortest form that reads back exactly
      if (text.find_first_of(".eE") == std::string::npos) text += ".0";  // stays a double
      out += text;
      break;
    }
    case Json::Type::kString:
      dump_string(out, j.as_string());
      break;
    case Json::Type::kArray: {
      out += '[';
      bool first = true;
      for (const auto& v : j.as_array()) {
        if (!first) out += ',';
        first = false;
        dump_to(out, v);
      }
      out += ']';
      break;
    }
    case Json::Type::kObject: {
      out += '{';
      bool first = true;
      for (const auto& [k, v] : j.as_object()) {
        if (!first) out += ',';
        first = false;
        dump_string(out, k);
        out += ':';
        dump_to(out, v);
      }
      out += '}';
      break;
    }
  }
}

}  // namespace

class JsonParser {
 public:
  explicit JsonParser(std::string_view s) : s_(s) {}

  Json parse_document() {
    Json v = value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected trailing characters");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void fail(const std::string& what) const {
    throw JsonError(fmt::format("invalid JSON at byte {}: {}", pos_, what));
  }
  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  char peek() {
    if (pos_ >= s_.size()) fail("unexpected end");
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail(fmt::format("expected '{}'", c));
    ++pos_;
  }
  bool literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  Json value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 64");
    skip_ws();
    const char c = peek();
    if (c == '{') return object(depth);
    if (c == '[') {
      ++pos_;
      Json a{Json::Array{}};
      skip_ws();
      if (peek() == ']') {
        ++pos_;
        return a;
      }
      for (;;) {
        a.array_.push_back(value(depth + 1));
        skip_ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(']');
        return a;
      }
    }
    if (c == '"') return Json(string());
    if (literal("true")) return Json(true);
    if (literal("false")) return Json(false);
    if (literal("null")) return Json();
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    fail(fmt::format("unexpected character '{}'", c));
  }

  Json object(int depth) {
    expect('{');
    Json o = Json::object();
    skip_ws();
    if (peek() == '}') {
      ++pos_;
      return o;
    }
    // Keys seen so far: a hash set, so an object of n keys (a tokenizer's vocabulary has
    // 50,257) is checked in O(n), not O(n^2).
    std::unordered_set<std::string> keys;
    for (;;) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      std::string key = string();
      if (!keys.insert(key).second) fail(fmt::format("duplicate key \"{}\"", key));
      skip_ws();
      expect(':');
      o.object_.emplace_back(std::move(key), value(depth + 1));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect('}');
      return o;
    }
  }

  uint32_t hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9')
        v |= h - '0';
      else if (h >= 'a' && h <= 'f')
        v |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F')
        v |= h - 'A' + 10;
      else
        fail("bad hex digit in \\u escape");
    }
    return v;
  }

  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (!literal("\\u")) fail("unpaired surrogate");
            const uint32_t lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("unpaired surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default:
          fail(fmt::format("bad escape '\\{}'", e));
      }
    }
  }

  Json number() {
    const size_t start = pos_;
    if (s_[pos_] == '-') ++pos_;
    if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9') fail("bad number");
    if (s_[pos_] == '0' && pos_ + 1 < s_.size() && s_[pos_ + 1] >= '0' && s_[pos_ + 1] <= '9')
      fail("leading zero in number");
    bool integral = true;
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c >= '0' && c <= '9') {
        ++pos_;
      } else if (c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-') {
        integral = false;
        ++pos_;
      } else {
        break;
      }
    }
    const std::string text(s_.substr(start, pos_ - start));
    char* end = nullptr;
    errno = 0;
    if (integral) {
      const long long v = std::strtoll(text.c_str(), &end, 10);
      if (errno == ERANGE) fail("integer out of range");
      if (end != text.c_str() + text.size()) fail("bad number");
      return Json(static_cast<int64_t>(v));
    }
    const double d = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size() || errno == ERANGE) fail("bad number");
    return Json(d);
  }

  std::string_view s_;
  size_t pos_ = 0;
};

Json Json::parse(std::string_view text) { return JsonParser(text).parse_document(); }

std::string Json::dump() const {
  std::string out;
  dump_to(out, *this);
  return out;
}

bool Json::as_bool() const {
  if (type_ != Type::kBool) wrong_type(Type::kBool, type_);
  return bool_;
}
int64_t Json::as_int() const {
  if (type_ != Type::kInt) wrong_type(Type::kInt, type_);
  return int_;
}
double Json::as_double() const {
  if (type_ == Type::kInt) return static_cast<double>(int_);
  if (type_ != Type::kDouble) wrong_type(Type::kDouble, type_);
  return double_;
}
const std::string& Json::as_string() const {
  if (type_ != Type::kString) wrong_type(Type::kString, type_);
  return str_;
}
const Json::Array& Json::as_array() const {
  if (type_ != Type::kArray) wrong_type(Type::kArray, type_);
  return array_;
}
Json::Array& Json::as_array() {
  if (type_ != Type::kArray) wrong_type(Type::kArray, type_);
  return array_;
}
const Json::Object& Json::as_object() const {
  if (type_ != Type::kObject) wrong_type(Type::kObject, type_);
  return object_;
}
const Json* Json::find(std::string_view key) const {
  for (const auto& [k, v] : as_object()) {
    if (k == key) return &v;
  }
  return nullptr;
}
const Json& Json::at(std::string_view key) const {
  const Json* v = find(key);
  if (v == nullptr) throw JsonError(fmt::format("missing key \"{}\"", key));
  return *v;
}
Json& Json::set(std::string key, Json value) {
  if (type_ != Type::kObject) wrong_type(Type::kObject, type_);
  for (auto& [k, v] : object_) {
    if (k == key) return v = std::move(value);
  }
  object_.emplace_back(std::move(key), std::move(value));
  return object_.back().second;
}

}  // namespace dtrain
