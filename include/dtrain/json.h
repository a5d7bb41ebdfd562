// dtrain's one JSON reader (and writer): a small JSON value, for safetensors headers,
// checkpoint manifests and the files tools and examples read (a tokenizer's vocabulary, a
// trainer's metrics lines); dtrain has no JSON dependency.
//
// clang-format off
//   const dtrain::Json j = dtrain::Json::parse(text);   // throws dtrain::JsonError
//   for (const auto& [key, value] : j.as_object()) {   // in the file's order
//     if (key == "step") step = value.as_int();        // throws if not an integer
//   }
// clang-format on
//
// Objects keep their key order; duplicate keys, trailing garbage, nesting deeper than 64 and
// invalid UTF-16 escapes are refused. Integers that fit in int64 stay exact; other numbers
// are doubles. Strings come back as UTF-8.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dtrain/errors.h"

namespace dtrain {

// What the parser refuses, or a value of another type or a missing key than asked for;
// cause() names the byte offset (parse) or the key/type and the problem.
class JsonError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

class Json {
 public:
  enum class Type { kNull, kBool, kInt, kDouble, kString, kArray, kObject };
  using Object = std::vector<std::pair<std::string, Json>>;
  using Array = std::vector<Json>;

  Json() = default;
  Json(bool b) : type_(Type::kBool), bool_(b) {}                     // NOLINT
  Json(int v) : type_(Type::kInt), int_(v) {}                        // NOLINT
  Json(int64_t v) : type_(Type::kInt), int_(v) {}                    // NOLINT
  Json(uint32_t v) : type_(Type::kInt), int_(v) {}                   // NOLINT
  Json(double v) : type_(Type::kDouble), double_(v) {}               // NOLINT
  Json(std::string s) : type_(Type::kString), str_(std::move(s)) {}  // NOLINT
  Json(const char* s) : type_(Type::kString), str_(s) {}             // NOLINT
  Json(Array a) : type_(Type::kArray), array_(std::move(a)) {}       // NOLINT
  static Json object() {
    Json j;
    j.type_ = Type::kObject;
    return j;
  }

  static Json parse(std::string_view text);
  std::string dump() const;  // compact, deterministic

  Type type() const { return type_; }
  bool is_object() const { return type_ == Type::kObject; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_int() const { return type_ == Type::kInt; }
  bool is_number() const { return type_ == Type::kInt || type_ == Type::kDouble; }

  // Typed access; throws JsonError naming the expected type.
  bool as_bool() const;
  int64_t as_int() const;
  double as_double() const;
  const std::string& as_string() const;
  const Array& as_array() const;
  Array& as_array();
  const Object& as_object() const;

  // Object access: find returns null when absent; at throws JsonError naming the key;
  // set replaces or appends.
  const Json* find(std::string_view key) const;
  const Json& at(std::string_view key) const;
  Json& set(std::string key, Json value);
  void push_back(Json value) { as_array().push_back(std::move(value)); }

 private:
  friend class JsonParser;
  Type type_ = Type::kNull;
  bool bool_ = false;
  int64_t int_ = 0;
  double double_ = 0;
  std::string str_;
  Array array_;
  Object object_;
};

const char* to_string(Json::Type type);

}  // namespace dtrain
