// The operator profiler: what it records, self vs inclusive time, and that it records
// nothing outside an OpRecorder's life. The Kineto trace (--trace_out): what it writes, and
// that a LibTorch without Kineto fails at its construction.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "dtrain/errors.h"
#include "kineto_trace.h"
#include "op_profile.h"

namespace gpt2 {
namespace {

TEST(OpProfile, RecordsOperatorsWithSelfTimeBelowInclusive) {
  at::Tensor a = at::randn({256, 256});
  at::Tensor b = at::randn({256, 256});
  OpProfile profile;
  at::matmul(a, b);  // before recording: not counted
  const auto t0 = std::chrono::steady_clock::now();
  {
    OpRecorder rec(profile);
    for (int i = 0; i < 3; ++i) at::matmul(a, b);
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  profile.add_step(wall);
  at::matmul(a, b);  // after recording: not counted

  const auto& ops = profile.ops();
  ASSERT_TRUE(ops.count("aten::matmul")) << "matmul not recorded";
  ASSERT_TRUE(ops.count("aten::mm")) << "mm (called by matmul) not recorded";
  EXPECT_EQ(ops.at("aten::matmul").calls, 3);
  EXPECT_EQ(ops.at("aten::mm").calls, 3);
  // matmul's kernel time is mm's: matmul's self time excludes it, its inclusive time does not.
  const OpStats& mm = ops.at("aten::mm");
  const OpStats& matmul = ops.at("aten::matmul");
  EXPECT_GT(mm.self_s, 0);
  EXPECT_LE(mm.self_s, mm.total_s);
  EXPECT_GE(matmul.total_s, mm.total_s);
  EXPECT_LT(matmul.self_s, mm.self_s);
  double self_sum = 0;
  for (const auto& [name, s] : ops) self_sum += s.self_s;
  EXPECT_LE(self_sum, wall);
  EXPECT_EQ(profile.sorted().front().first, "aten::mm");
}

TEST(OpProfile, RecordsBackwardNodes) {
  at::Tensor w = at::randn({64, 64}).requires_grad_(true);
  OpProfile profile;
  {
    OpRecorder rec(profile);
    at::mm(w, w).sum().backward();
  }
  bool backward_node = false;
  for (const auto& [name, s] : profile.ops()) {
    backward_node = backward_node || name.find("MmBackward") != std::string::npos;
  }
  EXPECT_TRUE(backward_node) << "no MmBackward node recorded";
}

TEST(OpProfile, OneRecorderAtATime) {
  OpProfile p1, p2;
  OpRecorder rec(p1);
  EXPECT_THROW(OpRecorder second(p2), dtrain::InvalidArgument);
}

TEST(OpProfile, WritesJsonSortedBySelfTime) {
  OpProfile profile;
  profile.add_call("aten::small", 0.001, 0.002);
  profile.add_call("aten::big", 0.5, 0.5);
  profile.add_call("aten::big", 0.25, 0.25);
  profile.add_step(1.0);
  const std::string path = ::testing::TempDir() + "op_profile_test.json";
  profile.write_json(path);
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  const std::string json = text.str();
  EXPECT_NE(json.find("\"steps\": 1"), std::string::npos) << json;
  const size_t big = json.find("aten::big");
  const size_t small = json.find("aten::small");
  ASSERT_NE(big, std::string::npos);
  ASSERT_NE(small, std::string::npos);
  EXPECT_LT(big, small) << json;
  EXPECT_NE(json.find("\"calls\": 2"), std::string::npos) << json;
}

std::string read_file(const std::string& path) {
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  return text.str();
}

// With Kineto (LibTorch 2.x as Debian and PyTorch build it) the trace holds the operators run
// between start() and stop(), and not those before; without it (Debian bookworm's 1.13) the
// constructor says so, before anything is trained.
TEST(KinetoTrace, WritesTheTracedOperatorsOrRefusesAtConstruction) {
  const std::string path = ::testing::TempDir() + "kineto_trace_test.json";
  std::unique_ptr<KinetoTrace> trace;
  try {
    trace = std::make_unique<KinetoTrace>(path, /*cuda=*/false);
  } catch (const dtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("USE_KINETO"), std::string::npos) << e.what();
    GTEST_SKIP() << "this LibTorch has no Kineto: " << e.what();
  }
  at::Tensor a = at::randn({64, 64});
  (void)at::addmm(a, a, a);  // before start(): not in the trace
  trace->start();
  EXPECT_TRUE(trace->recording());
  (void)at::mm(a, a);
  EXPECT_GT(trace->stop(), 0u);
  EXPECT_FALSE(trace->recording());
  const std::string json = read_file(path);
  EXPECT_NE(json.find("\"traceEvents\""), std::string::npos) << json.substr(0, 500);
  EXPECT_NE(json.find("\"aten::mm\""), std::string::npos) << json.substr(0, 2000);
  EXPECT_EQ(json.find("\"aten::addmm\""), std::string::npos);
  EXPECT_THROW(trace->start(), dtrain::Error);  // one window per trace
}

TEST(KinetoTrace, AnUnwritablePathFailsAtConstruction) {
  EXPECT_THROW(KinetoTrace("/nonexistent-dir/trace.json", false), dtrain::Error);
}

}  // namespace
}  // namespace gpt2
