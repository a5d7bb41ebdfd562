#include "fashion_mnist.h"

#include <ATen/ATen.h>
#include <sys/stat.h>
#include <zlib.h>

#include <array>
#include <memory>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

namespace cnn {
namespace {

// Fashion-MNIST's mean and standard deviation of pixel values in [0, 1] (training set).
constexpr float kMean = 0.2860f;
constexpr float kStd = 0.3530f;

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};

class GzReader {
 public:
  explicit GzReader(std::string path) : path_(std::move(path)) {
    file_.reset(gzopen(path_.c_str(), "rb"));
    if (!file_) throw std::runtime_error(fmt::format("{}: cannot open", path_));
  }

  void read(void* out, size_t n, const char* what) {
    auto* p = static_cast<char*>(out);
    while (n > 0) {
      const int chunk = static_cast<int>(std::min<size_t>(n, 1u << 30));
      const int got = gzread(file_.get(), p, static_cast<unsigned>(chunk));
      if (got <= 0) {
        int err = 0;
        const char* msg = gzerror(file_.get(), &err);
        throw std::runtime_error(fmt::format("{}: truncated or corrupt while reading {} ({})",
                                             path_, what, err != Z_OK ? msg : "end of file"));
      }
      p += got;
      n -= static_cast<size_t>(got);
    }
  }

  uint32_t big_endian_u32(const char* what) {
    std::array<unsigned char, 4> b{};
    read(b.data(), b.size(), what);
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<gzFile_s, GzCloser> file_;
};

// The IDX header: magic (0x0803 images, 0x0801 labels), then one u32 per dimension.
std::vector<uint32_t> read_header(GzReader& in, uint32_t magic, size_t dims) {
  const uint32_t got = in.big_endian_u32("the IDX magic number");
  if (got != magic) {
    throw std::runtime_error(
        fmt::format("{}: IDX magic number {:#010x}, expected {:#010x}", in.path(), got, magic));
  }
  std::vector<uint32_t> shape;
  for (size_t i = 0; i < dims; ++i) shape.push_back(in.big_endian_u32("the IDX shape"));
  return shape;
}

}  // namespace

Images load_fashion_mnist(const std::string& dir, const std::string& split, int64_t limit) {
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw std::runtime_error(fmt::format(
        "{}: no such directory; Debian installs Fashion-MNIST there with `apt-get install "
        "dataset-fashion-mnist`",
        dir));
  }
  if (split != "train" && split != "t10k")
    throw std::runtime_error(fmt::format("split '{}': expected train or t10k", split));
  if (limit < 0) throw std::runtime_error(fmt::format("limit {} must be >= 0", limit));

  GzReader images(fmt::format("{}/{}-images-idx3-ubyte.gz", dir, split));
  GzReader labels(fmt::format("{}/{}-labels-idx1-ubyte.gz", dir, split));
  const auto ishape = read_header(images, 0x00000803, 3);
  const auto lshape = read_header(labels, 0x00000801, 1);
  if (ishape[1] != 28 || ishape[2] != 28) {
    throw std::runtime_error(
        fmt::format("{}: images of {}x{}, expected 28x28", images.path(), ishape[1], ishape[2]));
  }
  if (ishape[0] != lshape[0]) {
    throw std::runtime_error(fmt::format("{} holds {} images but {} holds {} labels", images.path(),
                                         ishape[0], labels.path(), lshape[0]));
  }
  const int64_t n = limit > 0 ? std::min<int64_t>(limit, ishape[0]) : int64_t{ishape[0]};
  at::Tensor pixels = at::empty({n, 1, 28, 28}, at::kByte);
  at::Tensor y = at::empty({n}, at::kByte);
  images.read(pixels.data_ptr<uint8_t>(), static_cast<size_t>(n) * 28 * 28, "the pixels");
  labels.read(y.data_ptr<uint8_t>(), static_cast<size_t>(n), "the labels");
  if (n > 0 && y.max().item<int64_t>() > 9) {
    throw std::runtime_error(fmt::format("{}: a label above 9", labels.path()));
  }
  return {(pixels.to(at::kFloat) / 255.0f - kMean) / kStd, y.to(at::kLong)};
}

}  // namespace cnn
