#include "fsdp/unit.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <utility>

#include <fmt/format.h>

#include "compat/torch_compat.h"
#include "compress/quantized_all_gather.h"
#include "compress/quantized_reduce_scatter.h"

namespace dtrain::fsdp {

WorkPtr reduce_scatter_grads(const UnitComms& c, at::Tensor out, const at::Tensor& flat,
                             int64_t* bytes) {
  if (c.quantize_grads == Quantization::kNone) {
    *bytes = static_cast<int64_t>(flat.nbytes());
    return c.shard->reduce_scatter(std::move(out), flat, ReduceOp::kAvg);
  }
  if (c.grad_host) {
    return detail::hierarchical_quantized_reduce_scatter(*c.shard, *c.grad_host, std::move(out),
                                                         flat, c.quantize_grads,
                                                         c.quantization_block, bytes);
  }
  return detail::quantized_reduce_scatter(*c.shard, std::move(out), flat, c.quantize_grads,
                                          c.quantization_block, bytes);
}

using Clock = std::chrono::steady_clock;

const char* Unit::name_of(ParamState s) {
  switch (s) {
    case ParamState::kSharded:
      return "SHARDED";
    case ParamState::kShardedPostForward:
      return "SHARDED_POST_FORWARD";
    case ParamState::kGathering:
      return "GATHERING";
    case ParamState::kUnsharded:
      return "UNSHARDED";
  }
  return "?";
}

const char* Unit::name_of(GradState s) {
  switch (s) {
    case GradState::kIdle:
      return "IDLE";
    case GradState::kAccumulating:
      return "ACCUMULATING";
    case GradState::kHeld:
      return "HELD";
    case GradState::kReducing:
      return "REDUCING";
    case GradState::kReplicating:
      return "REPLICATING";
    case GradState::kReduced:
      return "REDUCED";
  }
  return "?";
}

Unit::Unit(int index, std::string name, FlatParam flat, const UnitComms* comms,
           UnitObserver* observer)
    : index_(index),
      name_(std::move(name)),
      flat_(std::move(flat)),
      comms_(comms),
      observer_(observer) {}

ErrorContext Unit::ctx(const char* op) const {
  return ErrorContext{comms_->rank, comms_->world_size, op, -1};
}

void Unit::expect(const char* transition, ParamState from) {
  if (state_ == from) return;
  observer_->failed();
  throw Error(ctx(transition), fmt::format("internal error: unit '{}' is {}, {} needs {}", name_,
                                           name_of(state_), transition, name_of(from)));
}

void Unit::expect(const char* transition, GradState from) {
  if (grad_ == from) return;
  observer_->failed();
  throw Error(ctx(transition), fmt::format("internal error: unit '{}' gradient is {}, {} needs {}",
                                           name_, name_of(grad_), transition, name_of(from)));
}

void Unit::expect(const char* transition, GradState from, GradState or_from) {
  if (grad_ == from || grad_ == or_from) return;
  observer_->failed();
  throw Error(ctx(transition),
              fmt::format("internal error: unit '{}' gradient is {}, {} needs {} or {}", name_,
                          name_of(grad_), transition, name_of(from), name_of(or_from)));
}

template <typename Fn>
void Unit::collective(Fn&& fn) {
  try {
    fn();
  } catch (...) {
    observer_->failed();
    throw;
  }
}

// --- parameters ---

void Unit::unshard(const char* why) {
  if (state_ == ParamState::kShardedPostForward) {
    unshard_from_host(why);
    return;
  }
  expect("unshard", ParamState::kSharded);
  c10::NoGradGuard no_grad;
  flat_.refill();
  if (!comms_->shard) {
    flat_.copy_shard_to_full();
    flat_.refresh_fp32_copies();
    state_ = ParamState::kUnsharded;
  } else {
    gather_input_ = flat_.gather_input();
    int64_t bytes = static_cast<int64_t>(gather_input_.nbytes());
    if (comms_->quantize_params != Quantization::kNone) {
      collective([&] {
        gather_work_ = detail::quantized_all_gather(*comms_->shard, flat_.full(), gather_input_,
                                                    comms_->quantize_params,
                                                    comms_->quantization_block, &bytes);
      });
    } else {
      collective([&] { gather_work_ = comms_->shard->all_gather(flat_.full(), gather_input_); });
    }
    observer_->issued(Collective::kAllGather, index_, bytes);
    state_ = ParamState::kGathering;
  }
  observer_->record(fmt::format("all_gather:{}{}", name_, why));
}

// The parameters did not change since the forward that left the host pieces (the shards are
// stepped only after backward), so gathering them back gives full's forward contents exactly.
void Unit::unshard_from_host(const char* why) {
  c10::NoGradGuard no_grad;
  flat_.refill();
  if (!comms_->host) {
    flat_.copy_into_full(host_piece_);
    flat_.refresh_fp32_copies();
    host_piece_ = at::Tensor();
    state_ = ParamState::kUnsharded;
  } else {
    gather_input_ = std::move(host_piece_);
    host_piece_ = at::Tensor();
    collective([&] { gather_work_ = comms_->host->all_gather(flat_.full(), gather_input_); });
    observer_->issued(Collective::kHostAllGather, index_,
                      static_cast<int64_t>(gather_input_.nbytes()));
    state_ = ParamState::kGathering;
  }
  observer_->record(fmt::format("all_gather_host:{}{}", name_, why));
}

void Unit::wait_unsharded() {
  expect("wait_unsharded", ParamState::kGathering);
  const auto start = Clock::now();
  collective([&] { gather_work_->wait(); });
  observer_->waited(Clock::now() - start);
  gather_work_.reset();
  gather_input_ = at::Tensor();
  flat_.refresh_fp32_copies();
  state_ = ParamState::kUnsharded;
}

void Unit::reshard() {
  expect("reshard", ParamState::kUnsharded);
  flat_.release();
  state_ = ParamState::kSharded;
}

void Unit::reshard_to_host() {
  expect("reshard_to_host", ParamState::kUnsharded);
  c10::NoGradGuard no_grad;
  const int64_t piece = flat_.padded() / comms_->host_size;
  host_piece_ = flat_.full().detach().narrow(0, comms_->host_rank * piece, piece).clone();
  flat_.release();
  state_ = ParamState::kShardedPostForward;
}

void Unit::ensure_unsharded() {
  if (state_ == ParamState::kSharded || state_ == ParamState::kShardedPostForward) unshard("");
  if (state_ == ParamState::kGathering) wait_unsharded();
}

void Unit::reshard_any() {
  if (state_ == ParamState::kGathering) wait_unsharded();
  if (state_ == ParamState::kUnsharded) reshard();
  if (state_ == ParamState::kShardedPostForward) {
    host_piece_ = at::Tensor();
    state_ = ParamState::kSharded;
  }
}

// --- gradient ---

void Unit::arm() {
  expect("arm", GradState::kIdle, GradState::kHeld);
  pending_ = static_cast<int>(flat_.num_params());
  grad_ = GradState::kAccumulating;
}

bool Unit::gradient_arrived() {
  expect("gradient arrival", GradState::kAccumulating);
  return --pending_ == 0;
}

void Unit::stop_waiting() {
  if (grad_ == GradState::kAccumulating) pending_ = 0;
}

void Unit::hold() {
  expect("hold", GradState::kAccumulating);
  reshard_any();  // the unit's backward is over, as in launch_reduction()
  flat_.add_grads_to(held_);
  grad_ = GradState::kHeld;
}

void Unit::launch_reduction() {
  expect("launch_reduction", GradState::kAccumulating);
  c10::NoGradGuard no_grad;
  // The unit's backward is over (all its gradients arrived): its parameters go before the
  // flat gradient is allocated, so a unit's peak is its gradients twice, not three times.
  // A unit that got no gradient may still be sharded or gathering (prefetched).
  reshard_any();
  at::Tensor flat;
  if (held_.defined()) {
    // The micro-batches' sum is taken in fp32, then reduced in the reduce dtype.
    flat_.add_grads_to(held_);
    flat = held_.to(comms_->reduce_dtype);
    held_ = at::Tensor();
  } else {
    flat = flat_.take_grads(comms_->reduce_dtype);
  }
  if (comms_->shard) {
    reduce_out_ = at::empty({flat_.shard_numel()}, flat.options());
    int64_t bytes = 0;
    collective([&] { reduce_work_ = reduce_scatter_grads(*comms_, reduce_out_, flat, &bytes); });
    observer_->issued(Collective::kReduceScatter, index_, bytes);
    observer_->record("reduce_scatter:" + name_);
  } else {
    reduce_out_ = flat;
  }
  grad_ = GradState::kReducing;
}

void Unit::replicate() {
  expect("replicate", GradState::kReducing);
  if (!comms_->replicate) {
    observer_->failed();
    throw Error(ctx("replicate"),
                fmt::format("internal error: unit '{}' has no replicas to all-reduce over", name_));
  }
  if (reduce_work_) {
    const auto start = Clock::now();
    collective([&] { reduce_work_->wait(); });
    observer_->waited(Clock::now() - start);
  }
  reduce_work_.reset();
  collective([&] { replicate_work_ = comms_->replicate->all_reduce(reduce_out_, ReduceOp::kAvg); });
  observer_->issued(Collective::kAllReduce, index_, static_cast<int64_t>(reduce_out_.nbytes()));
  observer_->record("all_reduce:" + name_);
  grad_ = GradState::kReplicating;
}

void Unit::complete_reduction() {
  // With replicas the reduction is complete only once replicated.
  expect("complete_reduction", comms_->replicate ? GradState::kReplicating : GradState::kReducing);
  c10::NoGradGuard no_grad;
  WorkPtr& work = comms_->replicate ? replicate_work_ : reduce_work_;
  if (work) collective([&] { work->wait(); });
  work.reset();
  reduce_out_ = reduce_out_.to(at::kFloat);
  grad_ = GradState::kReduced;
}

void Unit::accumulate() {
  expect("accumulate", GradState::kReduced);
  flat_.add_to_shard_grad(reduce_out_);
  reduce_out_ = at::Tensor();
  grad_ = GradState::kIdle;
}

// Any state -> SHARDED / IDLE, the gradient (also a held one) dropped. Only after the step's
// collectives completed on this rank (the works are waited for here, never abandoned while
// they write).
void Unit::reset() {
  c10::NoGradGuard no_grad;
  for (WorkPtr* w : {&gather_work_, &reduce_work_, &replicate_work_}) {
    if (*w) {
      try {
        (*w)->wait();
      } catch (...) {
        // it failed: its buffers are no longer written; the failure was reported already
      }
      w->reset();
    }
  }
  gather_input_ = at::Tensor();
  host_piece_ = at::Tensor();
  reduce_out_ = at::Tensor();
  held_ = at::Tensor();
  if (state_ != ParamState::kSharded) {
    state_ = ParamState::kUnsharded;
    reshard();
  }
  grad_ = GradState::kIdle;
  pending_ = 0;
  for (size_t i = 0; i < flat_.num_params(); ++i) flat_.param(i).mutable_grad().reset();
  flat_.zero_shard_grad();
}

}  // namespace dtrain::fsdp
