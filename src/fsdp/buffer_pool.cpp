#include "fsdp/buffer_pool.h"

#include <utility>

namespace dtrain::fsdp {

void BufferPool::add_user(size_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  ++users_[nbytes];
}

at::DataPtr BufferPool::take(c10::Allocator& allocator, size_t nbytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(nbytes);
    if (it != free_.end()) {
      at::DataPtr data = std::move(it->second);
      free_.erase(it);
      ++reused_;
      return data;
    }
  }
  return allocator.allocate(nbytes);  // outside the lock: allocation may fault pages in
}

void BufferPool::give(at::DataPtr data, size_t nbytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto users = users_.find(nbytes);
    if (users != users_.end() && users->second >= 2 && free_.count(nbytes) == 0) {
      free_.emplace(nbytes, std::move(data));
      return;
    }
  }
  // `data` goes out of scope here: freed outside the lock.
}

size_t BufferPool::free_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [size, data] : free_) n += size;
  return n;
}

int64_t BufferPool::reused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reused_;
}

}  // namespace dtrain::fsdp
