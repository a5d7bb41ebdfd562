#include "checkpoint/safetensors.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/errors.h"
#include "dtrain/json.h"

namespace dtrain {
namespace {

struct DtypeName {
  c10::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {c10::ScalarType::Float, "F32"},     {c10::ScalarType::Half, "F16"},
    {c10::ScalarType::BFloat16, "BF16"}, {c10::ScalarType::Double, "F64"},
    {c10::ScalarType::Long, "I64"},      {c10::ScalarType::Int, "I32"},
    {c10::ScalarType::Short, "I16"},     {c10::ScalarType::Char, "I8"},
    {c10::ScalarType::Byte, "U8"},       {c10::ScalarType::Bool, "BOOL"},
};

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

}  // namespace

const char* safetensors_dtype_name(c10::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  throw InvalidArgument(
      fmt::format("dtype {} has no safetensors equivalent here", c10::toString(dtype)));
}

c10::ScalarType safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  throw InvalidArgument(fmt::format("unsupported dtype \"{}\"", name));
}

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// One header entry into `t` (absolute offsets); throws std::invalid_argument or
// InvalidArgument (JsonError, an unknown dtype).
void parse_entry(const Json& value, uint64_t data_start, uint64_t data_size, SafetensorsTensor& t) {
  using std::invalid_argument;
  if (!value.is_object()) throw invalid_argument("is not an object");
  t.dtype = safetensors_dtype(value.at("dtype").as_string());
  int64_t numel = 1;
  for (const auto& d : value.at("shape").as_array()) {
    const int64_t n = d.as_int();
    if (n < 0) throw invalid_argument("negative dimension");
    if (n > 0 && numel > std::numeric_limits<int64_t>::max() / 16 / n) {
      throw invalid_argument("shape too large");
    }
    numel *= n;
    t.shape.push_back(n);
  }
  const auto& offsets = value.at("data_offsets").as_array();
  if (offsets.size() != 2) throw invalid_argument("data_offsets must hold [begin, end]");
  const int64_t b = offsets[0].as_int(), e = offsets[1].as_int();
  if (b < 0 || e < b) {
    throw invalid_argument(fmt::format("data_offsets [{}, {}] are not a range", b, e));
  }
  if (static_cast<uint64_t>(e) > data_size) {
    throw invalid_argument(fmt::format(
        "data_offsets [{}, {}] run past the data section ({} bytes; truncated?)", b, e, data_size));
  }
  const uint64_t need = static_cast<uint64_t>(numel) * c10::elementSize(t.dtype);
  if (static_cast<uint64_t>(e - b) != need) {
    throw invalid_argument(fmt::format("data_offsets [{}, {}] hold {} bytes but {} {} needs {}", b,
                                       e, e - b, safetensors_dtype_name(t.dtype),
                                       shape_string(t.shape), need));
  }
  t.begin = data_start + static_cast<uint64_t>(b);
  t.end = data_start + static_cast<uint64_t>(e);
}

}  // namespace

struct SafetensorsReader::Source {
  std::unique_ptr<checkpoint::ByteSource> impl;
};

struct SafetensorsWriter::File {
  explicit File(std::string path) : writer(std::move(path)) {}
  checkpoint::FileWriter writer;
  checkpoint::FileDigest digest;  // set by finish()
};

SafetensorsReader::SafetensorsReader(const std::string& path)
    : SafetensorsReader(
          std::make_unique<Source>(Source{std::make_unique<checkpoint::MappedFile>(path)})) {}

SafetensorsReader::~SafetensorsReader() = default;
SafetensorsReader::SafetensorsReader(SafetensorsReader&&) noexcept = default;
SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&&) noexcept = default;

const std::string& SafetensorsReader::path() const { return source_->impl->path(); }

SafetensorsReader::SafetensorsReader(std::unique_ptr<Source> source) : source_(std::move(source)) {
  const std::string& path = source_->impl->path();
  auto bad = [&](const std::string& what) {
    return CheckpointError(fmt::format("{}: not a valid safetensors file: {}", path, what));
  };
  const uint64_t file_size = source_->impl->size();
  if (file_size < 8) {
    throw bad(fmt::format("{} bytes, shorter than the 8-byte header size", file_size));
  }
  uint8_t size_bytes[8];
  source_->impl->read(0, size_bytes, 8);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | size_bytes[i];
  if (header_size > checkpoint::kMaxSafetensorsHeader) {
    throw bad(fmt::format("header size {} exceeds the {}-byte limit", header_size,
                          checkpoint::kMaxSafetensorsHeader));
  }
  if (header_size > file_size - 8) {
    throw bad(fmt::format("header size {} runs past the end of the file ({} bytes; truncated?)",
                          header_size, file_size));
  }
  std::string text(header_size, '\0');
  source_->impl->read(8, text.data(), header_size);
  header_bytes_ = source_->impl->bytes_read();
  if (text.empty() || text[0] != '{') throw bad("header does not start with '{'");
  Json header;
  try {
    header = Json::parse(text);
  } catch (const JsonError& e) {
    throw bad(fmt::format("header: {}", e.cause()));
  }
  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = file_size - data_start;
  for (const auto& [name, value] : header.as_object()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw bad("__metadata__ is not an object");
      for (const auto& [k, v] : value.as_object()) {
        if (!v.is_string())
          throw bad(fmt::format("__metadata__ value of \"{}\" is not a string", k));
        metadata_[k] = v.as_string();
      }
      continue;
    }
    SafetensorsTensor t;
    t.name = name;
    try {
      parse_entry(value, data_start, data_size, t);
    } catch (const InvalidArgument& e) {  // JsonError, an unknown dtype
      throw bad(fmt::format("tensor \"{}\": {}", name, e.cause()));
    } catch (const std::invalid_argument& e) {
      throw bad(fmt::format("tensor \"{}\": {}", name, e.what()));
    }
    index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }
  // The data section is exactly the tensors, back to back (the reference implementation
  // refuses gaps and overlaps too: they hide data or alias tensors).
  std::vector<const SafetensorsTensor*> by_offset;
  for (const auto& t : tensors_) by_offset.push_back(&t);
  std::stable_sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expect = data_start;
  const SafetensorsTensor* prev = nullptr;
  for (const auto* t : by_offset) {
    if (t->begin < expect) {
      throw bad(fmt::format("tensors \"{}\" and \"{}\" overlap", prev->name, t->name));
    }
    if (t->begin > expect) {
      throw bad(fmt::format("{} unused bytes before tensor \"{}\"", t->begin - expect, t->name));
    }
    expect = t->end;
    prev = t;
  }
  if (expect != file_size) {
    throw bad(fmt::format("{} bytes after the last tensor's data", file_size - expect));
  }
}

const SafetensorsTensor* SafetensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const SafetensorsTensor& SafetensorsReader::at(const std::string& name) const {
  const SafetensorsTensor* t = find(name);
  if (t == nullptr) {
    throw CheckpointError(fmt::format("{}: no tensor named \"{}\"", path(), name));
  }
  return *t;
}

at::Tensor SafetensorsReader::read(const std::string& name) {
  const SafetensorsTensor& t = at(name);
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
  read_bytes(t, 0, out.data_ptr(), t.nbytes());
  return out;
}

at::Tensor SafetensorsReader::read_elements(const std::string& name, int64_t begin, int64_t end) {
  const SafetensorsTensor& t = at(name);
  if (begin < 0 || end < begin || end > t.numel()) {
    throw CheckpointError(fmt::format("{}: elements [{}, {}) of tensor \"{}\" requested, it has {}",
                                      path(), begin, end, name, t.numel()));
  }
  at::Tensor out = at::empty({end - begin}, at::TensorOptions().dtype(t.dtype));
  const size_t item = c10::elementSize(t.dtype);
  read_bytes(t, static_cast<uint64_t>(begin) * item, out.data_ptr(),
             static_cast<size_t>(end - begin) * item);
  return out;
}

void SafetensorsReader::read_bytes(const SafetensorsTensor& t, uint64_t byte_offset, void* out,
                                   size_t n) {
  if (byte_offset > t.nbytes() || n > t.nbytes() - byte_offset) {
    throw CheckpointError(fmt::format("{}: bytes [{}, {}) of tensor \"{}\" requested, it has {}",
                                      path(), byte_offset, byte_offset + n, t.name, t.nbytes()));
  }
  source_->impl->read(t.begin + byte_offset, out, n);
}

uint64_t SafetensorsReader::bytes_read() const {
  return source_->impl->bytes_read() - header_bytes_;
}

const void* SafetensorsReader::mapped_data(const SafetensorsTensor& t) const {
  const uint8_t* base = source_->impl->mapped();
  return base == nullptr ? nullptr : base + t.begin;
}

void SafetensorsReader::release(const SafetensorsTensor& t) {
  source_->impl->release(t.begin, t.nbytes());
}

SafetensorsWriter::SafetensorsWriter(std::string path, const std::vector<SafetensorsTensor>& layout,
                                     const std::map<std::string, std::string>& metadata)
    : file_(std::make_unique<File>(std::move(path))) {
  const std::string& where = file_->writer.path();
  Json header = Json::object();
  if (!metadata.empty()) {
    Json m = Json::object();
    for (const auto& [k, v] : metadata) m.set(k, v);
    header.set("__metadata__", std::move(m));
  }
  for (const auto& t : layout) {
    if (t.name == "__metadata__" || header.find(t.name) != nullptr) {
      throw InvalidArgument(fmt::format(
          "write_safetensors {}: tensor name \"{}\" is reserved or repeated", where, t.name));
    }
    Json::Array shape;
    for (int64_t d : t.shape) shape.emplace_back(d);
    const uint64_t n = static_cast<uint64_t>(t.numel()) * c10::elementSize(t.dtype);
    Json entry = Json::object();
    try {
      entry.set("dtype", safetensors_dtype_name(t.dtype));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          fmt::format("write_safetensors {}: tensor \"{}\": {}", where, t.name, e.cause()));
    }
    entry.set("shape", Json(std::move(shape)));
    entry.set("data_offsets", Json(Json::Array{Json(static_cast<int64_t>(data_bytes_)),
                                               Json(static_cast<int64_t>(data_bytes_ + n))}));
    header.set(t.name, std::move(entry));
    data_bytes_ += n;
  }
  std::string text = header.dump();
  text.append((8 - (text.size() % 8)) % 8, ' ');
  uint8_t size_bytes[8];
  for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<uint8_t>(text.size() >> (8 * i));
  file_->writer.write(size_bytes, 8);
  file_->writer.write(text.data(), text.size());
  data_start_ = file_->writer.bytes_written();
}

void SafetensorsWriter::write(const void* data, size_t n) {
  if (file_->writer.bytes_written() - data_start_ + n > data_bytes_) {
    throw InvalidArgument(fmt::format("write_safetensors {}: more data than the header declares",
                                      file_->writer.path()));
  }
  file_->writer.write(data, n);
}

void SafetensorsWriter::write(const at::Tensor& t) {
  at::Tensor c = t.is_contiguous() && t.device().is_cpu() ? t : t.cpu().contiguous();
  write(c.data_ptr(), c.nbytes());
}

SafetensorsWriter::~SafetensorsWriter() = default;

uint64_t SafetensorsWriter::finish() {
  const uint64_t got = file_->writer.bytes_written() - data_start_;
  if (got != data_bytes_) {
    throw InvalidArgument(fmt::format("write_safetensors {}: {} data bytes written, {} declared",
                                      file_->writer.path(), got, data_bytes_));
  }
  file_->digest = file_->writer.finish();
  return file_->digest.size;
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  checkpoint::write_safetensors(path, tensors, metadata);
}

SafetensorsReader SafetensorsAccess::open(std::unique_ptr<checkpoint::ByteSource> source) {
  return SafetensorsReader(
      std::make_unique<SafetensorsReader::Source>(SafetensorsReader::Source{std::move(source)}));
}

checkpoint::ByteSource& SafetensorsAccess::source(SafetensorsReader& reader) {
  return *reader.source_->impl;
}

checkpoint::FileDigest SafetensorsAccess::finish(SafetensorsWriter& writer) {
  writer.finish();
  return writer.file_->digest;
}

namespace checkpoint {

FileDigest write_safetensors(const std::string& path,
                             const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata,
                             const std::function<void(const char*)>& on_progress) {
  std::vector<SafetensorsTensor> layout;
  std::vector<at::Tensor> data;
  for (const auto& [name, tensor] : tensors) {
    at::Tensor t = tensor.detach().cpu().contiguous();
    SafetensorsTensor info;
    info.name = name;
    info.dtype = t.scalar_type();
    info.shape = t.sizes().vec();
    layout.push_back(std::move(info));
    data.push_back(std::move(t));
  }
  SafetensorsWriter w(path, layout, metadata);
  for (size_t i = 0; i < data.size(); ++i) {
    if (on_progress && i == data.size() / 2 && i > 0) on_progress("mid_file");
    w.write(data[i]);
  }
  return SafetensorsAccess::finish(w);
}

}  // namespace checkpoint
}  // namespace dtrain
