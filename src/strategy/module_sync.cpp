#include "strategy/module_sync.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/control_plane.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

std::string signature_line(const std::string& name, const at::Tensor& t) {
  return fmt::format("{} {} [{}]", name, c10::toString(t.scalar_type()),
                     fmt::join(t.sizes(), ", "));
}

}  // namespace

void verify_same_model(Communicator& comm,
                       const std::vector<std::pair<std::string, at::Tensor>>& named,
                       const char* op) {
  const int world = comm.world_size();
  if (world == 1) return;
  std::string sig;
  for (const auto& [name, t] : named) sig += signature_line(name, t) + "\n";
  // Exchange every rank's signature so that every rank reaches the same verdict and
  // throws the same message: a mismatch must never leave one rank waiting on the others.
  const std::vector<std::string> all = ControlPlane(comm).all_gather_bytes(sig);
  auto lines_of = [&](int r) {
    const std::string& s = all[static_cast<size_t>(r)];
    std::vector<std::string> lines;
    size_t start = 0;
    for (size_t nl; (nl = s.find('\n', start)) != std::string::npos; start = nl + 1)
      lines.push_back(s.substr(start, nl - start));
    return lines;
  };
  const auto reference = lines_of(0);
  for (int r = 1; r < world; ++r) {
    const auto other = lines_of(r);
    for (size_t i = 0; i < std::max(reference.size(), other.size()); ++i) {
      const std::string a = i < reference.size() ? reference[i] : "(nothing)";
      const std::string b = i < other.size() ? other[i] : "(nothing)";
      if (a != b) {
        throw InvalidArgument(
            ErrorContext{comm.rank(), world, op, -1},
            fmt::format("model differs between ranks: tensor #{} is '{}' on rank 0 but '{}' on "
                        "rank {}",
                        i, a, b, r));
      }
    }
  }
}

void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& tensors) {
  if (comm.world_size() == 1) return;
  c10::NoGradGuard no_grad;
  std::vector<std::pair<at::Tensor, at::Tensor>> pending;  // (target, contiguous copy)
  std::vector<WorkPtr> works;
  for (const auto& t : tensors) {
    at::Tensor c = t.is_contiguous() ? t : t.contiguous();
    works.push_back(comm.broadcast(c, 0));
    if (!t.is_contiguous()) pending.emplace_back(t, c);
  }
  for (auto& w : works) w->wait();
  for (auto& [t, c] : pending) t.copy_(c);
}

void agree_on_initial_state(Communicator& comm, torch::nn::Module& module, const char* op,
                            bool broadcast_parameters) {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::vector<at::Tensor> broadcast;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    named.emplace_back(item.key(), item.value());
    if (broadcast_parameters) broadcast.push_back(item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    named.emplace_back("buffer " + item.key(), item.value());
    broadcast.push_back(item.value());
  }
  verify_same_model(comm, named, op);
  broadcast_from_rank0(comm, broadcast);
}

}  // namespace dtrain
