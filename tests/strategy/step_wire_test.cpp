// StepStats::wire (dtrain/strategy.h): a strategy's bytes on the wire per step. A known
// DataParallel step at 2 ranks against its closed form, on two (fake) hosts A B and on one
// host; FSDP's against wire_stats() summed over every communicator it uses, its host group
// under reshard_after_forward kHost included (which the GPT-2 trainer's own readings missed).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "comm/call_header.h"
#include "dtrain/data_parallel.h"
#include "dtrain/fsdp.h"
#include "dtrain/quantization.h"
#include "dtrain/single_device.h"
#include "dtrain/wire_stats.h"
#include "strategy/test_models.h"
#include "support/check.h"
#include "support/hosts.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

constexpr uint64_t kHeader = sizeof(detail::CallHeader);

CommunicatorPtr borrowed(Communicator& c) {
  return std::shared_ptr<Communicator>(&c, [](Communicator*) {});
}

// Every field, so that a failure names the kind and the side of the host boundary.
void expect_same(const WireStats& got, const WireStats& want, const std::string& what) {
  struct Kind {
    const char* name;
    WireBytes WireStats::*field;
  };
  for (const Kind& k :
       {Kind{"all_reduce", &WireStats::all_reduce}, Kind{"broadcast", &WireStats::broadcast},
        Kind{"all_gather", &WireStats::all_gather},
        Kind{"reduce_scatter", &WireStats::reduce_scatter},
        Kind{"point_to_point", &WireStats::point_to_point}, Kind{"control", &WireStats::control}}) {
    const WireBytes& g = got.*k.field;
    const WireBytes& w = want.*k.field;
    DTRAIN_CHECK(g.intra_host == w.intra_host && g.inter_host == w.inter_host,
                 "{}: {} intra {} inter {}, expected intra {} inter {}", what, k.name, g.intra_host,
                 g.inter_host, w.intra_host, w.inter_host);
  }
  DTRAIN_CHECK(got.counted == want.counted, "{}: counted {}", what, got.counted);
}

// What one rank of a 2-rank Gloo job sends in a DataParallel step of Linear(8, 4): one
// bucket of 36 floats (144 bytes; Gloo's 4 ring segments divide it evenly, so each rank
// sends 2 (N - 1) / N of it, all of it at 2 ranks), the step agreements at forward's start
// and backward's end (an all-gather of 3 int64 each: (N - 1) * 24 bytes), and one header to
// the peer per collective. With gradient sync off, the agreements only.
WireStats dp_step_closed_form(bool cross_hosts, bool sync) {
  WireStats w;
  w.counted = true;
  auto put = [&](WireBytes& b, uint64_t n) { (cross_hosts ? b.inter_host : b.intra_host) = n; };
  put(w.all_reduce, sync ? 144 : 0);
  put(w.all_gather, 2 * 24);
  put(w.control, (sync ? 3 : 2) * kHeader);
  return w;
}

class DataParallelStepWire : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(DataParallelStepWire, EqualsTheClosedFormOfAKnownStep) {
  const std::vector<std::string> hosts = GetParam();
  const bool cross = hosts[0] != hosts[1];
  at::set_num_threads(1);
  CommunicatorOptions o;
  o.transport = Transport::kGloo;  // the same algorithm on one host and on two
  run_ranks_on_hosts(
      hosts,
      [&](Communicator& comm) {
        torch::manual_seed(1);
        auto model = torch::nn::Linear(8, 4);
        DataParallel ddp(model.ptr(), borrowed(comm));
        for (int step = 0; step < 4; ++step) {
          // Steps 0 and 1 build and rebuild the buckets; 2 and 3 are steady.
          const bool sync = step != 3;
          ddp.set_requires_gradient_sync(sync);
          at::Tensor x = at::randn({5, 8});
          const WireStats before = wire_stats(comm);
          at::Tensor loss = ddp.forward([&] { return model->forward(x).square().mean(); });
          ddp.backward(loss);
          ddp.grad_norm();  // local under DataParallel: sends nothing
          const WireStats sent = wire_stats(comm).since(before);
          const WireStats& stats = ddp.last_step_stats().wire;
          const std::string what = fmt::format("rank {} step {}", comm.rank(), step);
          expect_same(stats, sent, what + " (against the test's own readings)");
          if (step >= 2) expect_same(stats, dp_step_closed_form(cross, sync), what);
        }
      },
      o);
}

INSTANTIATE_TEST_SUITE_P(Hosts, DataParallelStepWire,
                         ::testing::Values(std::vector<std::string>{"A", "B"},
                                           std::vector<std::string>{"A", "A"}),
                         [](const auto& info) { return info.param[0] + info.param[1]; });

// On one host with the default transport (shared memory): every byte intra-host.
TEST(DataParallelStepWireShm, NothingCrossesHostsOnOneHost) {
  at::set_num_threads(1);
  run_ranks(2, [&](Communicator& comm) {
    torch::manual_seed(1);
    auto model = torch::nn::Linear(8, 4);
    DataParallel ddp(model.ptr(), borrowed(comm));
    for (int step = 0; step < 3; ++step) {
      at::Tensor x = at::randn({5, 8});
      ddp.backward(ddp.forward([&] { return model->forward(x).square().mean(); }));
    }
    const WireStats& w = ddp.last_step_stats().wire;
    DTRAIN_CHECK(w.counted && w.total().inter_host == 0 && w.all_reduce.intra_host > 0,
                 "rank {}: transport {}, intra {} inter {} (all_reduce intra {})", comm.rank(),
                 comm.transport_name(), w.total().intra_host, w.total().inter_host,
                 w.all_reduce.intra_host);
  });
}

// FULL_SHARD over hosts A A B B with kHost: backward's gathers go over the host group
// (make_host_group), a communicator of its own. The step's wire is the world's and the host
// group's readings summed, the host group's all intra-host; grad_norm()'s all-reduce joins
// the step.
TEST(FsdpStepWire, CountsEveryCommunicatorItUsesTheHostGroupIncluded) {
  at::set_num_threads(1);
  const std::vector<std::string> hosts = {"A", "A", "B", "B"};
  auto store = make_memory_store();
  std::atomic<uint64_t> reduce_scatter_inter{0};
  run_threads(4, [&](int r) {
    // The world's default name: across hosts its hierarchical transport keeps per-host
    // segments under "default/host<h>", which make_host_group's group once collided with.
    CommunicatorPtr world = make_host_communicator(store, r, hosts);
    CommunicatorPtr host = make_host_group(store, r, 4, 2);
    torch::manual_seed(2);
    // Units as entries of a Sequential, which FSDP runs through unit_call itself.
    torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                                torch::nn::Linear(16, 4));
    FsdpOptions o;
    o.reshard_after_forward = ReshardAfterForward::kHost;
    o.host_group = host;
    o.wrap_policy = [](const std::string& name, const torch::nn::Module&) {
      return name == "0" || name == "2";
    };
    FullyShardedDataParallel fsdp(model.ptr(), world, o);
    for (int step = 0; step < 3; ++step) {
      at::Tensor x = at::randn({3, 8});
      const WireStats world_before = wire_stats(*world), host_before = wire_stats(*host);
      fsdp.backward(fsdp.forward([&] { return model->forward(x).square().mean(); }));
      const double norm = fsdp.grad_norm();
      const WireStats host_sent = wire_stats(*host).since(host_before);
      WireStats sent = wire_stats(*world).since(world_before);
      sent += host_sent;
      const std::string what = fmt::format("rank {} step {}", r, step);
      expect_same(fsdp.last_step_stats().wire, sent, what);
      DTRAIN_CHECK(std::isfinite(norm), "{}: norm {}", what, norm);
      DTRAIN_CHECK(host_sent.all_gather.intra_host > 0 && host_sent.total().inter_host == 0,
                   "{}: the host group sent all_gather intra {}, inter {} in all", what,
                   host_sent.all_gather.intra_host, host_sent.total().inter_host);
      reduce_scatter_inter += sent.reduce_scatter.inter_host;
    }
  });
  // The world's reduce-scatters cross hosts (from the host leaders: the hierarchical
  // transport sums inside a host first, so a host's other ranks may send nothing across).
  EXPECT_GT(reduce_scatter_inter.load(), 0u);
}

// DataParallel with the two-level quantised hook over hosts A A B B: the hook's host group
// (CommHook::communicators) joins the step's wire, and int8 sends about a quarter of the
// uncompressed step's bytes across hosts (a bucket of 1040 floats, 4160 bytes in fp32).
TEST(DataParallelStepWire, CountsTheHooksHostGroupAndSendsAQuarterAcrossHosts) {
  at::set_num_threads(1);
  const std::vector<std::string> hosts = {"A", "A", "B", "B"};
  std::atomic<uint64_t> inter_plain{0}, inter_int8{0};
  for (bool quantised : {false, true}) {
    auto store = make_memory_store();
    run_threads(4, [&](int r) {
      CommunicatorPtr world = make_host_communicator(store, r, hosts);
      CommunicatorPtr host = make_host_group(store, r, 4, 2);
      torch::manual_seed(1);
      auto model = torch::nn::Linear(64, 16);
      DataParallelOptions o;
      if (quantised) o.comm_hook = quantized_allreduce_hook(Quantization::kInt8, 256, host);
      DataParallel ddp(model.ptr(), world, o);
      for (int step = 0; step < 3; ++step) {
        at::Tensor x = at::randn({5, 64});
        const WireStats world_before = wire_stats(*world), host_before = wire_stats(*host);
        ddp.backward(ddp.forward([&] { return model->forward(x).square().mean(); }));
        const WireStats host_sent = wire_stats(*host).since(host_before);
        WireStats sent = wire_stats(*world).since(world_before);
        sent += host_sent;
        const std::string what = fmt::format("rank {} step {} quantised {}", r, step, quantised);
        expect_same(ddp.last_step_stats().wire, sent, what);
        DTRAIN_CHECK(!quantised || host_sent.total().intra_host > 0,
                     "{}: the host group sent "
                     "nothing",
                     what);
        if (step == 2) {
          const WireBytes data = quantised ? sent.point_to_point : sent.all_reduce;
          (quantised ? inter_int8 : inter_plain) += data.inter_host;
        }
      }
    });
  }
  // Ranks summed: fp32's host leaders exchange the bucket's halves twice (reduce-scatter and
  // all-gather), each way; int8's four ranks each send two quantised chunks of 260 values
  // (two blocks of up to 256: 2 scales).
  const uint64_t chunk = 2 * 4 + 260;  // quantized_bytes(int8, 260, 256)
  EXPECT_EQ(inter_int8.load(), 4u * 2u * chunk);
  EXPECT_GT(inter_plain.load(), 3 * inter_int8.load());
}

// A single device sends nothing and counts nothing: counted is false (metrics: null).
TEST(StepWireUncounted, SingleDeviceReportsNotCounted) {
  auto model = torch::nn::Linear(8, 4);
  SingleDevice single(model.ptr());
  at::Tensor x = at::randn({5, 8});
  single.backward(single.forward([&] { return model->forward(x).square().mean(); }));
  EXPECT_FALSE(single.last_step_stats().wire.counted);
  EXPECT_EQ(single.last_step_stats().wire.total().total(), 0u);
}

}  // namespace
}  // namespace dtrain
