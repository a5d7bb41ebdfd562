// Memory of units' gathered buffers, handed from a unit that is freed to the next unit of
// the same size instead of going back to malloc. A transformer's blocks are all the same
// size, so a step then needs as many block buffers as are gathered at once, not one fresh
// allocation per unit per gather: fresh memory costs a page fault per page on first touch
// (about 21 µs per 4 KiB on the VM we measure on), and glibc maps large blocks anew each
// time.
//
// Only sizes that several units share are pooled (add_user), and at most one free
// buffer is kept per size, so the pool never holds memory nothing will ask for: a unit of
// a size of its own (typically the root, with the embeddings) gives its memory back at
// once, as without a pool. Thread-safe: units are released and refilled on the training
// thread and in autograd hooks.
#pragma once

#include <c10/core/Allocator.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

namespace dtrain::fsdp {

class BufferPool {
 public:
  BufferPool() = default;
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A unit whose buffer has `nbytes` draws from the pool: sizes with two users or more are
  // pooled.
  void add_user(size_t nbytes);

  // A buffer of `nbytes`: the free one of that size if there is one, else from `allocator`.
  at::DataPtr take(c10::Allocator& allocator, size_t nbytes);
  // Keeps `data` (of `nbytes`) for the next take() of that size when the size is shared and
  // no buffer of it is free yet; otherwise frees it.
  void give(at::DataPtr data, size_t nbytes);

  // Bytes held free right now, and take() calls served without allocating (for tests and
  // the memory report).
  size_t free_bytes() const;
  int64_t reused() const;

 private:
  mutable std::mutex mu_;
  std::map<size_t, int> users_;
  std::map<size_t, at::DataPtr> free_;  // at most one per size
  int64_t reused_ = 0;
};

}  // namespace dtrain::fsdp
