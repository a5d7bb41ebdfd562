// cnn_train: a small CNN with BatchNorm (or dtrain::SyncBatchNorm) trained on Fashion-MNIST
// single-device, with DataParallel or with FullyShardedDataParallel, reporting test accuracy:
// dtrain's path for vision models (docs/first-trainer.md walks through it).
//
//   cnn_train --strategy single
//   dtrain-run --nproc_per_node 2 -- cnn_train --strategy fsdp --sync_bn --checkpoint_dir ckpt
//
// Every rank trains on its own rows of each global batch (--global_batch, split evenly) of
// one shuffled order shared by all ranks (seeded by --seed and the epoch), so the runs see
// the same data whatever the world size. With --sync_bn the normalisation statistics are
// those of the global batch, so DDP and FSDP train exactly like one device on the global
// batch (tests/cnn_test.sh compares the losses); with plain BatchNorm each rank normalises
// by its own rows, which is what PyTorch's DDP does too.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "dtrain/checkpoint.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/rendezvous.h"
#include "dtrain/single_device.h"
#include "dtrain/sync_batch_norm.h"
#include "fashion_mnist.h"

ABSL_FLAG(std::string, strategy, "single", "single, ddp or fsdp (ranks from the launcher)");
ABSL_FLAG(bool, sync_bn, false,
          "replace every BatchNorm2d by dtrain::SyncBatchNorm: statistics of the global batch");
ABSL_FLAG(int, epochs, 2, "passes over the training images");
ABSL_FLAG(int, global_batch, 64, "images per optimizer step, split evenly over the ranks");
ABSL_FLAG(double, lr, 2e-3, "AdamW learning rate");
ABSL_FLAG(int64_t, train_limit, 0, "train on the first N training images (0: all 60,000)");
ABSL_FLAG(int64_t, test_limit, 0, "evaluate on the first N test images (0: all 10,000)");
ABSL_FLAG(std::string, data_dir, cnn::kDefaultFashionMnistDir,
          "Fashion-MNIST's IDX files (Debian: apt-get install dataset-fashion-mnist)");
ABSL_FLAG(int, seed, 0, "initial weights and the shuffling of every epoch");
ABSL_FLAG(int, log_every, 0, "print the global batch's loss every N steps (0: never)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "save a checkpoint there after every epoch, and resume from its newest one");
ABSL_FLAG(std::string, metrics_out, "",
          "append one JSON line per epoch: epoch, train_loss, test_accuracy, epoch_s, "
          "images_per_s, step_ms_median (the median step's wall time; rank 0)");
ABSL_FLAG(int, threads, 0, "intra-op threads per rank (0: the cores divided by the local ranks)");

namespace {

using ModulePtr = std::shared_ptr<torch::nn::SequentialImpl>;

// conv-BN-ReLU-pool twice, then a linear classifier: 20,586 parameters, 10 classes, in one
// flat Sequential (LibTorch's Sequential cannot hold another), so that FSDP can make its
// entries units and SyncBatchNorm can replace its BatchNorms.
ModulePtr make_model(int seed) {
  torch::manual_seed(seed);
  namespace nn = torch::nn;
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1)), nn::BatchNorm2d(16),
                        nn::ReLU(), nn::MaxPool2d(2),
                        nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1)), nn::BatchNorm2d(32),
                        nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(), nn::Linear(32 * 7 * 7, 10))
      .ptr();
}

std::shared_ptr<dtrain::Strategy> make_strategy(const std::string& kind, ModulePtr model,
                                                const dtrain::CommunicatorPtr& comm) {
  if (kind == "single") {
    if (comm->world_size() != 1)
      throw std::invalid_argument("--strategy single runs one process; use ddp or fsdp");
    return std::make_shared<dtrain::SingleDevice>(model);
  }
  if (kind == "ddp") return std::make_shared<dtrain::DataParallel>(model, comm);
  if (kind == "fsdp") {
    dtrain::FsdpOptions o;
    // The second convolution (4,640 parameters) and the classifier (15,690) are units; the
    // first convolution and the norms stay in the root unit.
    o.wrap_policy = dtrain::wrap_by_min_params(1000);
    return std::make_shared<dtrain::FullyShardedDataParallel>(model, comm, o);
  }
  throw std::invalid_argument(fmt::format("--strategy '{}': expected single, ddp or fsdp", kind));
}

double global_mean(const dtrain::CommunicatorPtr& comm, at::Tensor value) {
  value = value.detach().to(at::kDouble).reshape({1}).clone();
  if (comm->world_size() > 1) comm->all_reduce(value, dtrain::ReduceOp::kAvg)->wait();
  return value.item<double>();
}

// Accuracy over the test images: each rank classifies every world_size-th one, through the
// strategy (FSDP's parameters are sharded outside its forward), and the counts are summed.
double test_accuracy(dtrain::Strategy& strategy, torch::nn::SequentialImpl& model,
                     const cnn::Images& test, const dtrain::CommunicatorPtr& comm) {
  at::NoGradGuard no_grad;
  model.eval();
  const int64_t n = test.x.size(0);
  const at::Tensor mine =
      at::arange(comm->rank(), n, comm->world_size(), at::TensorOptions(at::kLong));
  double correct = 0, seen = 0;
  const int64_t batch = 500;
  // Every rank runs the same number of forwards (FSDP's gathers are collective): enough for
  // the rank with the most rows; the others' last batch may be empty.
  const int64_t most = (n + comm->world_size() - 1) / comm->world_size();
  const int64_t rounds = (most + batch - 1) / batch;
  for (int64_t r = 0; r < rounds; ++r) {
    const int64_t from = std::min<int64_t>(r * batch, mine.size(0));
    const at::Tensor rows = mine.narrow(0, from, std::min<int64_t>(batch, mine.size(0) - from));
    const at::Tensor x = test.x.index_select(0, rows);
    const at::Tensor logits = strategy.forward([&] { return model.forward(x); });
    correct += logits.argmax(1).eq(test.y.index_select(0, rows)).sum().item<double>();
    seen += static_cast<double>(rows.size(0));
  }
  at::Tensor counts = at::tensor({correct, seen}, at::TensorOptions(at::kDouble));
  if (comm->world_size() > 1) comm->all_reduce(counts)->wait();
  model.train();
  return counts[0].item<double>() / std::max(1.0, counts[1].item<double>());
}

int run() {
  const auto info = dtrain::LaunchInfo::from_env();
  const int threads = absl::GetFlag(FLAGS_threads);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(threads > 0 ? threads : std::max(1, cores / info.local_world_size));
  auto comm = dtrain::init_communicator(info);
  const int global_batch = absl::GetFlag(FLAGS_global_batch);
  if (global_batch < 1 || global_batch % comm->world_size() != 0) {
    throw std::invalid_argument(
        fmt::format("--global_batch {} must be a positive multiple of "
                    "the {} ranks",
                    global_batch, comm->world_size()));
  }
  const std::string dir = absl::GetFlag(FLAGS_data_dir);
  const cnn::Images train = cnn::load_fashion_mnist(dir, "train", absl::GetFlag(FLAGS_train_limit));
  const cnn::Images test = cnn::load_fashion_mnist(dir, "t10k", absl::GetFlag(FLAGS_test_limit));
  const int64_t steps_per_epoch = train.x.size(0) / global_batch;
  if (steps_per_epoch < 1)
    throw std::invalid_argument(fmt::format("{} training images make no global batch of {}",
                                            train.x.size(0), global_batch));

  ModulePtr model = make_model(absl::GetFlag(FLAGS_seed));
  if (absl::GetFlag(FLAGS_sync_bn)) dtrain::convert_sync_batch_norm(model, comm);
  auto strategy = make_strategy(absl::GetFlag(FLAGS_strategy), model, comm);
  torch::optim::AdamW opt(strategy->parameters(),
                          torch::optim::AdamWOptions(absl::GetFlag(FLAGS_lr)).weight_decay(0));

  int first_epoch = 0;
  const std::string ckpt_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  if (!ckpt_dir.empty()) {
    const std::string latest = dtrain::latest_checkpoint(ckpt_dir);
    if (!latest.empty()) {
      const dtrain::TrainingState state = dtrain::load_checkpoint(latest, *strategy, &opt);
      first_epoch = std::stoi(state.values.at("epoch"));
      if (comm->rank() == 0) fmt::print("resumed from {} (epoch {})\n", latest, first_epoch);
    }
  }

  const int local_batch = global_batch / comm->world_size();
  const int log_every = absl::GetFlag(FLAGS_log_every);
  const std::string metrics_out = absl::GetFlag(FLAGS_metrics_out);
  double accuracy = 0;
  for (int epoch = first_epoch; epoch < absl::GetFlag(FLAGS_epochs); ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    // One order for every rank and world size: the epoch's permutation of the training images.
    at::Generator gen = at::detail::createCPUGenerator(
        static_cast<uint64_t>(absl::GetFlag(FLAGS_seed)) * 1000003u + static_cast<uint64_t>(epoch));
    const at::Tensor order = at::randperm(train.x.size(0), gen, at::TensorOptions(at::kLong));
    double loss_sum = 0;
    std::vector<double> step_ms;  // each step's wall time, for a median robust to warm-up
    for (int64_t step = 0; step < steps_per_epoch; ++step) {
      const auto step_start = std::chrono::steady_clock::now();
      const at::Tensor rows =
          order.narrow(0, step * global_batch + comm->rank() * local_batch, local_batch);
      const at::Tensor x = train.x.index_select(0, rows);
      const at::Tensor y = train.y.index_select(0, rows);
      opt.zero_grad();
      const at::Tensor loss =
          strategy->forward([&] { return at::cross_entropy_loss(model->forward(x), y); });
      strategy->backward(loss);
      opt.step();
      const double global = global_mean(comm, loss);
      step_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start)
              .count());
      loss_sum += global;
      const int64_t global_step = epoch * steps_per_epoch + step;
      if (log_every > 0 && global_step % log_every == 0 && comm->rank() == 0)
        fmt::print("step {} loss {:.8f}\n", global_step, global);
    }
    const double epoch_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    accuracy = test_accuracy(*strategy, *model, test, comm);
    const double train_loss = loss_sum / static_cast<double>(steps_per_epoch);
    const double images_per_s =
        static_cast<double>(steps_per_epoch * global_batch) / std::max(epoch_s, 1e-9);
    std::nth_element(step_ms.begin(),
                     step_ms.begin() + static_cast<std::ptrdiff_t>(step_ms.size() / 2),
                     step_ms.end());
    const double step_ms_median = step_ms[step_ms.size() / 2];
    if (comm->rank() == 0) {
      fmt::print(
          "epoch {} train_loss {:.6f} test_accuracy {:.4f} epoch_s {:.2f} images/s {:.1f} "
          "step_ms_median {:.3f}\n",
          epoch, train_loss, accuracy, epoch_s, images_per_s, step_ms_median);
      if (!metrics_out.empty()) {
        std::ofstream out(metrics_out, std::ios::app);
        out << fmt::format(
            "{{\"strategy\":\"{}\",\"sync_bn\":{},\"world_size\":{},\"epoch\":{},"
            "\"train_loss\":{:.8f},\"test_accuracy\":{:.6f},\"epoch_s\":{:.4f},"
            "\"images_per_s\":{:.3f},\"step_ms_median\":{:.4f}}}\n",
            strategy->name(), absl::GetFlag(FLAGS_sync_bn), comm->world_size(), epoch, train_loss,
            accuracy, epoch_s, images_per_s, step_ms_median);
        if (!out) throw std::runtime_error(fmt::format("cannot write {}", metrics_out));
      }
    }
    if (!ckpt_dir.empty()) {
      dtrain::TrainingState state;
      state.step = (epoch + 1) * steps_per_epoch;
      state.values["epoch"] = std::to_string(epoch + 1);
      dtrain::save_checkpoint(ckpt_dir, *strategy, &opt, state);
    }
  }
  strategy->finish();
  if (comm->rank() == 0) fmt::print("final test_accuracy {:.4f}\n", accuracy);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cnn_train: %s\n", e.what());
    return 1;
  }
}
