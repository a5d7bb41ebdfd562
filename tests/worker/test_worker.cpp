// One rank of a multi-process test, started by the tests with posix_spawn.
//   dtrain_test_worker <scenario> <timeout_ms> [out_path]
// Scenarios: "collectives" (check a few collectives and exit), "loop" (all-reduce until
// something fails), "ddp" (train the test MLP with DataParallel on this rank's slice of
// the global batch and write the final parameters, raw fp32, to out_path),
// "checkpoint_writer" (out_path is a checkpoint directory: save steps 1 and 2 there; with
// DTRAIN_TEST_PAUSE_AT=<point> the save of step 2 creates out_path/../paused at that point
// and then waits to be killed), "sharded_checkpoint_writer" (the same through
// save_checkpoint under FSDP on every rank; DTRAIN_TEST_PAUSE_RANK picks the rank that
// stops, creating out_path/../paused.<rank>), "listen" (hold TCP port <timeout_ms> on every
// interface, accepting and never answering, for 30 s: a program other than the job's store on the
// master's port), "desync_size" (rank r all-reduces 1024 >> r floats: ranks disagree),
// "grad_scaler_*" and "autocast_*" (mixed precision, amp_scenarios.h), "fsdp_reshard_all" /
// "fsdp_reshard_host" (FSDP training with ReshardAfterForward kAll / kHost, hosts of
// LOCAL_WORLD_SIZE ranks; rank 0 writes the full parameters, raw fp32, to out_path),
// "store_set" (connect_store, set from_rank/<rank> to "alive", wait for every rank's
// from_rank/<r>, exit: a rank that leaves after the rendezvous).
// Exit codes: 0 ok, 3 dtrain::CommError, 4 dtrain::TimeoutError, 5 dtrain::DesyncError,
// 1 other.
#include <ATen/ATen.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "amp_scenarios.h"
#include "checkpoint_writer.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/rendezvous.h"
#include "strategy/training.h"

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

void collectives(dtrain::Communicator& c) {
  const int w = c.world_size();
  const int r = c.rank();
  at::Tensor t = at::full({1000}, static_cast<float>(r + 1));
  c.all_reduce(t)->wait();
  require(t.eq(w * (w + 1) / 2.0f).all().item<bool>(), "all_reduce");
  at::Tensor out = at::empty({w * 10}, at::kFloat);
  c.all_gather(out, at::full({10}, static_cast<float>(r)))->wait();
  for (int k = 0; k < w; ++k) require(out[k * 10].item<float>() == k, "all_gather");
  at::Tensor rs = at::empty({10}, at::kFloat);
  c.reduce_scatter(rs, at::arange(w * 10, at::kFloat))->wait();
  require(rs[0].item<float>() == static_cast<float>(w * r * 10), "reduce_scatter");
  at::Tensor b = at::full({5}, static_cast<float>(r));
  c.broadcast(b, w - 1)->wait();
  require(b[0].item<float>() == w - 1, "broadcast");
  c.barrier()->wait();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::cerr << "usage: dtrain_test_worker collectives|loop|ddp TIMEOUT_MS [OUT_PATH]\n";
    return 2;
  }
  const std::string scenario = argv[1];
  if (scenario == "listen") {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(argv[2])));
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 16) != 0) {
      std::perror("listen");
      return 1;
    }
    std::printf("listening\n");
    std::fflush(stdout);
    sleep(30);  // connections queue in the backlog; nothing is ever answered
    return 0;
  }
  if (scenario == "checkpoint_writer" && argc == 4) {
    const char* pause = std::getenv("DTRAIN_TEST_PAUSE_AT");
    return dtrain::testing::checkpoint_writer(argv[3], pause != nullptr ? pause : "");
  }
  dtrain::CommunicatorOptions o;
  o.timeout = std::chrono::milliseconds(std::stoi(argv[2]));
  try {
    if (scenario == "store_set") {  // meets the others, publishes a key and leaves
      auto info = dtrain::LaunchInfo::from_env();
      auto store = dtrain::connect_store(info, o.timeout);
      store->set("from_rank/" + std::to_string(info.rank), std::string("alive"));
      for (int r = 0; r < info.world_size; ++r)  // leaves once the others are done with it
        store->wait({"from_rank/" + std::to_string(r)}, o.timeout);
      std::printf("rank %d set\n", info.rank);
      return 0;
    }
    auto info = dtrain::LaunchInfo::from_env();
    // The FSDP resharding scenarios build a host group too, through the job's store.
    const bool reshard = scenario == "fsdp_reshard_all" || scenario == "fsdp_reshard_host";
    std::shared_ptr<dtrain::Store> store;
    dtrain::CommunicatorPtr comm;
    if (reshard && info.world_size > 1) {
      info.validate();
      store = dtrain::connect_store(info, info.communicator_options(o).timeout);
      comm = dtrain::make_communicator(store, info.rank, info.world_size,
                                       info.communicator_options(o));
    } else {
      comm = dtrain::init_communicator(info, o);
    }
    if (argc == 4 && dtrain::testing::run_amp_scenario(scenario, comm, argv[3])) {
      // grad_scaler_* and autocast_*: tests/worker/amp_scenarios.h
    } else if (scenario == "collectives") {
      collectives(*comm);
    } else if (scenario == "desync_size") {
      at::Tensor t = at::ones({1024 >> info.rank});
      comm->all_reduce(t)->wait();
    } else if (scenario == "ddp" && argc == 4) {
      using namespace dtrain::testing;
      at::set_num_threads(1);
      const Case c;  // MLP, SGD with momentum, default buckets
      const auto data = make_data(c.model, info.world_size);
      auto module = make_model(c.model, info.rank == 0 ? 7 : 100 + info.rank);
      dtrain::DataParallel ddp(module, comm);
      train(c, ddp, *module, data, info.rank * kLocalBatch, kLocalBatch, &ddp);
      std::FILE* f = std::fopen(argv[3], "wb");
      if (f == nullptr) throw std::runtime_error(std::string("cannot write ") + argv[3]);
      for (const auto& p : module->parameters()) {
        at::Tensor t = p.detach().contiguous();
        std::fwrite(t.data_ptr<float>(), sizeof(float), static_cast<size_t>(t.numel()), f);
      }
      std::fclose(f);
    } else if (reshard && argc == 4) {
      // FULL_SHARD over the job, hosts of LOCAL_WORLD_SIZE ranks; rank 0 writes the full
      // parameters (raw fp32, module order) after training.
      using namespace dtrain::testing;
      at::set_num_threads(1);
      Case c;
      c.model = Model::kTransformer;
      c.opt = Opt::kAdamW;
      const auto data = make_data(c.model, info.world_size);
      auto module = make_model(c.model, 7);
      dtrain::FsdpOptions fo;
      fo.wrap_policy = dtrain::wrap_modules_named("BlockImpl");
      if (scenario == "fsdp_reshard_host" && store) {
        fo.reshard_after_forward = dtrain::ReshardAfterForward::kHost;
        fo.host_group = dtrain::make_host_group(
            store, info.rank, info.world_size, info.local_world_size, info.communicator_options(o));
      }
      dtrain::FullyShardedDataParallel fsdp(module, comm, fo);
      train(c, fsdp, *module, data, info.rank * kLocalBatch, kLocalBatch, &fsdp);
      const auto state = fsdp.full_state_dict();
      if (info.rank == 0) {
        std::FILE* f = std::fopen(argv[3], "wb");
        if (f == nullptr) throw std::runtime_error(std::string("cannot write ") + argv[3]);
        for (const auto& [name, t] : state) {
          const at::Tensor v = t.detach().to(at::kFloat).contiguous();
          std::fwrite(v.data_ptr<float>(), sizeof(float), static_cast<size_t>(v.numel()), f);
        }
        std::fclose(f);
      }
    } else if (scenario == "sharded_checkpoint_writer" && argc == 4) {
      const char* pause = std::getenv("DTRAIN_TEST_PAUSE_AT");
      const char* pause_rank = std::getenv("DTRAIN_TEST_PAUSE_RANK");
      dtrain::testing::sharded_checkpoint_writer(comm, argv[3], pause != nullptr ? pause : "",
                                                 pause_rank != nullptr ? std::stoi(pause_rank) : 0);
    } else if (scenario == "loop") {
      at::Tensor t = at::ones({4096});
      for (long i = 0;; ++i) {
        comm->all_reduce(t)->wait();
        if (i == 10) std::printf("looping\n"), std::fflush(stdout);
      }
    }
    std::printf("rank %d ok\n", info.rank);
    return 0;
  } catch (const dtrain::DesyncError& e) {
    std::printf("DesyncError: %s\n", e.what());
    return 5;
  } catch (const dtrain::TimeoutError& e) {
    std::printf("TimeoutError: %s\n", e.what());
    return 4;
  } catch (const dtrain::CommError& e) {
    std::printf("CommError: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
}
