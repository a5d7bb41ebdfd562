// The NCCL backend at world size 1: NCCL refuses two ranks on one GPU, so multi-rank
// correctness is proven on Gloo with the same shapes (tests/comm/collectives_test.cpp, and on
// CUDA tensors by scripts/gpu-check.sh), and here every collective, dtype and size goes through
// NCCL, the stream ordering and the error paths. Expected values are computed on the host from
// closed-form inputs.
//
// What world size 1 can and cannot show: every reduction returns its input, so a wrong
// ReduceOp cannot show in a result; NCCL only copies bytes, so a dtype swapped for another of
// the same size (bf16/fp16, int32/float32) cannot either. Those maps are checked on the host
// against NCCL's own enums (NcclMaps, no GPU needed). What does show: a wrong element size
// or count (the copy overruns into, or stops short of, sentinel padding around views with
// storage offsets), a wrong offset (data_ptr ignoring the view's storage offset reads or
// writes the padding), a wrong slice (the rank block of all_gather / reduce_scatter).
// The GPU tests skip without a CUDA device, or with a LibTorch built without CUDA.
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

#include "comm/nccl/nccl_util.h"
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

// What an output holds before a collective writes it: not a value() result, exact in every
// dtype (uint8 included: LibTorch 2.x refuses to fill one with -1).
constexpr double kUnwritten = 99;

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
      at::Tensor out = cuda_full(n * kWorld, kUnwritten, dtype);
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
        at::Tensor out = cuda_full(n, kUnwritten, dtype);
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

// Host-only: the dtype and reduction maps, against NCCL's enums and element sizes. Runs
// wherever the NCCL backend is built, GPU or not.
TEST(NcclMaps, EveryDtypeMapsToNcclsTypeOfTheSameKindAndSize) {
  struct Row {
    c10::ScalarType dtype;
    ncclDataType_t nccl;
    size_t bytes;
  };
  const std::vector<Row> rows = {{at::kFloat, ncclFloat32, 4}, {at::kDouble, ncclFloat64, 8},
                                 {at::kHalf, ncclFloat16, 2},  {at::kBFloat16, ncclBfloat16, 2},
                                 {at::kChar, ncclInt8, 1},     {at::kByte, ncclUint8, 1},
                                 {at::kInt, ncclInt32, 4},     {at::kLong, ncclInt64, 8}};
  const ErrorContext ctx{0, 1, "test", -1};
  for (const Row& r : rows) {
    EXPECT_EQ(nccl_backend::nccl_type(r.dtype, ctx), r.nccl) << c10::toString(r.dtype);
    EXPECT_EQ(c10::elementSize(r.dtype), r.bytes) << c10::toString(r.dtype);
  }
  EXPECT_EQ(rows.size(), kDtypes.size());
  for (auto bad : {at::kShort, at::kBool, at::kComplexFloat}) {
    EXPECT_THROW(nccl_backend::nccl_type(bad, ctx), InvalidArgument) << c10::toString(bad);
  }
}

TEST(NcclMaps, EveryReduceOpMapsToItsNcclOp) {
  for (int world : {2, 5}) {
    EXPECT_EQ(nccl_backend::nccl_op(ReduceOp::kSum, world), ncclSum);
    EXPECT_EQ(nccl_backend::nccl_op(ReduceOp::kAvg, world), ncclAvg);
    EXPECT_EQ(nccl_backend::nccl_op(ReduceOp::kMin, world), ncclMin);
    EXPECT_EQ(nccl_backend::nccl_op(ReduceOp::kMax, world), ncclMax);
  }
  // One rank: an average is a sum (NVIDIA/nccl#1950 drops the tail of a one-rank ncclAvg).
  EXPECT_EQ(nccl_backend::nccl_op(ReduceOp::kAvg, 1), ncclSum);
  EXPECT_EQ(nccl_backend::nccl_op(ReduceOp::kMax, 1), ncclMax);
}

// Views into larger buffers, with sentinel padding on both sides: a launch that ignores the
// storage offset, uses another element size or count, or the wrong rank block, touches the
// padding or leaves the expected values missing.
TEST_F(Nccl, ViewsWithStorageOffsetsGetExactlyTheirElements) {
  auto c = make_single();
  const int64_t pad = 37;
  const double sentinel = 99;  // not a value() result, and exact in every dtype
  auto padded = [&](at::Tensor buf, int64_t n) {
    return mismatch(buf.narrow(0, 0, pad), [&](int64_t) { return sentinel; }) +
           mismatch(buf.narrow(0, pad + n, buf.numel() - pad - n),
                    [&](int64_t) { return sentinel; });
  };
  for (auto dtype : kDtypes) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{(1 << 20) + 3}}) {
      const std::string what = label("view", dtype, n);
      at::Tensor in_buf = cuda_full(n * kWorld + 2 * pad, sentinel, dtype);
      at::Tensor in = in_buf.narrow(0, pad, n);
      in.copy_(make_input(dtype, n));
      ASSERT_EQ(in.storage_offset(), pad);

      at::Tensor out_buf = cuda_full(n * kWorld + 2 * pad, sentinel, dtype);
      at::Tensor out = out_buf.narrow(0, pad, n * kWorld);
      c->all_gather(out, in)->wait();
      EXPECT_EQ(mismatch(out, [&](int64_t j) { return value(static_cast<int>(j / n), j % n); }), "")
          << what << " all_gather";
      EXPECT_EQ(padded(out_buf, n * kWorld), "") << what << " all_gather padding";
      EXPECT_EQ(padded(in_buf, n), "") << what << " all_gather input padding";

      // reduce_scatter from a padded flat view into a padded shard view.
      at::Tensor flat_buf = cuda_full(n * kWorld + 2 * pad, sentinel, dtype);
      at::Tensor flat = flat_buf.narrow(0, pad, n * kWorld);
      flat.copy_(make_input(dtype, n * kWorld));
      at::Tensor shard_buf = cuda_full(n + 2 * pad, sentinel, dtype);
      at::Tensor shard = shard_buf.narrow(0, pad, n);
      for (ReduceOp op : ops_for(dtype)) {
        c->reduce_scatter(shard, flat, op)->wait();
        const int64_t base = c->rank() * n;
        EXPECT_EQ(mismatch(shard, [&](int64_t i) { return reduce_expected(op, kWorld, base + i); }),
                  "")
            << what << " reduce_scatter " << to_string(op);
        EXPECT_EQ(padded(shard_buf, n), "") << what << " reduce_scatter padding";
        EXPECT_EQ(padded(flat_buf, n * kWorld), "") << what << " reduce_scatter input padding";
      }

      // all_reduce and broadcast in place on a view.
      for (ReduceOp op : ops_for(dtype)) {
        in.copy_(make_input(dtype, n));
        c->all_reduce(in, op)->wait();
        EXPECT_EQ(mismatch(in, [&](int64_t i) { return reduce_expected(op, kWorld, i); }), "")
            << what << " all_reduce " << to_string(op);
        EXPECT_EQ(padded(in_buf, n), "") << what << " all_reduce padding";
      }
      c->broadcast(in, 0)->wait();
      EXPECT_EQ(mismatch(in, [&](int64_t i) { return value(0, i); }), "") << what << " broadcast";
      EXPECT_EQ(padded(in_buf, n), "") << what << " broadcast padding";
    }
  }
}

// The in-place layouts FSDP uses, with the flat buffer itself a view at an offset: the rank
// block is found relative to the view, not to the storage.
TEST_F(Nccl, InPlaceRankBlocksOfAnOffsetFlatView) {
  auto c = make_single();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kInt}) {
    const int64_t n = 513, pad = 5;
    at::Tensor buf = cuda_full(n * kWorld + pad, -3, dtype);
    at::Tensor flat = buf.narrow(0, pad, n * kWorld);
    flat.narrow(0, c->rank() * n, n).copy_(make_input(dtype, n));
    c->all_gather(flat, flat.narrow(0, c->rank() * n, n))->wait();
    EXPECT_EQ(mismatch(flat, [&](int64_t j) { return value(static_cast<int>(j / n), j % n); }), "")
        << c10::toString(dtype);
    flat.copy_(make_input(dtype, n * kWorld));
    c->reduce_scatter(flat.narrow(0, c->rank() * n, n), flat, ReduceOp::kSum)->wait();
    EXPECT_EQ(mismatch(flat.narrow(0, c->rank() * n, n),
                       [&](int64_t i) { return reduce_expected(ReduceOp::kSum, kWorld, i); }),
              "")
        << c10::toString(dtype);
    EXPECT_EQ(mismatch(buf.narrow(0, 0, pad), [](int64_t) { return -3.0; }), "")
        << c10::toString(dtype);
  }
}

// Non-trivial floating values (not small integers) through every floating dtype and op: the
// result must be the input rounded to the dtype, bit for bit (world size 1 only copies).
TEST_F(Nccl, FloatingValuesSurviveEveryOpBitForBit) {
  auto c = make_single();
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    const int64_t n = 4099;
    at::Tensor host = at::linspace(-3.7, 1234.5, n, at::kDouble).to(dtype);
    for (ReduceOp op : ops_for(dtype)) {
      at::Tensor t = host.to(at::Device(at::kCUDA, 0));
      c->all_reduce(t, op)->wait();
      EXPECT_TRUE(at::equal(t.cpu(), host)) << c10::toString(dtype) << " " << to_string(op);
      at::Tensor out = at::empty_like(t);
      c->reduce_scatter(out, t, op)->wait();
      EXPECT_TRUE(at::equal(out.cpu(), host)) << c10::toString(dtype) << " " << to_string(op);
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
