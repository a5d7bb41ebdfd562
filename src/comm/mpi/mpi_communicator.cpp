#include "comm/mpi/mpi_communicator.h"

#include <fmt/format.h>

#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "comm/backend_factory.h"
#include "comm/front_end.h"
#include "comm/mpi/mpi_engine.h"
#include "dtrain/mpi.h"

namespace dtrain::mpi_backend {
namespace {

struct WorldPlace {
  int rank = -1;  // in MPI_COMM_WORLD
  int size = 0;   // of MPI_COMM_WORLD
};

// Every dtrain rank's place in MPI_COMM_WORLD, through the store, in dtrain's rank order.
std::vector<WorldPlace> exchange_places(Store& store, int rank, int world, const WorldPlace& mine,
                                        const CommunicatorOptions& options,
                                        const ErrorContext& ctx) {
  const std::string prefix = fmt::format("dtrain/mpi/{}/place/", options.name);
  const std::string text = fmt::format("{} {}", mine.rank, mine.size);
  store.set(prefix + std::to_string(rank), Bytes(text.begin(), text.end()));
  std::vector<WorldPlace> places;
  for (int r = 0; r < world; ++r) {
    Bytes b;
    try {
      b = store.get(prefix + std::to_string(r), options.timeout);
    } catch (const TimeoutError&) {
      throw TimeoutError(ctx, fmt::format("not every rank joined within {} ms (rank {} did not)",
                                          options.timeout.count(), r));
    }
    WorldPlace p;
    if (std::sscanf(std::string(b.begin(), b.end()).c_str(), "%d %d", &p.rank, &p.size) != 2) {
      throw CommError(ctx, fmt::format("rank {} published a malformed MPI place", r));
    }
    places.push_back(p);
  }
  return places;
}

// Throws InvalidArgument unless the places are distinct processes of one MPI job.
void check_one_job(const std::vector<WorldPlace>& places, const ErrorContext& ctx) {
  std::map<int, int> owner;  // MPI rank -> dtrain rank
  for (int r = 0; r < static_cast<int>(places.size()); ++r) {
    const WorldPlace& p = places[static_cast<size_t>(r)];
    const auto [it, fresh] = owner.emplace(p.rank, r);
    if (p.size != places[0].size || !fresh) {
      throw InvalidArgument(
          ctx, fmt::format("Backend::kMpi needs every rank to be a process of one MPI job, but "
                           "rank {} is MPI rank {} of {} and rank {} is MPI rank {} of {}: start "
                           "the job with an MPI launcher (mpirun, srun --mpi=pmix), not "
                           "dtrain-run or torchrun",
                           fresh ? 0 : it->second, places[fresh ? 0 : it->second].rank,
                           places[fresh ? 0 : it->second].size, r, p.rank, p.size));
    }
  }
}

}  // namespace

std::unique_ptr<detail::CollectiveEngine> make_mpi_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure, const ErrorContext& ctx) {
  auto runtime = Runtime::get(/*may_initialize=*/true, ctx);
  WorldPlace mine;
  {
    std::lock_guard<std::mutex> mpi(runtime->mpi_lock());
    MPI_Comm_rank(MPI_COMM_WORLD, &mine.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &mine.size);
  }
  const std::vector<WorldPlace> places =
      exchange_places(*store, rank, world_size, mine, options, ctx);
  check_one_job(places, ctx);
  std::vector<int> members;
  for (const WorldPlace& p : places) members.push_back(p.rank);
  MPI_Comm comm = MPI_COMM_NULL;
  int rc = MPI_SUCCESS;
  std::unique_lock<std::mutex> mpi(runtime->mpi_lock());
  if (world_size == places[0].size) {
    // The whole job: MPI_COMM_WORLD reordered by dtrain rank (every process is here).
    rc = MPI_Comm_split(MPI_COMM_WORLD, 0, rank, &comm);
  } else {
    // Some of the job's ranks: collective over them only (all have published their place, so
    // all are here); the tag keeps groups made at once by overlapping processes apart.
    const int tag = static_cast<int>(std::hash<std::string>{}(options.name) & 0x7fff);
    MPI_Group world_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, world_size, members.data(), &group);
    rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &comm);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
  }
  mpi.unlock();
  if (rc != MPI_SUCCESS) throw CommError(ctx, "creating the communicator: " + error_string(rc));
  return make_mpi_engine(std::move(runtime), comm, options, std::move(failure), ctx);
}

}  // namespace dtrain::mpi_backend

namespace dtrain {

CommunicatorPtr init_communicator(MPI_Comm comm, const CommunicatorOptions& options) {
  ErrorContext ctx{-1, -1, "init_communicator(MPI_Comm)", -1};
  if (comm == MPI_COMM_NULL) {
    throw InvalidArgument(ctx,
                          "comm is MPI_COMM_NULL: only the processes in the group call "
                          "init_communicator");
  }
  CommunicatorOptions o = options;
  o.backend = Backend::kMpi;
  detail::check_options(o, ctx);
  auto runtime = mpi_backend::Runtime::get(/*may_initialize=*/false, ctx);
  MPI_Comm own = MPI_COMM_NULL;
  {
    std::lock_guard<std::mutex> mpi(runtime->mpi_lock());
    MPI_Comm_rank(comm, &ctx.rank);
    MPI_Comm_size(comm, &ctx.world_size);
    const int rc = MPI_Comm_dup(comm, &own);
    if (rc != MPI_SUCCESS) {
      throw CommError(ctx, fmt::format("MPI_Comm_dup: {}", mpi_backend::error_string(rc)));
    }
  }
  auto failure = std::make_shared<detail::StickyFailure>();
  auto engine = detail::on_device(mpi_backend::make_mpi_engine(runtime, own, o, failure, ctx), o,
                                  ctx.rank, failure, ctx);
  return std::make_shared<detail::FrontEnd>(ctx.rank, ctx.world_size, o, std::move(failure),
                                            std::move(engine), nullptr);
}

}  // namespace dtrain
