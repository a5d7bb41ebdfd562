// Built against an installed dtrain by the package test: uses the public API only.
#include <ATen/ATen.h>
#include <dtrain/dtrain.h>

#include <cstdio>

int main() {
  auto comm = dtrain::init_communicator(dtrain::LaunchInfo{});
  at::Tensor t = at::ones({4});
  comm->all_reduce(t, dtrain::ReduceOp::kSum)->wait();
  std::printf("dtrain %s, world %d, sum %.1f\n", DTRAIN_VERSION, comm->world_size(),
              t.sum().item<float>());
  return t.sum().item<float>() == 4.0f ? 0 : 1;
}
