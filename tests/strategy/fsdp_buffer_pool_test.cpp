// fsdp::BufferPool: gathered-buffer memory handed from a freed unit to the next unit of the
// same size (src/fsdp/buffer_pool.h).
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fsdp/buffer_pool.h"
#include "fsdp/flat_param.h"

namespace dtrain::fsdp {
namespace {

c10::Allocator& cpu() { return *c10::GetCPUAllocator(); }

TEST(FsdpBufferPool, ASharedSizeIsHandedToTheNextTakeOfThatSize) {
  BufferPool pool;
  pool.add_user(4096);
  pool.add_user(4096);
  pool.add_user(8192);
  at::DataPtr a = pool.take(cpu(), 4096);
  void* const memory = a.get();
  ASSERT_NE(memory, nullptr);
  EXPECT_EQ(pool.reused(), 0);
  pool.give(std::move(a), 4096);
  EXPECT_EQ(pool.free_bytes(), 4096u);
  at::DataPtr b = pool.take(cpu(), 4096);
  EXPECT_EQ(b.get(), memory);
  EXPECT_EQ(pool.reused(), 1);
  EXPECT_EQ(pool.free_bytes(), 0u);
  // Another size is never served from it.
  pool.give(std::move(b), 4096);
  at::DataPtr c = pool.take(cpu(), 8192);
  EXPECT_NE(c.get(), memory);
  EXPECT_EQ(pool.reused(), 1);
  EXPECT_EQ(pool.free_bytes(), 4096u);
}

TEST(FsdpBufferPool, KeepsNothingNoOtherUnitCanUse) {
  BufferPool pool;
  pool.add_user(4096);
  pool.add_user(4096);
  pool.add_user(8192);
  pool.give(pool.take(cpu(), 8192), 8192);  // a size of one unit only: freed at once
  EXPECT_EQ(pool.free_bytes(), 0u);
  at::DataPtr a = pool.take(cpu(), 4096);
  at::DataPtr b = pool.take(cpu(), 4096);
  pool.give(std::move(a), 4096);
  pool.give(std::move(b), 4096);  // one free buffer per size at most
  EXPECT_EQ(pool.free_bytes(), 4096u);
}

// Two units of equal size: the memory the first releases is what the second is refilled
// with, and the second's parameters read what is gathered into it.
TEST(FsdpBufferPool, AReleasedUnitsMemoryRefillsTheNextUnitOfItsSize) {
  BufferPool pool;
  std::vector<at::Tensor> b_params{at::full({3, 5}, 2.0f), at::full({7}, 2.0f)};
  FlatParam a({at::full({3, 5}, 1.0f), at::full({7}, 1.0f)}, {"w", "b"},
              FlatParamOptions{4, 1, at::kFloat, false, &pool});
  FlatParam b(b_params, {"w", "b"}, FlatParamOptions{4, 1, at::kFloat, false, &pool});
  const void* const a_memory = a.full().data_ptr();
  a.release();
  EXPECT_TRUE(a.released());
  EXPECT_EQ(pool.free_bytes(), a.full_bytes());
  b.release();  // one free buffer per size: b's memory is freed
  EXPECT_EQ(pool.free_bytes(), a.full_bytes());
  b.refill();
  EXPECT_EQ(b.full().data_ptr(), a_memory);
  EXPECT_EQ(pool.free_bytes(), 0u);
  EXPECT_EQ(pool.reused(), 1);
  b.full().fill_(3.0f);                                         // what a gather writes
  EXPECT_TRUE(at::equal(b_params[0], at::full({3, 5}, 3.0f)));  // b's parameters are views
  a.refill();                                                   // nothing free: fresh memory
  EXPECT_FALSE(a.released());
  EXPECT_NE(a.full().data_ptr(), a_memory);
}

}  // namespace
}  // namespace dtrain::fsdp
