// GPU memory of the trainer: the CUDA caching allocator's peak, what PyTorch's
// torch.cuda.max_memory_allocated() reports. Reachable only through c10::cuda, so the code
// that reads it is compiled only against a LibTorch built with CUDA (GPT2_HAS_C10_CUDA).
#pragma once

#include <cstdint>
#include <optional>

namespace gpt2 {

// Peak bytes (MiB) the caching allocator handed out on `device` since the process started;
// nullopt with a LibTorch without CUDA.
std::optional<double> cuda_peak_mib(int device);

// Total memory of CUDA device `device` in bytes (the memory planner's default budget);
// nullopt where this build cannot ask the CUDA runtime (GPT2_HAS_CUDART) or it fails.
std::optional<int64_t> cuda_total_bytes(int device);

}  // namespace gpt2
