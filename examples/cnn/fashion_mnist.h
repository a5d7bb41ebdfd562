// Fashion-MNIST (Zalando's 28x28 grey images of 10 kinds of clothing) from its IDX files, as
// Debian's dataset-fashion-mnist package installs them (gzip-compressed, in
// /usr/share/datasets/fashion-mnist).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace cnn {

inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct Images {
  at::Tensor x;  // float32 [N, 1, 28, 28], pixels scaled to [0, 1] then normalised
  at::Tensor y;  // int64 [N], the class in [0, 10)
};

// Reads the first `limit` images and labels (0: all) of split "train" (60,000) or "t10k"
// (10,000) from `dir`. Throws std::runtime_error naming the file and what is wrong (missing,
// not gzip, a wrong IDX magic number or shape, truncated, or images and labels that differ
// in count), and for a missing directory says which Debian package installs it.
Images load_fashion_mnist(const std::string& dir, const std::string& split, int64_t limit = 0);

}  // namespace cnn
