// DataParallel with ranks as real processes over the TCP store: the final parameters of
// every rank must equal single-device training on the global batch.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "dtrain/single_device.h"
#include "strategy/training.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

TEST(MultiProcessDataParallel, ThreeProcessesMatchSingleDevice) {
  const int world = 3;
  at::set_num_threads(1);
  const Case c;
  const auto data = make_data(c.model, world);
  auto ref = make_model(c.model, 7);
  SingleDevice single(ref);
  train(c, single, *ref, data, 0, kLocalBatch * world, nullptr);

  const int port = free_port();
  std::vector<Process> ps;
  std::vector<std::string> outs;
  for (int r = 0; r < world; ++r) {
    outs.push_back(::testing::TempDir() + "dtrain_ddp_rank" + std::to_string(r) + "_" +
                   std::to_string(port) + ".bin");
    ps.push_back(
        spawn_process({DTRAIN_TEST_WORKER, "ddp", "60000", outs.back()}, rank_env(r, world, port)));
  }
  for (int r = 0; r < world; ++r) {
    auto res = wait_process(ps[r], 120);
    ASSERT_EQ(res.exit_code, 0) << "rank " << r << ":\n" << res.output;
  }
  for (int r = 0; r < world; ++r) {
    std::ifstream in(outs[r], std::ios::binary);
    ASSERT_TRUE(in.good()) << outs[r];
    for (const auto& item : ref->named_parameters()) {
      at::Tensor got = at::empty_like(item.value());
      in.read(static_cast<char*>(got.data_ptr()), got.numel() * 4);
      ASSERT_TRUE(in.good()) << "short file for rank " << r;
      EXPECT_TRUE(at::allclose(got, item.value(), c.rtol, c.atol))
          << "rank " << r << " " << item.key() << " max |diff| "
          << (got - item.value()).abs().max().item<double>();
    }
    std::remove(outs[r].c_str());
  }
}

}  // namespace
}  // namespace dtrain
