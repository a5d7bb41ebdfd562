#include "comm/mpi/mpi_types.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

namespace dtrain::mpi_backend {
namespace {

// MPI_User_function for 16-bit floats: in ⊕ inout → inout, computed in float and rounded
// once per element, as the Gloo engine does.
template <typename T, int kind>
void reduce16(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = static_cast<float>(a[i]);
    const float y = static_cast<float>(b[i]);
    b[i] = static_cast<T>(kind == 0 ? x + y : kind == 1 ? std::min(x, y) : std::max(x, y));
  }
}

template <typename T>
void create(MPI_Op (&ops)[3]) {
  MPI_Op_create(&reduce16<T, 0>, /*commute=*/1, &ops[0]);
  MPI_Op_create(&reduce16<T, 1>, 1, &ops[1]);
  MPI_Op_create(&reduce16<T, 2>, 1, &ops[2]);
}

int index_of(ReduceOp reduce) {
  return reduce == ReduceOp::kMin ? 1 : reduce == ReduceOp::kMax ? 2 : 0;
}

}  // namespace

MPI_Datatype datatype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      return MPI_FLOAT;
    case c10::kDouble:
      return MPI_DOUBLE;
    case c10::kHalf:
    case c10::kBFloat16:
      return MPI_UINT16_T;
    case c10::kByte:
      return MPI_UINT8_T;
    case c10::kChar:
      return MPI_INT8_T;
    case c10::kShort:
      return MPI_INT16_T;
    case c10::kInt:
      return MPI_INT32_T;
    case c10::kLong:
      return MPI_INT64_T;
    default:
      return MPI_DATATYPE_NULL;
  }
}

std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(length));
}

Reductions::Reductions() {
  create<c10::Half>(half_);
  create<c10::BFloat16>(bf16_);
}

Reductions::~Reductions() {
  for (MPI_Op& op : half_) MPI_Op_free(&op);
  for (MPI_Op& op : bf16_) MPI_Op_free(&op);
}

MPI_Op Reductions::op(c10::ScalarType dtype, ReduceOp reduce) const {
  if (dtype == c10::kHalf) return half_[index_of(reduce)];
  if (dtype == c10::kBFloat16) return bf16_[index_of(reduce)];
  switch (reduce) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return MPI_SUM;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
  }
  return MPI_OP_NULL;
}

}  // namespace dtrain::mpi_backend
