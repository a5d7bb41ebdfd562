// Recognising LibTorch's autograd errors that have no type or code of their own. The only
// place dtrain reads LibTorch's message text; tests/strategy/fsdp_no_edit_test.cpp
// ("LibTorchSavedTensorError") makes LibTorch raise each one, so a release that rewords a
// message fails that test instead of silently losing the explanation dtrain adds.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace dtrain::compat {

// Backward read a tensor that autograd saved for it and that was modified in place since
// (its version counter moved). LibTorch raises a plain c10::Error; only its text says so.
inline bool is_saved_tensor_modified(const c10::Error& e) {
  return std::string(e.what_without_backtrace()).find("modified by an inplace operation") !=
         std::string::npos;
}

}  // namespace dtrain::compat
