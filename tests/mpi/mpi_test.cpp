// The MPI backend, ranks as the processes of a real mpirun (tests/CMakeLists.txt runs this
// program under `mpirun -np N` in several set-ups, chosen by --mpi_owner):
//   app_multiple  the application initializes MPI at MPI_THREAD_MULTIPLE and hands dtrain
//                 MPI_COMM_WORLD (init_communicator(MPI_Comm)): conformance in both progress
//                 modes, failures, DDP and FSDP against one device, in-situ training on half
//                 of the job while the other half does its own MPI work;
//   app_funneled  MPI_THREAD_FUNNELED: the caller mode, the refusals a lower level brings;
//   dtrain        nothing initializes MPI but dtrain: Backend::kMpi through LaunchInfo and the
//                 store, as gpt2_train --backend mpi runs, and groups of some of the ranks.
// Every check is against values computed here (support/collective_matrix.h) or against
// single-device training of the same global batch (strategy/training.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/mpi.h"
#include "dtrain/rendezvous.h"
#include "strategy/fsdp_ranks.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/collective_matrix.h"
#include "support/expected_values.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// The set-up this process runs (main sets it from --mpi_owner).
std::string& owner() {
  static std::string value = "app_multiple";
  return value;
}

bool app_owns() { return owner() != "dtrain"; }

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

CommunicatorOptions with(MpiProgress progress,
                         std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  CommunicatorOptions o;
  o.mpi_progress = progress;
  o.timeout = timeout;
  return o;
}

// The communicator of this set-up over every process of the job.
CommunicatorPtr world_comm(MpiProgress progress = MpiProgress::kAuto,
                           std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  if (app_owns()) return init_communicator(MPI_COMM_WORLD, with(progress, timeout));
  CommunicatorOptions o = with(progress, timeout);
  o.backend = Backend::kMpi;
  return init_communicator(LaunchInfo::from_env(), o);
}

class MpiCollectives : public ::testing::TestWithParam<MpiProgress> {
 protected:
  void SetUp() override {
    if (!app_owns()) GTEST_SKIP() << "the application's MPI";
    if (owner() == "app_funneled" && GetParam() == MpiProgress::kThread) {
      GTEST_SKIP() << "no dtrain thread at MPI_THREAD_FUNNELED (MpiRefusals)";
    }
  }
};

TEST_P(MpiCollectives, EveryOpDtypeAndSize) {
  auto comm = world_comm(GetParam());
  EXPECT_EQ(comm->backend(), Backend::kMpi);
  EXPECT_STREQ(comm->transport_name(), "mpi");
  EXPECT_EQ(comm->rank(), world_rank());
  run_collective_matrix(*comm, "mpi");
}

TEST_P(MpiCollectives, SendRecvRingWithTags) {
  auto comm = world_comm(GetParam());
  const int world = comm->world_size();
  if (world == 1) GTEST_SKIP() << "send/recv needs a peer";
  const int right = (comm->rank() + 1) % world;
  const int left = (comm->rank() - 1 + world) % world;
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{1 << 20}}) {
    // Two tags in flight at once, received in the opposite order.
    at::Tensor a = make_input(at::kFloat, n, comm->rank());
    at::Tensor b = make_input(at::kFloat, n, comm->rank(), 5);
    at::Tensor got_a = at::zeros({n}, at::kFloat), got_b = at::zeros({n}, at::kFloat);
    auto sa = comm->send(a, right, 7);
    auto sb = comm->send(b, right, 8);
    auto rb = comm->recv(got_b, left, 8);
    auto ra = comm->recv(got_a, left, 7);
    for (auto& w : {sa, sb, rb, ra}) w->wait();
    expect_values(
        got_a, [&](int64_t i) { return value(left, i); },
        label("recv tag 7", at::kFloat, n, comm->rank()));
    expect_values(
        got_b, [&](int64_t i) { return value(left, i + 5); },
        label("recv tag 8", at::kFloat, n, comm->rank()));
  }
}

TEST_P(MpiCollectives, AsyncCallsCompleteInIssueOrderWithSameSequenceOnEveryRank) {
  auto comm = world_comm(GetParam());
  const int world = comm->world_size();
  std::vector<at::Tensor> ts;
  std::vector<WorkPtr> works;
  for (int k = 0; k < 6; ++k) {
    ts.push_back(make_input(at::kFloat, 4096 + k, comm->rank()));
    works.push_back(comm->all_reduce(ts.back()));
  }
  for (int k = 5; k >= 0; --k) works[k]->wait();  // reverse order: no deadlock
  for (int k = 0; k < 6; ++k) {
    ASSERT_TRUE(works[k]->is_completed() && works[k]->exception() == nullptr) << k;
    expect_values(
        ts[k], [&](int64_t i) { return reduce_expected(ReduceOp::kSum, world, i); },
        "async all_reduce " + std::to_string(k));
    if (k > 0) {
      EXPECT_EQ(works[k]->sequence_number(), works[k - 1]->sequence_number() + 1);
    }
  }
  at::Tensor seqs = at::empty({6 * world}, at::kLong);
  at::Tensor mine = at::empty({6}, at::kLong);
  for (int k = 0; k < 6; ++k) mine[k] = static_cast<int64_t>(works[k]->sequence_number());
  comm->all_gather(seqs, mine)->wait();
  for (int r = 1; r < world; ++r) {
    EXPECT_TRUE(at::equal(seqs.narrow(0, 0, 6), seqs.narrow(0, 6 * r, 6))) << "rank " << r;
  }
}

TEST_P(MpiCollectives, BarrierWaitsForTheSlowestRank) {
  auto comm = world_comm(GetParam());
  if (comm->world_size() == 1) GTEST_SKIP() << "nothing to wait for";
  if (comm->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto start = std::chrono::steady_clock::now();
  comm->barrier()->wait();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (comm->rank() != 0) {
    EXPECT_GT(waited, 0.2);
  }
}

TEST_P(MpiCollectives, RanksThatDisagreeAllThrowDesyncErrorAndTheErrorSticks) {
  auto comm = world_comm(GetParam());
  if (comm->world_size() == 1) GTEST_SKIP() << "one rank agrees with itself";
  at::Tensor t = at::ones({1024 >> comm->rank()});
  try {
    comm->all_reduce(t)->wait();
    FAIL() << "no DesyncError";
  } catch (const DesyncError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("all_reduce"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 0"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
    EXPECT_EQ(e.context().rank, comm->rank());
  }
  EXPECT_TRUE(t.eq(1).all().item<bool>()) << "data moved although ranks disagreed";
  EXPECT_THROW(comm->barrier()->wait(), CommError);
}

TEST_P(MpiCollectives, ARankThatNeverCallsMakesTheOthersTimeOutNamingTheCall) {
  auto comm = world_comm(GetParam(), std::chrono::milliseconds(800));
  if (comm->world_size() == 1) GTEST_SKIP() << "nobody to wait for";
  comm->barrier()->wait();
  if (comm->rank() != 0) {
    at::Tensor t = at::ones({16});
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->all_reduce(t)->wait();
      FAIL() << "no TimeoutError";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("all_reduce"), std::string::npos) << what;
      EXPECT_NE(what.find("800 ms"), std::string::npos) << what;
      EXPECT_EQ(e.context().sequence, 1);
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5);
    EXPECT_THROW(comm->barrier()->wait(), CommError);  // broken: refused at once
  }
  // Rank 0 never issues the all-reduce; the others' calls stay with MPI. The job goes on.
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_P(MpiCollectives, BadArgumentsThrowInvalidArgumentNamingRankAndOp) {
  auto comm = world_comm(GetParam());
  try {
    comm->all_reduce(at::ones({4}, at::kBool));
    FAIL() << "bool accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce"), std::string::npos) << e.what();
    EXPECT_EQ(e.context().rank, comm->rank());
  }
  if (comm->world_size() > 1) {
    const int peer = (comm->rank() + 1) % comm->world_size();
    EXPECT_THROW(comm->send(at::ones({4}), peer, 0xffffffffu), InvalidArgument);
  }
  // Refused calls use no sequence number: the ranks still agree.
  comm->barrier()->wait();
}

INSTANTIATE_TEST_SUITE_P(Progress, MpiCollectives,
                         ::testing::Values(MpiProgress::kThread, MpiProgress::kCaller),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// What a thread level below MPI_THREAD_MULTIPLE refuses, by its name.
TEST(MpiRefusals, ThreadLevelBelowMultiple) {
  if (owner() != "app_funneled") GTEST_SKIP() << "MPI_THREAD_FUNNELED only";
  try {
    init_communicator(MPI_COMM_WORLD, with(MpiProgress::kThread));
    FAIL() << "kThread accepted at MPI_THREAD_FUNNELED";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("MPI_THREAD_FUNNELED"), std::string::npos) << e.what();
  }
  auto comm = init_communicator(MPI_COMM_WORLD);  // kAuto: the caller drives
  std::string error;
  std::thread([&] {
    try {
      comm->barrier();
    } catch (const InvalidArgument& e) {
      error = e.what();
    }
  }).join();
  EXPECT_NE(error.find("thread that initialized MPI"), std::string::npos) << error;
  comm->barrier()->wait();
}

TEST(MpiRefusals, NullCommunicator) {
  if (!app_owns()) GTEST_SKIP() << "the application's MPI";
  EXPECT_THROW(init_communicator(MPI_COMM_NULL), InvalidArgument);
}

// DDP and FSDP over MPI against single-device training on the same global batch, as for
// Gloo (strategy/multiprocess_test.cpp, fsdp_test.cpp).
void expect_ddp_matches_single_device(Communicator& comm, Case c) {
  const int world = comm.world_size();
  const int r = comm.rank();
  const auto data = make_data(c.model, world);
  auto ref = single_device_reference(c, data, world);
  auto module = make_model(c.model, r == 0 ? 7 : 100 + r);
  DataParallel ddp(module, std::shared_ptr<Communicator>(&comm, [](Communicator*) {}),
                   ddp_options(c));
  train(c, ddp, *module, data, r * kLocalBatch, kLocalBatch, &ddp);
  expect_same_parameters(*ref, *module, r, c.rtol, c.atol);
}

void expect_fsdp_matches_single_device(Communicator& comm, Case c, ShardingStrategy sharding) {
  const int world = comm.world_size();
  const int r = comm.rank();
  const auto data = make_data(c.model, world);
  auto ref = single_device_reference(c, data, world);
  auto module = make_model(c.model, r == 0 ? 7 : 100 + r);
  FsdpOptions o;
  o.sharding = sharding;
  o.wrap_policy = wrap_modules_named("BlockImpl");
  FullyShardedDataParallel fsdp(module, std::shared_ptr<Communicator>(&comm, [](Communicator*) {}),
                                o);
  train(c, fsdp, *module, data, r * kLocalBatch, kLocalBatch, &fsdp);
  auto state = fsdp.full_state_dict();
  if (r == 0) expect_state_matches(state, *ref, 1e-5, 1e-6);
}

Case transformer_adamw() {
  Case c;
  c.model = Model::kTransformer;
  c.opt = Opt::kAdamW;
  return c;
}

TEST(MpiStrategies, DataParallelMatchesSingleDevice) {
  at::set_num_threads(1);
  auto comm = world_comm();
  expect_ddp_matches_single_device(*comm, Case{});
  expect_ddp_matches_single_device(*comm, transformer_adamw());
  // Accumulation with a parameter used only in the no_sync micro-batch (issue 42's case).
  Case acc;
  acc.accumulate = true;
  acc.extra_in_first_micro_batch_only = true;
  acc.find_unused = true;
  acc.set_to_none = true;
  expect_ddp_matches_single_device(*comm, acc);
}

TEST(MpiStrategies, FullyShardedMatchesSingleDevice) {
  at::set_num_threads(1);
  auto comm = world_comm();
  expect_fsdp_matches_single_device(*comm, transformer_adamw(), ShardingStrategy::kFullShard);
  expect_fsdp_matches_single_device(*comm, transformer_adamw(), ShardingStrategy::kShardGradOp);
}

// In-situ: the even ranks of the job train through dtrain on their half of MPI_COMM_WORLD
// while the odd ranks run their own MPI reductions on theirs; at the end both halves meet on
// MPI_COMM_WORLD, so a dtrain call that strayed onto the application's communicators would
// have hung or corrupted one of them.
TEST(MpiInSitu, HalfTheJobTrainsWhileTheOtherHalfDoesItsOwnMpiWork) {
  if (!app_owns()) GTEST_SKIP() << "the application's MPI";
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world < 4) GTEST_SKIP() << "needs 4 processes, has " << world;
  at::set_num_threads(1);
  const int me = world_rank();
  MPI_Comm half = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, me % 2, me, &half);
  int half_size = 0;
  MPI_Comm_size(half, &half_size);
  double simulated = 0;
  if (me % 2 == 0) {
    auto comm = init_communicator(half);
    EXPECT_EQ(comm->world_size(), half_size);
    expect_ddp_matches_single_device(*comm, transformer_adamw());
    expect_fsdp_matches_single_device(*comm, transformer_adamw(), ShardingStrategy::kFullShard);
  } else {
    // The "simulation": its own reductions on its own communicator, many small steps.
    for (int step = 0; step < 200; ++step) {
      double x = me + step, sum = 0;
      MPI_Allreduce(&x, &sum, 1, MPI_DOUBLE, MPI_SUM, half);
      simulated += sum;
    }
    double want = 0;
    for (int step = 0; step < 200; ++step) {
      for (int r = 1; r < world; r += 2) want += r + step;
    }
    EXPECT_EQ(simulated, want);
  }
  int ok = ::testing::Test::HasFailure() ? 0 : 1, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  EXPECT_EQ(all_ok, 1) << "a rank of the other half failed";
  MPI_Comm_free(&half);
}

// Backend::kMpi with dtrain owning MPI: LaunchInfo from mpirun's variables, the store for
// the rank order, the matrix on small sizes; then groups of some ranks (as make_host_group
// and make_hybrid_groups make them) beside the world's communicator.
TEST(MpiOwnedByDtrain, WorldAndGroupsOfSomeRanks) {
  if (app_owns()) GTEST_SKIP() << "dtrain's own MPI";
  const LaunchInfo info = LaunchInfo::from_env();
  ASSERT_EQ(info.source, LaunchSource::kOpenMpi);
  CommunicatorOptions o;
  o.backend = Backend::kMpi;
  auto store = connect_store(info);
  auto comm = make_communicator(store, info.rank, info.world_size, o);
  EXPECT_STREQ(comm->transport_name(), "mpi");
  run_collective_matrix(*comm, "mpi", {0, 1, 7, 1001});
  if (info.world_size < 2) return;
  // Pairs {0,1}, {2,3}, ... numbered within the pair in reverse, so rank order differs from
  // MPI's.
  const int pair = info.rank / 2;
  const int pair_size = std::min(2, info.world_size - pair * 2);
  CommunicatorOptions g = o;
  g.name = "pair" + std::to_string(pair);
  auto group = make_communicator(store, pair_size - 1 - info.rank % 2, pair_size, g);
  at::Tensor t = at::full({3}, static_cast<float>(info.rank));
  auto w1 = group->all_reduce(t);
  at::Tensor u = at::full({5}, 1.0f);
  auto w2 = comm->all_reduce(u);  // the world's communicator, interleaved
  w1->wait();
  w2->wait();
  const float want =
      pair_size == 2 ? static_cast<float>(4 * pair + 1) : static_cast<float>(info.rank);
  EXPECT_TRUE(t.eq(want).all().item<bool>()) << t;
  EXPECT_TRUE(u.eq(info.world_size).all().item<bool>()) << u;
  at::Tensor ranks = at::empty({pair_size}, at::kLong);
  group->all_gather(ranks, at::full({1}, static_cast<int64_t>(info.rank), at::kLong))->wait();
  if (pair_size == 2) {
    // Group rank 0 is the pair's second process.
    EXPECT_EQ(ranks[0].item<int64_t>(), 2 * pair + 1);
    EXPECT_EQ(ranks[1].item<int64_t>(), 2 * pair);
  }
}

}  // namespace
}  // namespace dtrain

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--mpi_owner=", 0) == 0) dtrain::owner() = arg.substr(12);
  }
  const std::string& owner = dtrain::owner();
  if (owner != "app_multiple" && owner != "app_funneled" && owner != "dtrain") {
    std::fprintf(stderr, "--mpi_owner must be app_multiple, app_funneled or dtrain\n");
    return 2;
  }
  if (owner != "dtrain") {
    const int want = owner == "app_multiple" ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED;
    int provided = 0;
    MPI_Init_thread(&argc, &argv, want, &provided);
    if (provided != want) {
      std::fprintf(stderr, "MPI provides thread level %d, not %d\n", provided, want);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  const int rc = RUN_ALL_TESTS();
  if (owner != "dtrain") MPI_Finalize();
  return rc;
}
