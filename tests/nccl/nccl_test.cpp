// The NCCL backend at world size 1: NCCL refuses two ranks on one GPU, so multi-rank
// correctness is proven on Gloo with the same shapes (tests/comm/collectives_test.cpp), and
// here every collective, dtype and size goes through NCCL, the stream ordering and the
// error paths. Expected values are computed on the host from closed-form inputs.
// Every test skips without a CUDA device, or with a LibTorch built without CUDA.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "support/expected_values.h"

namespace dtrain {
namespace {

using std::chrono::milliseconds;
using testing::reduce_expected;
using testing::tolerance;
using testing::value;

// Empty when the tests can run; else why not.
std::string gpu_unavailable_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("no usable CUDA device ({})", cudaGetErrorString(status));
  }
  if (count == 0) return "no CUDA device";
  if (!at::hasCUDA()) return "this LibTorch was built without CUDA";
  return "";
}

int device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

at::Tensor make_input(c10::ScalarType dtype, int64_t n, int rank = 0) {
  at::Tensor host = at::empty({n}, at::kDouble);
  auto* p = host.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) p[i] = value(rank, i);
  return host.to(dtype).to(at::Device(at::kCUDA, 0));
}

at::Tensor cuda_full(int64_t n, double fill, c10::ScalarType dtype) {
  return at::full({n}, fill, at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, 0)));
}

// Copies `got` to the host (on the current stream, hence after the Work's synchronize()) and
// compares it element by element. Returns the first mismatch, or an empty string.
std::string mismatch(const at::Tensor& got, const std::function<double(int64_t)>& want) {
  const at::Tensor host = got.to(at::kCPU).to(at::kDouble).contiguous();
  const double* p = host.data_ptr<double>();
  const double tol = tolerance(got.scalar_type());
  for (int64_t i = 0; i < host.numel(); ++i) {
    const double w = want(i);
    if (std::abs(p[i] - w) > tol * std::max(1.0, std::abs(w))) {
      return fmt::format("element {} is {}, expected {}", i, p[i], w);
    }
  }
  return "";
}

const std::vector<c10::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                              at::kChar,  at::kByte,   at::kInt,  at::kLong};

// Empty, one, odd, and several MiB for fp32, fp16, bf16 and int32.
std::vector<int64_t> sizes_for(c10::ScalarType dtype) {
  std::vector<int64_t> s = {0, 1, 7, 1001};
  if (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kInt)
    s.push_back(3 * 512 * 1024 + 3);
  return s;
}

std::vector<ReduceOp> ops_for(c10::ScalarType dtype) {
  std::vector<ReduceOp> ops = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax};
  if (c10::isFloatingType(dtype)) ops.push_back(ReduceOp::kAvg);
  return ops;
}

std::string label(const char* op, c10::ScalarType dtype, int64_t n) {
  return fmt::format("{} {} n={}", op, c10::toString(dtype), n);
}

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    static const std::string reason = gpu_unavailable_reason();
    if (!reason.empty()) GTEST_SKIP() << "NCCL backend tests need a GPU: " << reason;
  }

  static CommunicatorOptions options(milliseconds timeout = milliseconds(60000)) {
    CommunicatorOptions o;
    o.backend = Backend::kNccl;
    o.device_index = 0;
    o.timeout = timeout;
    return o;
  }

  static CommunicatorPtr make_single(milliseconds timeout = milliseconds(60000)) {
    return make_communicator(make_memory_store(), 0, 1, options(timeout));
  }

  static constexpr int kWorld = 1;
};

TEST_F(Nccl, AllReduceEveryOpDtypeAndSize) {
  auto c = make_single();
  EXPECT_EQ(c->backend(), Backend::kNccl);
  for (auto dtype : kDtypes) {
    for (int64_t n : sizes_for(dtype)) {
      for (ReduceOp op : ops_for(dtype)) {
        at::Tensor t = make_input(dtype, n);
        c->all_reduce(t, op)->wait();
        EXPECT_EQ(mismatch(t, [&](int64_t i) { return reduce_expected(op, kWorld, i); }), "")
            << label("all_reduce", dtype, n) << " " << to_string(op);
      }
    }
  }
}

TEST_F(Nccl, BroadcastEveryDtypeAndSize) {
  auto c = make_single();
  for (auto dtype : kDtypes) {
    for (int64_t n : sizes_for(dtype)) {
      at::Tensor t = make_input(dtype, n);
      c->broadcast(t, 0)->wait();
      EXPECT_EQ(mismatch(t, [&](int64_t i) { return value(0, i); }), "")
          << label("broadcast", dtype, n);
    }
  }
}

TEST_F(Nccl, AllGatherEveryDtypeAndSizeAlsoInPlace) {
  auto c = make_single();
  for (auto dtype : kDtypes) {
    for (int64_t n : sizes_for(dtype)) {
      auto want = [&](int64_t j) { return value(static_cast<int>(j / n), j % n); };
      at::Tensor in = make_input(dtype, n);
      at::Tensor out = cuda_full(n * kWorld, -1, dtype);
      c->all_gather(out, in)->wait();
      EXPECT_EQ(mismatch(out, want), "") << label("all_gather", dtype, n);
      // The input is this rank's block of the output, as FSDP uses it.
      at::Tensor flat = cuda_full(n * kWorld, 0, dtype);
      flat.narrow(0, c->rank() * n, n).copy_(in);
      c->all_gather(flat, flat.narrow(0, c->rank() * n, n))->wait();
      EXPECT_EQ(mismatch(flat, want), "") << label("all_gather (in place)", dtype, n);
    }
  }
}

TEST_F(Nccl, ReduceScatterEveryOpDtypeAndSizeLeavesInputAlone) {
  auto c = make_single();
  for (auto dtype : kDtypes) {
    for (int64_t n : sizes_for(dtype)) {
      for (ReduceOp op : ops_for(dtype)) {
        at::Tensor in = make_input(dtype, n * kWorld);
        at::Tensor before = in.clone();
        at::Tensor out = cuda_full(n, -1, dtype);
        c->reduce_scatter(out, in, op)->wait();
        const int64_t base = c->rank() * n;
        EXPECT_EQ(mismatch(out, [&](int64_t i) { return reduce_expected(op, kWorld, base + i); }),
                  "")
            << label("reduce_scatter", dtype, n) << " " << to_string(op);
        EXPECT_TRUE(at::equal(in, before)) << label("reduce_scatter", dtype, n) << " input";
      }
    }
  }
}

TEST_F(Nccl, BarrierBlocksTheHostUntilDone) {
  auto c = make_single();
  auto work = c->barrier();
  work->wait();
  EXPECT_TRUE(work->is_completed());
  EXPECT_EQ(work->exception(), nullptr);
  c->barrier_sync();
}

// The call must see the caller's earlier kernels, and the caller's later kernels must see the
// call, with neither side blocking the host. The out-of-place copy NCCL does at world size 1
// races with the caller's add_() if either edge is missing; large tensors widen the window.
TEST_F(Nccl, OrdersWithTheCallersStreamBothWays) {
  auto c = make_single();
  const int64_t n = 4 << 20;
  at::Tensor in = cuda_full(n, 0, at::kFloat);
  at::Tensor out = cuda_full(n, -1, at::kFloat);
  std::vector<at::Tensor> snapshots;
  for (int k = 1; k <= 20; ++k) {
    in.add_(1);                      // before the call, on the caller's stream
    c->all_gather(out, in)->wait();  // returns without waiting for the GPU
    snapshots.push_back(out.clone());
    out.fill_(-1);  // after the call: must not overtake it
  }
  for (int k = 1; k <= 20; ++k) {
    EXPECT_EQ(mismatch(snapshots[k - 1], [&](int64_t) { return k; }), "") << "iteration " << k;
  }
}

TEST_F(Nccl, WorkContract) {
  auto c = make_single();
  EXPECT_EQ(c->sequence_number(), 0u);
  std::vector<at::Tensor> ins, outs;
  std::vector<WorkPtr> works;
  for (int k = 0; k < 6; ++k) {
    ins.push_back(make_input(at::kFloat, (1 << 20) + k));
    outs.push_back(cuda_full((1 << 20) + k, -1, at::kFloat));
    works.push_back(c->all_gather(outs.back(), ins.back()));
  }
  EXPECT_EQ(c->sequence_number(), 6u);
  // An explicit timeout blocks the host until the call completed.
  for (int k = 5; k >= 0; --k) works[k]->wait(milliseconds(30000));
  for (int k = 0; k < 6; ++k) {
    EXPECT_TRUE(works[k]->is_completed()) << k;
    EXPECT_EQ(works[k]->exception(), nullptr) << k;
    EXPECT_EQ(works[k]->sequence_number(), static_cast<uint64_t>(k));
    EXPECT_EQ(works[k]->op_name(), "all_gather");
    EXPECT_EQ(mismatch(outs[k], [](int64_t i) { return value(0, i); }), "") << k;
  }
}

TEST_F(Nccl, WorksOutliveTheirCommunicator) {
  auto c = make_single();
  at::Tensor in = make_input(at::kFloat, 3 << 20);
  at::Tensor out = cuda_full(3 << 20, -1, at::kFloat);
  WorkPtr work = c->all_gather(out, in);
  const auto start = std::chrono::steady_clock::now();
  c.reset();  // lets the queued call finish, then destroys the NCCL communicator
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_TRUE(work->is_completed());
  work->wait();
  EXPECT_EQ(mismatch(out, [](int64_t i) { return value(0, i); }), "");
}

TEST_F(Nccl, BadArgumentsThrowInvalidArgumentNamingRankAndOp) {
  auto c = make_single();
  auto expect_invalid = [&](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
    } catch (const InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 0/1"), std::string::npos) << msg;
      return;
    }
    ADD_FAILURE() << "expected InvalidArgument mentioning '" << needle << "'";
  };
  expect_invalid([&] { c->all_reduce(at::ones({3})); }, "CUDA tensors");
  expect_invalid([&] { c->broadcast(at::ones({3}), 0); }, "CUDA tensors");
  expect_invalid([&] { c->all_gather(cuda_full(3, 0, at::kFloat), at::ones({3})); }, "input");
  at::Tensor m = cuda_full(16, 0, at::kFloat).view({4, 4});
  expect_invalid([&] { c->all_reduce(m.t().narrow(0, 0, 2)); }, "contiguous");
  expect_invalid([&] { c->all_reduce(cuda_full(3, 0, at::kShort)); }, "NCCL has no such type");
  expect_invalid([&] { c->all_reduce(cuda_full(3, 0, at::kBool)); }, "dtype");
  expect_invalid([&] { c->all_reduce(cuda_full(3, 0, at::kInt), ReduceOp::kAvg); }, "floating");
  expect_invalid([&] { c->all_gather(cuda_full(5, 0, at::kFloat), cuda_full(2, 0, at::kFloat)); },
                 "all_gather");
  expect_invalid([&] { c->all_gather(cuda_full(2, 0, at::kFloat), cuda_full(2, 0, at::kHalf)); },
                 "all_gather");
  expect_invalid(
      [&] { c->reduce_scatter(cuda_full(2, 0, at::kFloat), cuda_full(5, 0, at::kFloat)); },
      "padded_size");
  at::Tensor flat = cuda_full(8, 0, at::kFloat);
  expect_invalid([&] { c->all_gather(flat.narrow(0, 0, 4), flat.narrow(0, 1, 4)); }, "overlaps");
  expect_invalid([&] { c->broadcast(cuda_full(3, 0, at::kFloat), 1); }, "root");
  expect_invalid([&] { c->send(cuda_full(3, 0, at::kFloat), 0); }, "peer");
  expect_invalid([&] { c->recv(cuda_full(3, 0, at::kFloat), 1); }, "peer");
  if (device_count() > 1) {
    at::Tensor other = at::ones({3}, at::TensorOptions().device(at::Device(at::kCUDA, 1)));
    expect_invalid([&] { c->all_reduce(other); }, "cuda:0");
  }
  // Nothing was issued: no sequence number used, and a valid call still works.
  EXPECT_EQ(c->sequence_number(), 0u);
  at::Tensor t = cuda_full(3, 2, at::kFloat);
  c->all_reduce(t)->wait();
  EXPECT_EQ(mismatch(t, [](int64_t) { return 2.0 * kWorld; }), "");
}

TEST_F(Nccl, DeviceIndexOutOfRangeIsInvalid) {
  CommunicatorOptions o = options();
  o.device_index = device_count();
  EXPECT_THROW(make_communicator(make_memory_store(), 0, 1, o), InvalidArgument);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Rank 0 of 2 alone: NCCL's initialisation waits for rank 1 and must be aborted in time.
TEST_F(Nccl, RankThatNeverJoinsMakesInitTimeOut) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(make_communicator(make_memory_store(), 0, 2, options(milliseconds(2000))),
               TimeoutError);
  EXPECT_LT(seconds_since(start), 2 * 2.0 + 1.0);
}

// Rank 1 of 2 alone: the id rank 0 would publish never appears in the store.
TEST_F(Nccl, MissingRankZeroMakesRendezvousTimeOut) {
  const auto start = std::chrono::steady_clock::now();
  try {
    make_communicator(make_memory_store(), 1, 2, options(milliseconds(1000)));
    ADD_FAILURE() << "joined without rank 0";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1/2 connect"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 2 * 1.0 + 1.0);
}

}  // namespace
}  // namespace dtrain
