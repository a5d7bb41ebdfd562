#include "token_embedding.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <fmt/format.h>

#include "dtrain/errors.h"

namespace gpt2 {
namespace {

// The table's rows for `idx` with a sparse gradient: at::embedding(..., sparse=true), except
// that autograd keeps only the indices and the row count. LibTorch 1.13's own embedding node
// also keeps the table (for its row count), so its backward would count as reading the
// table, and FSDP would have to gather it for that (dtrain::ParamsInBackward).
struct TokenLookup : torch::autograd::Function<TokenLookup> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& table,
                            const at::Tensor& idx) {
    ctx->save_for_backward({idx});
    ctx->saved_data["rows"] = table.size(0);
    return at::embedding(table, idx, /*padding_idx=*/-1, /*scale_grad_by_freq=*/false,
                         /*sparse=*/true);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const at::Tensor idx = ctx->get_saved_variables()[0];
    return {at::embedding_backward(grad[0], idx, ctx->saved_data["rows"].toInt(),
                                   /*padding_idx=*/-1, /*scale_grad_by_freq=*/false,
                                   /*sparse=*/true),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor embed_tokens(torch::nn::Embedding tokens, torch::nn::Embedding positions,
                        const at::Tensor& idx, int64_t context, const char* model,
                        bool sparse_grad) {
  const int64_t T = idx.size(1);
  if (T > context) {
    throw dtrain::InvalidArgument(
        fmt::format("{} forward: sequence of {} tokens exceeds the context {}", model, T, context));
  }
  at::Tensor pos = at::arange(T, idx.options().dtype(at::kLong));
  // Sparse: the dense backward would zero and fill a [vocab, dim] table (147 MiB for
  // GPT-2 small) only to add it to the tied head's gradient (see token_embedding.h).
  at::Tensor tok =
      sparse_grad ? TokenLookup::apply(tokens->weight, idx) : at::embedding(tokens->weight, idx);
  return tok + positions->forward(pos);
}

}  // namespace gpt2
