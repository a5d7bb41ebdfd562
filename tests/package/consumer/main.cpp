// Built against an installed dtrain by the package test, with the public API only, and run by
// the installed dtrain-run on two ranks: trains a small model under FullyShardedDataParallel
// and DataParallel, each rank on its own rows of one global batch, and checks that the loss
// over the global batch falls and that both strategies reach the same parameters.
#include <ATen/ATen.h>
#include <dtrain/config.h>
#include <dtrain/data_parallel.h>
#include <dtrain/fsdp.h>
#include <dtrain/rendezvous.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdio>
#include <memory>

namespace {

constexpr int kSteps = 20;
constexpr int64_t kGlobalRows = 8;

std::shared_ptr<torch::nn::SequentialImpl> make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(4, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 1))
      .ptr();
}

// Trains with `strategy` on this rank's rows; returns the first and last global-batch loss.
std::pair<double, double> train(dtrain::Strategy& strategy, torch::nn::SequentialImpl& model,
                                dtrain::Communicator& comm) {
  torch::manual_seed(1);
  const at::Tensor x = at::randn({kGlobalRows, 4});
  const at::Tensor y = x.sum(1, /*keepdim=*/true).sin();
  const int64_t rows = kGlobalRows / comm.world_size();
  const at::Tensor mx = x.narrow(0, comm.rank() * rows, rows);
  const at::Tensor my = y.narrow(0, comm.rank() * rows, rows);
  torch::optim::SGD opt(strategy.parameters(), torch::optim::SGDOptions(0.2));
  double first = 0, last = 0;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    at::Tensor loss = strategy.forward([&] { return at::mse_loss(model.forward(mx), my); });
    strategy.backward(loss);
    opt.step();
    at::Tensor global = loss.detach().clone();
    comm.all_reduce(global, dtrain::ReduceOp::kAvg)->wait();
    (s == 0 ? first : last) = global.item<double>();
  }
  strategy.finish();
  return {first, last};
}

}  // namespace

int main() {
  auto comm = dtrain::init_communicator(dtrain::LaunchInfo::from_env());
  auto fsdp_model = make_model();
  dtrain::FullyShardedDataParallel fsdp(fsdp_model, comm);
  const auto [f0, f1] = train(fsdp, *fsdp_model, *comm);
  const auto full = fsdp.full_state_dict();  // rank 0 only

  auto ddp_model = make_model();
  dtrain::DataParallel ddp(ddp_model, comm);
  const auto [d0, d1] = train(ddp, *ddp_model, *comm);

  int bad = !(f1 < 0.5 * f0) || !(d1 < 0.5 * d0);
  if (comm->rank() == 0) {
    for (const auto& [name, value] : full) {
      const at::Tensor& mine = ddp_model->named_parameters()[name];
      if (!at::allclose(value, mine, 1e-4, 1e-5)) {
        std::printf("parameter %s differs between FSDP and DDP\n", name.c_str());
        bad = 1;
      }
    }
  }
  std::printf("dtrain %s, rank %d of %d: FSDP loss %.4f -> %.4f, DDP loss %.4f -> %.4f\n",
              DTRAIN_VERSION, comm->rank(), comm->world_size(), f0, f1, d0, d1);
  return bad;
}
