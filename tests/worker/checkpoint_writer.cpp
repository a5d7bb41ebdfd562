#include "checkpoint_writer.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "checkpoint/directory.h"
#include "checkpoint/progress.h"
#include "checkpoint/safetensors.h"
#include "dtrain/checkpoint.h"
#include "dtrain/fsdp.h"
#include "strategy/training.h"

namespace dtrain::testing {

int checkpoint_writer(const std::string& dir, const std::string& pause_at) {
  namespace ck = dtrain::checkpoint;
  try {
    for (int64_t step = 1; step <= 2; ++step) {
      auto progress = [&](const char* point) {
        if (step != 2 || point != pause_at) return;
        std::ofstream(std::filesystem::path(dir).parent_path() / "paused") << point << "\n";
        for (;;) ::pause();  // until SIGKILL
      };
      const std::string tmp = ck::prepare_temp(dir, step);
      progress("tmp_created");
      // 4 tensors of 1 MiB filled with the step: several checksum chunks, a middle to stop in.
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      for (int i = 0; i < 4; ++i) {
        tensors.emplace_back("t" + std::to_string(i),
                             at::full({1 << 18}, static_cast<float>(step)));
      }
      const auto digest = ck::write_safetensors(tmp + "/data.safetensors", tensors, {}, progress);
      Json files = Json::object();
      files.set("data.safetensors", ck::digest_to_json(digest));
      Json manifest = Json::object();
      manifest.set("step", step);
      manifest.set("files", std::move(files));
      progress("files_written");
      ck::write_manifest(tmp, manifest);
      ck::commit_temp(dir, step, progress);
      ck::prune(dir, 2);
    }
    std::printf("saved\n");
    return 0;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
}

void sharded_checkpoint_writer(const std::shared_ptr<Communicator>& comm, const std::string& dir,
                               const std::string& pause_at, int pause_rank) {
  at::set_num_threads(1);
  auto module = make_model(Model::kTransformer, 7);
  FsdpOptions o;
  o.wrap_policy = wrap_modules_named("BlockImpl");
  FullyShardedDataParallel fsdp(module, comm, o);
  for (int64_t step = 1; step <= 2; ++step) {
    {
      at::NoGradGuard no_grad;
      for (auto& p : fsdp.parameters()) p.fill_(static_cast<float>(step));
    }
    CheckpointOptions options;
    options.format = CheckpointFormat::kSharded;
    detail::CheckpointProgress::set(options, [&](const char* point) {
      if (step != 2 || comm->rank() != pause_rank || point != pause_at) return;
      std::ofstream(std::filesystem::path(dir).parent_path() /
                    ("paused." + std::to_string(pause_rank)))
          << point << "\n";
      for (;;) ::pause();  // until SIGKILL
    });
    TrainingState state;
    state.step = step;
    save_checkpoint(dir, fsdp, nullptr, state, options);
  }
}

}  // namespace dtrain::testing
