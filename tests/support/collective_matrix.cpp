#include "support/collective_matrix.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "support/check.h"
#include "support/expected_values.h"

namespace dtrain::testing {

at::Tensor make_input(c10::ScalarType dtype, int64_t n, int rank, int64_t offset) {
  at::Tensor t = at::empty({n}, at::kDouble);
  auto* p = t.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) p[i] = value(rank, offset + i);
  return t.to(dtype);
}

void expect_values(const at::Tensor& got, const std::function<double(int64_t)>& want,
                   const std::string& what) {
  at::Tensor d = got.to(at::kDouble).contiguous();
  const double* p = d.data_ptr<double>();
  const double tol = tolerance(got.scalar_type());
  for (int64_t i = 0; i < d.numel(); ++i) {
    const double w = want(i);
    DTRAIN_CHECK(std::abs(p[i] - w) <= tol * std::max(1.0, std::abs(w)),
                 "{}: element {} is {}, expected {}", what, i, p[i], w);
  }
}

const std::vector<c10::ScalarType>& all_dtypes() {
  static const std::vector<c10::ScalarType> dtypes = {at::kFloat,    at::kDouble, at::kHalf,
                                                      at::kBFloat16, at::kByte,   at::kChar,
                                                      at::kShort,    at::kInt,    at::kLong};
  return dtypes;
}

std::vector<int64_t> sizes_for(c10::ScalarType dtype) {
  std::vector<int64_t> s = {0, 1, 7, 1001};
  if (dtype == at::kFloat || dtype == at::kBFloat16) s.push_back(3 * 512 * 1024 + 3);
  return s;
}

std::vector<ReduceOp> ops_for(c10::ScalarType dtype) {
  std::vector<ReduceOp> ops = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax};
  if (c10::isFloatingType(dtype)) ops.push_back(ReduceOp::kAvg);
  return ops;
}

std::string label(const char* op, c10::ScalarType dtype, int64_t n, int rank) {
  return fmt::format("{} {} n={} rank {}", op, c10::toString(dtype), n, rank);
}

void run_collective_matrix(Communicator& c, const std::string& transport,
                           const std::vector<int64_t>& sizes, const std::string& tag) {
  DTRAIN_CHECK(c.transport_name() == transport, "transport is {}, expected {}", c.transport_name(),
               transport);
  const int world = c.world_size();
  const int root = world - 1;
  for (auto dtype : all_dtypes()) {
    for (int64_t n : sizes.empty() ? sizes_for(dtype) : sizes) {
      for (ReduceOp op : ops_for(dtype)) {
        const std::string what = tag + " " + to_string(op);
        at::Tensor t = make_input(dtype, n, c.rank());
        c.all_reduce(t, op)->wait();
        expect_values(
            t, [&](int64_t i) { return reduce_expected(op, world, i); },
            label("all_reduce", dtype, n, c.rank()) + what);
        at::Tensor in = make_input(dtype, n * world, c.rank());
        at::Tensor before = in.clone();
        at::Tensor out = at::full({n}, -1, dtype);
        c.reduce_scatter(out, in, op)->wait();
        const int64_t base = c.rank() * n;
        expect_values(
            out, [&](int64_t i) { return reduce_expected(op, world, base + i); },
            label("reduce_scatter", dtype, n, c.rank()) + what);
        DTRAIN_CHECK(at::equal(in, before), "reduce_scatter modified its input");
      }
      at::Tensor b = c.rank() == root ? make_input(dtype, n, root) : at::zeros({n}, dtype);
      c.broadcast(b, root)->wait();
      expect_values(
          b, [&](int64_t i) { return value(root, i); },
          label("broadcast", dtype, n, c.rank()) + tag);
      at::Tensor in = make_input(dtype, n, c.rank());
      at::Tensor out = at::full({n * world}, -1, dtype);
      c.all_gather(out, in)->wait();
      auto want = [&](int64_t j) { return value(static_cast<int>(j / n), j % n); };
      expect_values(out, want, label("all_gather", dtype, n, c.rank()) + tag);
      // In place: the input is this rank's slice of the output, as FSDP uses it.
      at::Tensor flat = at::zeros({n * world}, dtype);
      flat.narrow(0, c.rank() * n, n).copy_(in);
      c.all_gather(flat, flat.narrow(0, c.rank() * n, n))->wait();
      expect_values(flat, want, label("all_gather(in place)", dtype, n, c.rank()) + tag);
    }
  }
  c.barrier()->wait();
}

}  // namespace dtrain::testing
