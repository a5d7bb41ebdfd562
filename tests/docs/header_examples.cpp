// The code examples of the public headers' comments and of README.md, each copied line for
// line into a `// clang-format off` region here, with the declarations it assumes around it:
// an example that stops compiling fails dtrain_tests' build, and one edited in its header
// but not here fails scripts.header_examples (scripts/check-header-examples.py). Compiled,
// never run: they need ranks, files and models. README's complete program is built and run
// by package.find_package_consumer instead.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <dtrain/dtrain.h>
#if DTRAIN_HAS_MPI
#include "dtrain/mpi.h"
#endif

// include/dtrain/fsdp.h: UnitOutput is specialized from a namespace that encloses dtrain.
// clang-format off
struct EncoderOut { at::Tensor hidden; at::Tensor attention; int64_t layers; };
template <>
struct dtrain::UnitOutput<EncoderOut> {
  template <typename F>
  static void for_each_tensor(const EncoderOut& o, F&& f) { f(o.hidden); f(o.attention); }
};
// clang-format on

// Named, not anonymous: the functions are never called, and must not warn for it.
namespace dtrain_header_examples {

// What the examples assume: a model, its loss, a loader of batches.
using Model = std::shared_ptr<torch::nn::LinearImpl>;
struct Batch {
  at::Tensor x, y;
};
using Loader = std::vector<Batch>;
at::Tensor loss_fn(const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); }

// ---- include/dtrain/strategy.h ----

void strategy_loop(Model model, dtrain::CommunicatorPtr comm, torch::optim::AdamWOptions options,
                   Loader& loader) {
  // clang-format off
  // or SingleDevice, FullyShardedDataParallel:
  auto strategy = std::make_shared<dtrain::DataParallel>(model, comm);
  torch::optim::AdamW opt(strategy->parameters(), options);  // not model->parameters()
  for (auto& batch : loader) {
    opt.zero_grad();
    at::Tensor loss = strategy->forward([&] { return loss_fn(model->forward(batch.x), batch.y); });
    strategy->backward(loss);       // gradients are reduced when this returns
    strategy->clip_grad_norm(1.0);  // global norm, whatever the sharding
    opt.step();                     // steps what parameters() returned
  }
  strategy->finish();  // every rank, after its last batch: uneven data is an error
  // clang-format on
}

void strategy_param_groups(std::shared_ptr<dtrain::Strategy> strategy, torch::optim::AdamWOptions o,
                           torch::optim::AdamWOptions no_decay_options) {
  // clang-format off
  std::vector<at::Tensor> decay, no_decay;
  for (auto& p : strategy->named_parameters()) {
    (p.shape.size() >= 2 ? decay : no_decay).push_back(p.tensor);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay);
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(no_decay_options));
  torch::optim::AdamW opt(std::move(groups), o);
  // clang-format on
}

void strategy_accumulation(std::shared_ptr<dtrain::Strategy> strategy, int n,
                           const std::vector<at::Tensor>& micro,
                           const std::function<at::Tensor(const at::Tensor&)>& loss_of,
                           const at::Tensor& first_micro_batch_loss) {
  // clang-format off
  for (int m = 0; m < n; ++m) {
    strategy->set_requires_gradient_sync(m + 1 == n);  // communicate on the last one
    strategy->backward(strategy->forward([&] { return loss_of(micro[m]); }) / n);
  }
  // clang-format on

  // clang-format off
  { auto guard = strategy->no_sync(); strategy->backward(first_micro_batch_loss); }
  // clang-format on
}

// ---- include/dtrain/device_mesh.h ----

void device_mesh(std::shared_ptr<dtrain::Store> store, dtrain::CommunicatorPtr world,
                 std::shared_ptr<torch::nn::Module> model, dtrain::FsdpOptions fsdp_options) {
  // clang-format off
  // 1-D: shard over every rank (FULL_SHARD, SHARD_GRAD_OP) or replicate (NO_SHARD):
  dtrain::DeviceMesh flat(world);
  // 2-D (HYBRID_SHARD): shard inside groups of 8 ranks, replicate across them:
  dtrain::DeviceMeshOptions o;
  o.shard_size = 8;
  o.local_world_size = 8;  // and host groups of 8
  dtrain::DeviceMesh mesh = dtrain::DeviceMesh::create(store, world, o);
  dtrain::FullyShardedDataParallel fsdp(model, mesh, fsdp_options);
  // clang-format on
  (void)flat;
}

// ---- include/dtrain/fsdp.h ----

dtrain::FsdpOptions fsdp_sequential_units() {
  // clang-format off
    struct EncoderImpl : torch::nn::Module {
      EncoderImpl() {
        for (int i = 0; i < 12; ++i) layers->push_back(torch::nn::TransformerEncoderLayer(768, 12));
      }
      at::Tensor forward(const at::Tensor& x) { return layers->forward(x); }
      torch::nn::Sequential layers = register_module("layers", torch::nn::Sequential());
    };
    dtrain::FsdpOptions o;
    o.wrap_policy = dtrain::wrap_modules_named("TransformerEncoderLayer");
  // clang-format on
  return o;
}

struct GptImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& idx);
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  at::Tensor pos;
  std::vector<torch::nn::Linear> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};
};

// clang-format off
    at::Tensor GptImpl::forward(const at::Tensor& idx) {
      at::Tensor x = wte(idx) + wpe(pos);
      for (auto& block : blocks) {
        x = dtrain::unit_call(*block, [&] { return block->forward(x); });
      }
      return lm_head(ln_f(x));
    }
// clang-format on

void fsdp_wrap_policy(Model model, dtrain::CommunicatorPtr comm) {
  // clang-format off
  dtrain::FsdpOptions o;
  o.wrap_policy = dtrain::wrap_modules_named("Block");    // or wrap_by_min_params(n)
  auto fsdp = std::make_shared<dtrain::FullyShardedDataParallel>(model, comm, o);
  // clang-format on
}

// ---- include/dtrain/deferred_init.h ----

struct NetConfig {
  int64_t width = 8;
};
struct Net : torch::nn::Module {
  explicit Net(const NetConfig& config)
      : fc(register_module("fc", torch::nn::Linear(config.width, config.width))) {}
  torch::nn::Linear fc;
};

void deferred_init(const NetConfig& config, uint64_t seed, dtrain::CommunicatorPtr comm) {
  // clang-format off
  auto model = std::make_shared<Net>(config);   // built as usual (allocates) ...
  dtrain::defer_parameters(*model);             // ... then its parameters' memory freed
  // (a large model defers each block right after building it: the peak is one block)
  dtrain::DeferredInit init{seed, [](const std::string& /*name*/, at::Tensor& p,
                                     at::Generator& gen) { p.normal_(0, 0.02, gen); }};
  dtrain::FsdpOptions o;
  o.deferred_init = init;                       // FSDP materialises only this rank's shard
  dtrain::FullyShardedDataParallel fsdp(model, comm, o);
  // clang-format on

  // clang-format off
  dtrain::init_parameters(*model, init);        // allocates and initialises every parameter
  // clang-format on
}

// ---- include/dtrain/comm_hook.h ----

// clang-format off
  class Fp64AverageHook : public dtrain::CommHook {
   public:
    dtrain::WorkPtr run(dtrain::Communicator& comm, dtrain::GradBucket& b) override {
      at::Tensor wide = b.buffer.to(at::kDouble);
      auto work = comm.all_reduce(wide, dtrain::ReduceOp::kAvg);
      return dtrain::then(work, [b = b.buffer, wide] { b.copy_(wide); });
    }
    std::string name() const override { return "fp64_average"; }
  };
// clang-format on

// ---- include/dtrain/powersgd.h ----

dtrain::DataParallelOptions powersgd() {
  // clang-format off
  dtrain::PowerSgdOptions o;
  o.rank = 2;
  dtrain::DataParallelOptions ddp;
  ddp.comm_hook = dtrain::powersgd_hook(o);
  // clang-format on
  return ddp;
}

// ---- include/dtrain/sync_batch_norm.h ----

void sync_batch_norm(dtrain::CommunicatorPtr comm) {
  // clang-format off
  auto model = std::make_shared<torch::nn::SequentialImpl>(
      torch::nn::Conv2d(3, 16, 3), torch::nn::BatchNorm2d(16), torch::nn::ReLU());
  dtrain::convert_sync_batch_norm(model, comm);   // before the strategy and the optimizer
  auto strategy = std::make_shared<dtrain::DataParallel>(model, comm);  // or FSDP
  // clang-format on
}

// ---- include/dtrain/autocast.h ----

at::Tensor autocast(std::shared_ptr<dtrain::Strategy> strategy, Model model, const at::Tensor& x,
                    const at::Tensor& y) {
  // clang-format off
  const dtrain::Autocast amp{c10::kCPU, c10::kBFloat16};
  at::Tensor loss = strategy->forward([&] {
    dtrain::AutocastGuard guard(amp);      // matmuls and linears of this forward in bf16
    return loss_fn(model->forward(x), y);  // loss_fn should compute in fp32 (see below)
  });
  strategy->backward(loss);                // outside the guard, as in PyTorch
  // clang-format on
  return loss;
}

// ---- include/dtrain/grad_scaler.h ----

void grad_scaler(dtrain::CommunicatorPtr comm, std::shared_ptr<dtrain::Strategy> strategy,
                 Model model, torch::optim::AdamW& opt, Loader& loader) {
  // clang-format off
  dtrain::GradScaler scaler(comm);                  // comm: every rank (null: one rank)
  for (auto& batch : loader) {
    opt.zero_grad();
    at::Tensor loss = strategy->forward([&] { return loss_fn(model->forward(batch.x), batch.y); });
    strategy->backward(scaler.scale(loss));         // gradients are S times too large
    scaler.unscale(opt);                            // now true gradients; finds inf/NaN
    strategy->clip_grad_norm(1.0);                  // clips true gradients
    scaler.step(opt);                               // opt.step() unless inf/NaN was found
    scaler.update();                                // halve or grow S
  }
  // clang-format on
}

// ---- include/dtrain/fused_adamw.h ----

void fused_adamw(dtrain::Strategy& strategy) {
  // clang-format off
  dtrain::FusedAdamW opt(strategy.parameters(), torch::optim::AdamWOptions(3e-4));
  // clang-format on
}

// ---- include/dtrain/activation_checkpoint.h ----

at::Tensor activation_checkpoint(torch::nn::Linear block, at::Tensor x) {
  // clang-format off
  x = dtrain::checkpoint([&](const at::Tensor& in) { return block->forward(in); }, x);
  // clang-format on
  return x;
}

// ---- include/dtrain/memory_plan.h ----

int64_t my_activation_estimate(int64_t batch) { return batch << 20; }
void build(const dtrain::PlannedStrategy&) {}

void memory_plan(int64_t batch, const dtrain::PlannedStrategy& requested) {
  // clang-format off
  dtrain::ModelMemory model;                         // what the model is
  model.parameters = 774'030'080;
  model.units = {64'328'960, 19'677'440};            // FSDP units (wrap policy), if any
  model.activation_bytes = my_activation_estimate(batch);
  dtrain::TrainingMemory training;                   // how it is trained
  training.world_size = 4;
  const int64_t budget = dtrain::default_memory_per_rank(/*local ranks*/ 4).value();
  dtrain::MemoryPlan plan = dtrain::plan_memory(model, training, budget);
  if (auto choice = plan.choice()) build(choice->strategy);  // "auto"
  dtrain::check_memory(model, training, requested, budget,   // or refuse
                       "MemAvailable shared by 4 ranks");
  // clang-format on
}

// ---- include/dtrain/checkpoint.h ----

void checkpoint(std::shared_ptr<dtrain::Strategy> strategy, torch::optim::AdamW& optimizer,
                int64_t step, int epoch) {
  // clang-format off
  dtrain::CheckpointOptions o;                       // sharded form, keep the last 2
  dtrain::TrainingState state;
  state.step = step;                                 // the LR schedule's position
  state.values["epoch"] = std::to_string(epoch);     // anything else the loop needs
  dtrain::save_checkpoint("ckpt", *strategy, &optimizer, state, o);   // every rank

  dtrain::CheckpointOptions bg;                      // or in the background:
  bg.async = true;
  dtrain::Checkpointer ckpt("ckpt", bg);            // one per directory, kept across steps
  ckpt.save(*strategy, &optimizer, state);           // blocks only for a copy to host memory
  // ... the training goes on while it writes ...
  ckpt.wait();                                       // before the end: complete, or throws

  std::string latest = dtrain::latest_checkpoint("ckpt");            // "" if none
  if (!latest.empty()) state = dtrain::load_checkpoint(latest, *strategy, &optimizer);
  // clang-format on
}

// ---- include/dtrain/safetensors.h ----

void safetensors(int64_t b, int64_t e, std::vector<std::string>& names) {
  // clang-format off
  dtrain::SafetensorsReader r("model.safetensors");     // maps the file, checks the header
  for (const auto& t : r.tensors()) names.push_back(t.name);  // also dtype, shape, bytes
  at::Tensor w = r.read("wte.weight");                   // a whole tensor (CPU, owned)
  at::Tensor rows = r.read_elements("wte.weight", b, e); // flattened elements [b, e), 1-D

  dtrain::write_safetensors("out.safetensors", {{"w", w}}, {{"format", "pt"}});
  // clang-format on
}

// ---- include/dtrain/crc32c.h ----

uint32_t crc32c(const void* data, size_t n, const void* more, size_t m) {
  // clang-format off
  uint32_t crc = dtrain::crc32c(0, data, n);        // a fresh checksum
  crc = dtrain::crc32c(crc, more, m);               // continued over more bytes
  // clang-format on
  return crc;
}

// ---- include/dtrain/json.h ----

int64_t json(const std::string& text) {
  int64_t step = 0;
  // clang-format off
  const dtrain::Json j = dtrain::Json::parse(text);   // throws dtrain::JsonError
  for (const auto& [key, value] : j.as_object()) {   // in the file's order
    if (key == "step") step = value.as_int();        // throws if not an integer
  }
  // clang-format on
  return step;
}

// ---- include/dtrain/launcher.h ----

int launcher(int argc, char** argv, int nproc) {
  // clang-format off
  if (std::getenv("RANK") == nullptr && nproc > 1) {  // not started by a launcher
    dtrain::launcher::NodeOptions node;
    node.argv = dtrain::launcher::self_command(argc, argv);
    node.nproc_per_node = nproc;
    return dtrain::launcher::run_node(node);  // runs this program once per rank
  }
  auto comm = dtrain::init_communicator(dtrain::LaunchInfo::from_env());
  // clang-format on
  return comm->rank();
}

// ---- include/dtrain/preemption.h ----

void train_step(int64_t) {}

void preemption(int64_t start, int64_t steps, dtrain::CommunicatorPtr comm,
                std::shared_ptr<dtrain::Strategy> strategy, torch::optim::AdamW& opt,
                dtrain::Checkpointer& checkpointer, dtrain::TrainingState& state) {
  // clang-format off
  dtrain::StopSignal stop;  // SIGTERM and SIGINT now set a flag instead of killing
  for (int64_t step = start; step < steps; ++step) {
    train_step(step);                               // forward, backward, optimizer step
    if (const int sig = stop.should_stop(*comm)) {  // collective: every rank, every step
      state.step = step + 1;                        // optimizer steps taken
      checkpointer.save(*strategy, &opt, state);    // the same step on every rank
      break;                                        // or exit with 128 + sig
    }
  }
  strategy->finish();
  // clang-format on
}

// ---- include/dtrain/mpi.h ----

#if DTRAIN_HAS_MPI
void train(dtrain::DataParallel&) {}

void mpi(int argc, char** argv, int world_rank, Model model) {
  int provided = 0;
  // clang-format off
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // the application's MPI
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank % 2, world_rank, &half);
  if (world_rank % 2 == 0) {
    auto comm = dtrain::init_communicator(half);  // ranks and size are half's
    dtrain::DataParallel ddp(model, comm);        // train as under any launcher
    train(ddp);
  }  // destroy dtrain's communicators before MPI_Finalize
  MPI_Finalize();
  // clang-format on
}
#endif

// ---- README.md ----

void readme_communicator() {
  // clang-format off
  auto comm = dtrain::init_communicator(dtrain::LaunchInfo::from_env());
  at::Tensor t = at::ones({4});
  comm->all_reduce(t, dtrain::ReduceOp::kAvg)->wait();
  // clang-format on
}

}  // namespace dtrain_header_examples
