// The consistency check of one collective over NCCL (the same CallHeader and the same verdict,
// detail::find_mismatch, as the Gloo backend's gloo/header_exchange.h): before a collective's
// data moves, the ranks all-gather their 80-byte headers and compare them, so that a desync is
// a DesyncError naming both sides instead of a hang ended by the watchdog's timeout.
//
// Cost: the headers go over a second NCCL communicator with its own stream, which does not
// wait for the caller's kernels; the host blocks only until every rank has issued the same
// call (the header round trip, tens of microseconds on one host), as Gloo's exchange does, not
// until the GPU has finished earlier work. Skipped at world size 1, where nothing can differ.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <vector>

#include "comm/call_header.h"
#include "comm/nccl/nccl_util.h"

namespace dtrain::nccl_backend {

class HeaderExchange {
 public:
  // Joins the ranks that use `id` on `device`; throws like NcclComm's constructor.
  HeaderExchange(const ncclUniqueId& id, int rank, int world_size, int device,
                 Clock::time_point join_deadline);
  ~HeaderExchange();
  HeaderExchange(const HeaderExchange&) = delete;
  HeaderExchange& operator=(const HeaderExchange&) = delete;

  // Exchanges `mine` and compares. Throws DesyncError when ranks disagree, TimeoutError when
  // not every rank issued the call within `timeout` (the exchange is then aborted and every
  // later run throws CommError), CommError for CUDA or NCCL failures. The caller serialises
  // runs (NcclComm's launch lock).
  void run(const detail::CallHeader& mine, std::chrono::milliseconds timeout,
           const ErrorContext& ctx);

 private:
  struct PinnedDeleter {
    void operator()(void* p) const { (void)cudaFreeHost(p); }
  };

  const int rank_;
  const int world_size_;
  const int device_;
  Stream stream_;
  Event done_;
  DeviceMemory device_headers_;                        // world_size headers
  std::unique_ptr<void, PinnedDeleter> host_headers_;  // pinned, world_size headers
  ncclComm_t comm_ = nullptr;                          // null once aborted
};

}  // namespace dtrain::nccl_backend
